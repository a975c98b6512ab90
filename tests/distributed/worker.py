"""Tiny training runs for the distributed tests, launched by `torchrun` / `accelerate launch` (or plain python).

    python tests/distributed/worker.py --task TASK[,TASK...] --out DIR [--steps 4] [--global_batch 8]
        TASK: sft, sft_lora, reward, dpo, dpo_lora, kto, ppo, grpo, rloo, reinforce_pp, grpo_dynamic, grpo_tools or
        distill,
        optionally ending in @<generation_backend> (PPO tasks; default generate), e.g. ppo@lean
    python tests/distributed/worker.py --recipe ppo --out DIR <recipe options>   # records who writes what

Several tasks run one after another in the same processes (a launch's start, ~20 s of imports and process-group
set-up on 2 cores, is paid once for all of them); each builds its own models, config and trainer, and the previous
trainer is released first (its DeepSpeed engine and ZeRO-3 config with it). The same global batch in every launch:
each of the W processes takes `global_batch / W` rows per step (the PPO rollout: `global_batch / W` prompts per
rank). Everything is deterministic: fp32, dropout 0 (the toy models have none), fixed seeds, and greedy generation
in PPO (sampled responses would depend on how the prompts are split over the ranks' random generators). Writes, per
task, under DIR/<task> (e.g. DIR/ppo@lean):

  losses.json     rank 0: {"loss": [per optimizer step], "log_history": [...], "world_size": W,
                  "wall_s": the task's seconds}
  rank<r>.json    every rank: {"kl_coef": β at the end (PPO), "writes": [files this rank opened for writing]}
  out/            the saved model (trainer.save_model), then plots / completions / trainer_state.json (rank 0)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

from hf_rlhf.cli.errors import close_process_group

TASKS = ("sft", "sft_lora", "reward", "dpo", "dpo_lora", "kto", "ppo", "grpo", "rloo", "reinforce_pp", "grpo_dynamic",
         "grpo_tools", "distill", "rloo_trainer")
# PPOTrainer's critic-free estimators, each with the options whose statistics cross ranks: GRPO's k3 in the loss with
# the per-sequence loss_type, RLOO's batch-whitened advantages, REINFORCE++'s globally whitened returns
ESTIMATORS = {
    "grpo": dict(advantage_estimator="grpo", num_generations=2, kl_in_loss=True, kl_estimator="k3", loss_type="grpo"),
    # the rollout's own policy forward: greedy groups whose completions agree have advantages that cancel a gradient
    # exactly, and old log-probs read off each rank's decoding of its B/2 rows (not the single process's B) round
    # apart, which Adam turns into a step (1e-3 on a reloaded logit); the ppo and reinforce_pp tasks compare the
    # decoding's log-probs (logprobs_from_generation) across processes
    "rloo": dict(advantage_estimator="rloo", num_generations=2, normalize_advantages=True, loss_type="dr_grpo",
                 logprobs_from_generation=False),
    "reinforce_pp": dict(advantage_estimator="reinforce_pp"),
    # DAPO's dynamic sampling: sampled rollouts, a binary reward, so ranks drop different numbers of groups
    "grpo_dynamic": dict(advantage_estimator="grpo", num_generations=4, filter_groups=True, max_num_gen_batches=3,
                         epsilon_high=0.28),
}


def has_a_one(prompts, completions, **kwargs):
    """A binary reward: many groups of the random policy's samples score all 0 (dynamic sampling drops those)."""
    return [float("1" in c) for c in completions]


