"""The toy tool task (issue 21): greedy exact match of an SFT policy that calls a calculator, then of that policy
after GRPO with the tool, on long additions (`hf_rlhf.toy.tool_task`).

    python bench/tools_toy.py                      # SFT then RL with tools; prints one JSON line per phase
    python bench/tools_toy.py --sft_steps 300 --rl_steps 20 --digits 5

SFT trains a toy Llama from scratch on tool-call demonstrations (assistant turns only); its greedy exact match with
the tool is measured on held-out prompts, then GRPO (G completions per prompt, tools, `tool_reward`) continues from
it and the same evaluation is repeated. One process, fp32, CPU. No comparison with RL without tools is made here.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def sample_completions(model, tokenizer, rows):
    """The greedy multi-turn completions (message lists) of a few rows, to see what the policy does."""
    import torch

    from hf_rlhf.rollout.multiturn import ToolRollout
    from hf_rlhf.tools import ToolRunner, tool_dict
    from hf_rlhf.toy.tool_task import add

    loop = ToolRollout(tokenizer, tokenizer.eos_token_id, 120, 2, ToolRunner(2, 10))
    out = []
    for row in rows:
        ids = torch.tensor([tokenizer.apply_chat_template(row["prompt"], tools=[add], add_generation_prompt=True,
                                                          return_dict=False)])

        def generate(ids, mask, n):
            out_ids = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            return out_ids[:, ids.shape[1]:]

        out.append([row["prompt"][0]["content"], loop.run(generate, ids, torch.ones_like(ids),
                                                          [tool_dict([add])]).completions[0]])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--digits", type=int, default=5)
    parser.add_argument("--sft_examples", type=int, default=3000)
    parser.add_argument("--sft_steps", type=int, default=400)
    parser.add_argument("--rl_steps", type=int, default=20)
    parser.add_argument("--rl_lr", type=float, default=2e-5)
    parser.add_argument("--model_size", default="small")
    parser.add_argument("--eval_size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from hf_rlhf import PPOConfig, PPOTrainer, SFTConfig, SFTTrainer
    from hf_rlhf.toy import (
        build_toy_model,
        build_toy_tool_tokenizer,
        tool_exact_match,
        tool_prompt_dataset,
        tool_reward,
        tool_sft_dataset,
    )
    from hf_rlhf.toy.tool_task import add

    torch.set_num_threads(args.threads)
    tokenizer = build_toy_tool_tokenizer()
    held_out = list(tool_prompt_dataset(args.eval_size, seed=999, digits=args.digits))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        sft_args = SFTConfig(output_dir=f"{tmp}/sft", max_steps=args.sft_steps, per_device_train_batch_size=16,
                             learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=0.05, weight_decay=0.0,
                             adam_beta2=0.95, max_grad_norm=1.0, assistant_only_loss=True, max_length=160,
                             logging_steps=50, save_strategy="no", report_to="none", seed=0, disable_tqdm=True)
        sft = SFTTrainer(build_toy_model(tokenizer, args.model_size, seed=0), args=sft_args,
                         train_dataset=tool_sft_dataset(args.sft_examples, seed=0, digits=args.digits),
                         processing_class=tokenizer)
        sft.train()
        policy = sft.model
        sft_seconds = time.perf_counter() - start
        print(json.dumps({"phase": "sft", "seconds": round(sft_seconds, 1),
                          **tool_exact_match(policy, tokenizer, held_out)}), flush=True)
        print(json.dumps({"phase": "sft_sample", "completions": sample_completions(policy, tokenizer, held_out[:2])}),
              flush=True)

        start = time.perf_counter()
        rl_args = PPOConfig(output_dir=f"{tmp}/rl", advantage_estimator="grpo", num_generations=8,
                            per_device_train_batch_size=16, rollout_batch_size=32, num_ppo_epochs=1,
                            response_length=120, max_steps=args.rl_steps, learning_rate=args.rl_lr, kl_coef=0.0,
                            temperature=0.7, max_tool_calling_iterations=2, logging_steps=5, save_strategy="no",
                            report_to="none", seed=0, disable_tqdm=True)
        rl = PPOTrainer(policy, tool_reward, args=rl_args, processing_class=tokenizer, tools=[add],
                        train_dataset=tool_prompt_dataset(512, seed=1, digits=args.digits))
        rl.train()
        rl_seconds = time.perf_counter() - start
        logs = [h for h in rl.state.log_history if "tools/call_frequency" in h]
        print(json.dumps({"phase": "rl_with_tools", "seconds": round(rl_seconds, 1),
                          "train_scores_first_last": [logs[0]["objective/scores"], logs[-1]["objective/scores"]],
                          **tool_exact_match(rl.model.policy, tokenizer, held_out)}), flush=True)


if __name__ == "__main__":
    main()
