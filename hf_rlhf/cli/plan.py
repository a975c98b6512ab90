"""`hf-rlhf plan <command> [options]`: the predicted peak memory of a run, part by part, before the run.

    hf-rlhf plan sft --model_name_or_path qwen2.5-0.5b --per_device_train_batch_size 4 --max_length 2048
    hf-rlhf plan dpo --model_name_or_path ./my_model --max_length 1024 --max_completion_length 512 --bf16
    hf-rlhf plan grpo --model_name_or_path llama-3.2-1b --num_generations 8 --max_prompt_length 256 \\
        --max_completion_length 2048 --use_peft --lora_r 16

The options take the trainers' config names; the arithmetic is `hf_rlhf.training.memory_plan` (no model is
loaded: the model's config.json, or a named shape, is enough).
"""

from __future__ import annotations

import argparse

from ..training.memory_plan import NAMED_SHAPES, OPTIMIZER_BYTES, ModelShape, PlanOptions, plan_memory

COMMANDS = ("sft", "dpo", "grpo", "ppo", "reward")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Predict the peak memory of each part of a run.")
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--model_name_or_path", required=True,
                        help=f"a model directory (its config.json) or a named shape: {', '.join(NAMED_SHAPES)}")
    parser.add_argument("--num_hidden_layers", type=int, help="override the model's depth")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8,
                        help="sequences (DPO / reward: pairs) per micro-batch (default 8, the trainers')")
    parser.add_argument("--max_length", type=int, default=1024, help="tokens per sequence (sft, dpo, reward)")
    parser.add_argument("--max_prompt_length", type=int, default=512, help="grpo / ppo: prompt tokens")
    parser.add_argument("--max_completion_length", type=int, default=None,
                        help="dpo: completion tokens (logits only there: hf_rlhf's default); grpo / ppo: new tokens "
                             "(default 512)")
    parser.add_argument("--num_generations", type=int, default=8, help="grpo: completions per prompt (G)")
    parser.add_argument("--generation_batch_size", type=int, default=None,
                        help="grpo / ppo: sequences generated together (default: per_device_train_batch_size x "
                             "gradient_accumulation_steps)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bf16 activations (autocast); weights as --dtype")
    parser.add_argument("--dtype", default="float32", help="weights: float32, bfloat16, float16, 4bit")
    parser.add_argument("--optim", default="adamw_torch_fused", choices=sorted(OPTIMIZER_BYTES),
                        help="default: transformers' default optimizer")
    parser.add_argument("--use_peft", action="store_true", help="LoRA (adapters off = the reference)")
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--lora_target_modules", default="all-linear", choices=("all-linear", "attention"))
    parser.add_argument("--gradient_checkpointing", "--activation_checkpointing", dest="checkpointing",
                        action="store_true")
    parser.add_argument("--chunked_lm_head", choices=("auto", "true", "false"), default="auto",
                        help="the LM head in chunks of tokens (auto: as the command's hf_rlhf config does by default)")
    parser.add_argument("--logits_chunk", type=int, default=None,
                        help="rows per chunk of the chunked LM-head loss (default: as hf_rlhf picks them)")
    parser.add_argument("--beta", type=float, default=None,
                        help="KL coefficient (grpo default 0: no reference; ppo 0.05)")
    parser.add_argument("--value_model", action="store_true", help="ppo: a separate value model")
    parser.add_argument("--reward_model", action="store_true", help="ppo: a separate reward model")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda: torch's allocated memory (the CUDA context's ~0.5 GiB not included); cpu: RSS")
    parser.add_argument("--unit", default="GiB", choices=("GiB", "MiB"))
    return parser


CONFIG_CLASSES = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig", "ppo": "PPOConfig",
                  "reward": "RewardConfig"}


def chunked(args: argparse.Namespace) -> bool:
    """Whether the run's LM head goes in chunks: as asked, else as the command's config does by default (its
    `chunked_lm_head` option, None = on where it applies; a config without the option: full logits)."""
    if args.chunked_lm_head != "auto":
        return args.chunked_lm_head == "true"
    import dataclasses

    import hf_rlhf

    config = getattr(hf_rlhf, CONFIG_CLASSES[args.command])
    default = {f.name: f.default for f in dataclasses.fields(config)}.get("chunked_lm_head", False)
    return default is None or bool(default)


def options_from(args: argparse.Namespace) -> PlanOptions:
    command = args.command
    micro = args.per_device_train_batch_size
    options = dict(command=command, batch_size=micro, weight_dtype=args.dtype,
                   compute_dtype="bfloat16" if args.bf16 or args.dtype in ("bfloat16", "bf16") else "float32",
                   optimizer=args.optim, lora_r=args.lora_r if args.use_peft else 0,
                   lora_targets=args.lora_target_modules, activation_checkpointing=args.checkpointing,
                   chunked_head=chunked(args), logits_chunk=args.logits_chunk, value_model=args.value_model,
                   reward_model=args.reward_model, gradient_accumulation_steps=args.gradient_accumulation_steps,
                   device=args.device)
    if command in ("grpo", "ppo"):
        completion = args.max_completion_length or 512
        beta = args.beta if args.beta is not None else (0.0 if command == "grpo" else 0.05)
        generation = args.generation_batch_size or micro * args.gradient_accumulation_steps
        options.update(seq_len=args.max_prompt_length + completion, logits_positions=completion, beta=beta,
                       prefix_sharing=command == "grpo" and args.num_generations > 1,  # hf_rlhf's default there
                       generation_batch=generation, prompt_len=args.max_prompt_length, completion_len=completion)
    else:
        options.update(seq_len=args.max_length,
                       logits_positions=args.max_completion_length if command == "dpo" else None)
    return PlanOptions(**options)


def main(argv: list[str], prog: str = "hf-rlhf plan") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        shape = ModelShape.load(args.model_name_or_path, args.num_hidden_layers)
        plan = plan_memory(shape, options_from(args))
    except (FileNotFoundError, ValueError) as e:
        print(f"[hf_rlhf] error: {e}")
        return 2
    print(f"Memory plan: {args.command} on {args.model_name_or_path} ({shape.params / 1e6:,.1f}M parameters, "
          f"{shape.num_layers} layers, vocabulary {shape.vocab_size:,})\n")
    print(plan.table(args.unit))
    print(f"\nTotal (predicted peak): {plan.peak / 2**30:,.2f} GiB")
    return 0