class WriteRecorder:
    """Every file or directory under `root` this process opens for writing, renames or creates (an audit hook).

    Python's own `open`, `os.open`, `os.rename`/`os.replace` and `os.mkdir` raise audit events (PEP 578); writes
    done in native code (safetensors) do not, but those go through the Trainer's `should_save` guard. An audit hook
    cannot be removed: `start(root)` points the one hook at the next task's directory and empties `writes`.
    """

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

    def __init__(self):
        self.root, self.writes = None, []
        sys.addaudithook(self.hook)

    def start(self, root: str) -> None:
        self.root, self.writes = os.path.abspath(root), []

    def under_root(self, path) -> str | None:
        if self.root is None or isinstance(path, int) or path is None:
            return None
        path = os.path.abspath(os.fsdecode(path))
        return os.path.relpath(path, self.root) if path.startswith(self.root + os.sep) else None

    def hook(self, event, args):
        if event == "open":
            path, mode, flags = args
            writing = any(c in (mode or "") for c in "wax+") or (mode is None and flags & self.write_flags)
            if writing and (rel := self.under_root(path)) is not None:
                self.writes.append(rel)
        elif event in ("os.rename", "os.mkdir"):
            if (rel := self.under_root(args[1] if event == "os.rename" else args[0])) is not None:
                self.writes.append(rel)


def digit_reward(prompts, completions, **kwargs):
    """A reward that varies with the random policy's text (the toy answers are never right at first)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


class SecondChoiceOnOddRows:
    """A logits processor for greedy rollouts: rows 1, 3, 5, ... take their second most likely token at every step.

    Greedy decoding gives a prompt's 2 samples the same completion, and a group baseline then cancels their
    gradients exactly (what is left is rounding noise, which Adam turns into full-size steps). Each rank generates
    whole groups in order, so a row's place in its group (row % 2) is the same in every launch.
    """

    def __call__(self, input_ids, scores):
        import torch

        odd = torch.arange(scores.shape[0], device=scores.device) % 2 == 1
        best = scores.argmax(dim=-1, keepdim=True)
        masked = scores.scatter(-1, best, float("-inf"))
        return torch.where(odd.unsqueeze(-1), masked, scores)


TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call><|eos|>'


def add(a: int, b: int) -> int:
    """Add two integers (the deterministic tool of the `grpo_tools` task).

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class ForcedToolCall:
    """A logits processor for greedy tool rollouts: a turn whose context holds no tool result yet is forced to be
    `TOOL_CALL` (the random toy policy never writes a call); later turns are the model's own (greedy, with
    `SecondChoiceOnOddRows`). The rollout's log-probs and losses are the model's, as for any sampled turn."""

    def __init__(self, tokenizer):
        self.call = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"]
        self.assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
        self.marker = tokenizer("result:", add_special_tokens=False)["input_ids"]

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids.tolist()):
            if any(ids[i:i + len(self.marker)] == self.marker for i in range(len(ids))):
                continue  # a tool result is in the context: the model's own turn
            generated = len(ids) - 1 - max(i for i, t in enumerate(ids) if t == self.assistant)
            if generated < len(self.call):
                scores[row] = float("-inf")
                scores[row, self.call[generated]] = 0.0
        return scores


def tool_answer_reward(prompts, completions, **kwargs):
    """The length of a tool rollout's answer (its last message), plus its tool result seen: rows differ in a group."""
    return [len(c[-1]["content"]) / 10 + sum(m["role"] == "tool" for m in c) for c in completions]


def grpo_tools_trainer(common: dict, model, per_device: int):
    """hf_rlhf.GRPOTrainer (TRL's signature) with a tool: every first turn calls `add`, the result is appended, the
    model answers; β > 0 with TRL's bias-corrected k3 KL, so the reference runs on the multi-turn rows too."""
    from transformers import LogitsProcessorList

    from hf_rlhf import GRPOConfig, GRPOTrainer
    from hf_rlhf.toy import build_toy_tool_tokenizer, prompt_dataset

    tokenizer = build_toy_tool_tokenizer()
    args = GRPOConfig(**common, learning_rate=3e-3, gradient_accumulation_steps=2, steps_per_generation=2,
                      num_generations=2, max_completion_length=120, beta=0.05, max_tool_calling_iterations=1,
                      generation_kwargs={"do_sample": False, "logits_processor": LogitsProcessorList(
                          [SecondChoiceOnOddRows(), ForcedToolCall(tokenizer)])})
    return GRPOTrainer(model, reward_funcs=tool_answer_reward, args=args,
                       train_dataset=prompt_dataset(64, seed=0, conversational=True),
                       processing_class=tokenizer, tools=[add])


