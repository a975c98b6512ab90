"""Rollouts: prompts in, experience out. `experience` (what a rollout hands to the loss), `loader` (the
Trainer's train dataloader of experience), `rollout_maker` (generate, score, reference, advantages),
`multiturn` (turns with tools), `shared_prompts` (a prompt's completions in one row)."""
