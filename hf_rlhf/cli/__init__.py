"""The command line: the `hf-rlhf` command, and what the recipes (`recipes/*.py`) share, one module per job.

The command:
- `main`: `hf-rlhf <command>` (chain, sft, reward, ppo, dpo, kto, merge, env); `python -m hf_rlhf.cli` is the same
- `launch`: a training command's hand-over to `accelerate launch`, as `trl <command>` does it
- `recipes`: where the recipes are (the checkout's `recipes/`, or `hf_rlhf.recipes` in a wheel)
- `environment`: `hf-rlhf env`

What the recipes share:
- `arguments`: argv and `--config file.yaml` into the recipe's dataclasses (trl's `TrlParser`), option checks
- `data_loading`: datasets read and checked before any model loads; PPO's prompts; reward functions by name
- `resume`: `--resume_from_checkpoint` and the whole run's metrics after a resume
- `evaluation`: held-out greedy evaluation and the KL summary
- `results`: results.json, and the exit after a non-finite stop
- `printing`: what a finished run prints (and the toy chain's closing note)
- `errors`: a bad option or input as one `[hf_rlhf] error: ...` line
- `allocator`: the C heap's freed memory kept for the next step (glibc's `mallopt`)
"""