def rloo_trainer(common: dict, model, tokenizer):
    """hf_rlhf.RLOOTrainer (TRL's signature and math): k1 summed in the reward (β > 0: the reference on each rank),
    the summed sequence ratio, advantages whitened over every rank's batch (`normalize_advantages`); greedy groups
    made to differ as for the rloo task, and the rollout's own policy forward (see ESTIMATORS["rloo"])."""
    from transformers import LogitsProcessorList

    from hf_rlhf import RLOOConfig, RLOOTrainer
    from hf_rlhf.toy import prompt_dataset

    args = RLOOConfig(**common, learning_rate=3e-3, gradient_accumulation_steps=2, steps_per_generation=2,
                      max_completion_length=6, beta=0.05, normalize_advantages=True, logprobs_from_generation=False,
                      generation_kwargs={"do_sample": False,
                                         "logits_processor": LogitsProcessorList([SecondChoiceOnOddRows()])})
    return RLOOTrainer(model, reward_funcs=digit_reward, args=args, train_dataset=prompt_dataset(64, seed=0),
                       processing_class=tokenizer)


def common_args(out: str, steps: int, per_device: int) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=per_device, max_steps=steps, logging_steps=1,
                save_strategy="no", report_to="none", seed=0, disable_tqdm=True, warmup_steps=0, bf16=False,
                dataloader_num_workers=0)


def build_trainer(task: str, out: str, steps: int, per_device: int, policy_path: str | None = None,
                  generation_backend: str = "generate"):
    from hf_rlhf import (
        DPOConfig,
        DPOTrainer,
        ModelConfig,
        PPOConfig,
        PPOTrainer,
        RewardConfig,
        RewardTrainer,
        SFTConfig,
        SFTTrainer,
    )
    from hf_rlhf.callbacks import PlotCallback, SampleCompletionsCallback
    from hf_rlhf.toy import (
        build_toy_model,
        build_toy_reward_model,
        build_toy_tokenizer,
        preference_dataset,
        prompt_dataset,
        sft_dataset,
    )

    tokenizer = build_toy_tokenizer()
    common = common_args(out, steps, per_device)
    lora = ModelConfig(use_peft=True, lora_r=8, lora_alpha=16, lora_dropout=0.0)
    # each model is built before its config: a config made under a ZeRO-3 launch switches on `zero.Init`, and the toy
    # builders' weight init cannot run on its empty shards (the DeepSpeed engine shards the model instead)
    if task in ("sft", "sft_lora"):
        model = build_toy_model(tokenizer, "tiny", seed=0)
        args = SFTConfig(**common, learning_rate=1e-2 if task == "sft_lora" else 3e-3, max_length=64)
        return SFTTrainer(model, args=args, processing_class=tokenizer,
                          train_dataset=sft_dataset(256, seed=1, split="train"),
                          model_config=lora if task == "sft_lora" else None,
                          callbacks=[PlotCallback(["loss"], filename="loss.png")])
    if task == "reward":  # LoRA with the score head trained and saved with the adapter (modules_to_save)
        model = build_toy_reward_model(tokenizer, "tiny", seed=0)
        args = RewardConfig(**common, learning_rate=1e-2, max_length=64)
        return RewardTrainer(model, args=args, processing_class=tokenizer, model_config=lora,
                             train_dataset=preference_dataset(256, seed=1, split="train"))
    if task == "dpo":  # full policy, the reference a frozen copy (DeepSpeed-prepared for inference under ZeRO)
        model = build_toy_model(tokenizer, "tiny", seed=0)
        args = DPOConfig(**common, learning_rate=3e-3, max_length=64, loss_type="sigmoid", beta=0.5)
        return DPOTrainer(model, args=args, processing_class=tokenizer,
                          train_dataset=preference_dataset(256, seed=1, split="train"))
    if task == "dpo_lora":  # LoRA policy: the reference is the same model with its adapters off (no second model)
        model = build_toy_model(tokenizer, "tiny", seed=0)
        args = DPOConfig(**common, learning_rate=1e-2, max_length=64, loss_type="sigmoid", beta=0.5)
        return DPOTrainer(model, args=args, processing_class=tokenizer, model_config=lora,
                          train_dataset=preference_dataset(256, seed=1, split="train"))
    if task == "kto":  # full policy, a frozen reference copy; the KL term's z0 is averaged over the ranks
        from hf_rlhf import KTOConfig, KTOTrainer
        from hf_rlhf.data.kto import prepare_kto_dataset
        from hf_rlhf.toy import unpaired_dataset

        model = build_toy_model(tokenizer, "tiny", seed=0)
        args = KTOConfig(**common, learning_rate=3e-3, max_length=64, beta=0.5)
        # the mismatched completions rotate inside blocks of 4 rows (a rank's batch with 2 processes), prepared here so
        # that one process taking 8 rows a step pairs the same rows: its z0 is then the mean of the two ranks' z0
        rows = prepare_kto_dataset(unpaired_dataset(128, seed=1), tokenizer, args, block_size=4)
        return KTOTrainer(model, args=args, processing_class=tokenizer, train_dataset=rows)
    # PPO: full policy (a frozen reference copy) with a value head; one rollout = one optimizer step, so the micro-
    # batch order inside a rollout (seeded per rank) changes only the order of a sum; adaptive KL with a short
    # horizon so that β moves at every rollout. From a path (`policy_path`) the policy loads after its config, i.e.
    # sharded by zero.Init under ZeRO-3, and the frozen reference is loaded again from that path
    # The critic-free estimators (`task` in ESTIMATORS) run the same with their options and no value head.
    model = policy_path or build_toy_model(tokenizer, "tiny", seed=0)
    if task == "distill":  # greedy rollouts of the student, a frozen teacher of another seed, JSD
        from hf_rlhf import DistillationConfig, DistillationTrainer

        teacher = build_toy_model(tokenizer, "tiny", seed=1)
        args = DistillationConfig(**common, learning_rate=3e-3, gradient_accumulation_steps=2, beta=0.5,
                                  max_completion_length=6, generation_kwargs={"do_sample": False})
        return DistillationTrainer(model, teacher, args=args, train_dataset=prompt_dataset(64, seed=0),
                                   processing_class=tokenizer)
    if task == "grpo_tools":
        return grpo_tools_trainer(common, model, per_device)
    if task == "rloo_trainer":
        return rloo_trainer(common, model, tokenizer)
    options = ESTIMATORS.get(task, {})
    args = PPOConfig(**common, learning_rate=3e-3, gradient_accumulation_steps=2, rollout_batch_size=2 * per_device,
                     num_ppo_epochs=1, response_length=6, temperature=1.0, generation_kwargs={"do_sample": False},
                     kl_coef=0.05, kl_target=0.01, kl_horizon=16, reward_normalization="running",
                     generation_backend=generation_backend, **options)
    if task == "grpo_dynamic":
        args.generation_kwargs = {}  # sampled: groups of equal and of different rewards
    elif options.get("num_generations", 1) > 1:
        from transformers import LogitsProcessorList

        args.generation_kwargs["logits_processor"] = LogitsProcessorList([SecondChoiceOnOddRows()])
    return PPOTrainer(model, has_a_one if task == "grpo_dynamic" else digit_reward, args=args,
                      train_dataset=prompt_dataset(64, seed=0), processing_class=tokenizer,
                      callbacks=[PlotCallback(["objective/kl", "objective/kl_coef"], filename="ppo_curves.png"),
                                 SampleCompletionsCallback(["1+2=", "3*4="], max_new_tokens=4)])


def run_recipe(name: str, out: str, recipe_argv: list[str], recorder: WriteRecorder) -> None:
    """`recipes/<name>.py`'s main(recipe_argv), then this rank's recorded writes into `out/rank<r>.json`."""
    import importlib

    from accelerate import PartialState

    # the launcher puts the repository root on PYTHONPATH (test_distributed.launch_env): recipes/ is a package there
    recorder.start(out)
    results = importlib.import_module(f"recipes.{name}").main(recipe_argv)
    state = PartialState()
    state.wait_for_everyone()
    recorded = sorted(set(recorder.writes))
    with open(os.path.join(out, f"rank{state.process_index}.json"), "w") as f:
        json.dump({"writes": recorded, "after": results.get("after", {})}, f)
    close_process_group()  # as the recipes end (run_recipe): no gloo abort at interpreter exit


def run_task(spec: str, out: str, steps: int, global_batch: int, policy_path: str | None,
             recorder: WriteRecorder) -> None:
    """Train one task (`spec`: TASK or TASK@backend) into `out`, write its losses and per-rank records."""
    task, _, backend = spec.partition("@")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    recorder.start(out)
    trainer = build_trainer(task, os.path.join(out, "out"), steps, global_batch // world, policy_path,
                            backend or "generate")
    if task == "grpo_dynamic":  # generation rounds of this rank (each rank must run as many as the others)
        trainer.generate_calls, sample = 0, trainer.rollout_maker._sample

        def counted(*args, **kwargs):
            trainer.generate_calls += 1
            return sample(*args, **kwargs)

        trainer.rollout_maker._sample = counted
    trainer.train()
    trainer.save_model()
    trainer.save_state()

    from hf_rlhf.training.state_callbacks import KLControllerCallback, find_callback

    kl = find_callback(trainer.callback_handler, KLControllerCallback)
    rank = trainer.args.process_index
    history = trainer.state.log_history
    if trainer.is_world_process_zero():
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"loss": [h["loss"] for h in history if "loss" in h], "log_history": history,
                       "world_size": trainer.args.world_size, "wall_s": time.perf_counter() - start}, f, indent=1)
    trainer.accelerator.wait_for_everyone()
    recorded = sorted(set(recorder.writes))  # copied before this file is written (the hook keeps recording)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"kl_coef": kl.controller.value if kl is not None else None, "writes": recorded,
                   "generate_calls": getattr(trainer, "generate_calls", None)}, f)
    release(trainer)


def release(trainer) -> None:
    """Let go of a finished trainer's state before the next task builds its models: its DeepSpeed engines, and the
    ZeRO-3 config that `from_pretrained` and the toy builders would otherwise still see (its weak reference keeps
    `zero.Init` on while anything holds the old arguments). The caller then drops the trainer."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    trainer.accelerator.free_memory()
    unset_hf_deepspeed_config()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", help="TASK or TASK@backend, or several separated by commas (run in turn)")
    parser.add_argument("--recipe", choices=("sft", "reward", "ppo"), help="run this recipe; other options go to it")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--policy_path", help="PPO tasks: load the policy from this directory (else the toy model)")
    opts, rest = parser.parse_known_args(argv)
    torch.set_num_threads(1)  # tiny matmuls: a second thread only spin-waits
    recorder = WriteRecorder()
    if opts.recipe:
        return run_recipe(opts.recipe, opts.out, rest, recorder)
    if opts.task is None or rest:
        parser.error(f"give --task (unknown options: {rest})")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if opts.global_batch % world:
        raise SystemExit(f"global_batch {opts.global_batch} is not divisible by {world} processes")
    specs = opts.task.split(",")
    unknown = [spec for spec in specs if spec.partition("@")[0] not in TASKS]
    if unknown:  # before any task runs
        parser.error(f"unknown tasks {unknown} (choose from {', '.join(TASKS)}, each optionally @<backend>)")
    for spec in specs:
        run_task(spec, os.path.join(opts.out, spec), opts.steps, opts.global_batch, opts.policy_path,
                 recorder)
        gc.collect()  # the finished trainer, its models and engines
        print(f"[worker] {spec} done", flush=True)
    close_process_group()


if __name__ == "__main__":
    main()
