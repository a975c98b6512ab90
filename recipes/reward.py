"""Reward-model recipe: pairwise (Bradley-Terry) training of a sequence-classification reward model.

    python recipes/reward.py                                   # the embedded toy task, end to end on a CPU
    python recipes/reward.py --config recipes/configs/reward_toy_lora.yaml
    accelerate launch recipes/reward.py --config recipes/configs/reward_qwen_lora.yaml

Toy task: pairs whose chosen answer is correct and rejected one plausibly wrong (`hf_rlhf.toy`). The model
starts from the SFT recipe's output (`sft_model_path`, default `outputs/sft`) when it holds a full model, with a
new one-output `score` head; otherwise from a freshly initialised toy model.

Options are the fields of `ScriptArguments` (below), `hf_rlhf.ModelConfig` and `hf_rlhf.RewardConfig`, on the
command line or in a YAML file given with `--config` (command-line values win). Unknown options are errors.
Writes the model (or adapter) and tokenizer to `output_dir`, and `<output_dir>/results.json` with the held-out
pairwise accuracy before and after training and, with `store_reward_stats`, the reward mean / std over the
training pairs (also stored as `reward_mean` / `reward_std` in the model config and `reward_stats.json`, for PPO).

The data is read and checked (a local .json/.jsonl file as written: file, line, row and field in every error)
before any model is loaded. `--resume_from_checkpoint true` (or `latest`) resumes from the latest complete
checkpoint in `output_dir`, a path from that checkpoint; results.json then covers the whole run. After a
non-finite stop nothing is saved or evaluated: results.json holds `stopped` and the recipe exits 1 with the message.
A SIGTERM saves a checkpoint at the next optimizer step, writes results.json with `preempted` and exits 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hf_rlhf import ModelConfig, RewardConfig, RewardTrainer
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.cli.data_loading import load_text_dataset, tokenize_first
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.cli.printing import print_outputs
from hf_rlhf.cli.results import exit_after_stop, write_results
from hf_rlhf.cli.resume import resume_argument, train_run
from hf_rlhf.data import prepare_preference_dataset
from hf_rlhf.toy.chain import is_toy_run, prepare_toy_base

TOY_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "reward_toy.yaml")


@dataclass
class ScriptArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id, a local dataset directory, or a .json/.jsonl/.parquet "
                                        "file of preference pairs. None: the embedded toy task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str | None = field(default="test", metadata={"help": "Held-out split (if present)."})
    sft_model_path: str | None = field(
        default="outputs/sft", metadata={"help": "Toy task: start from this SFT model when it holds a full model "
                                                 "(the SFT recipe's default output); else from a new toy model."})
    toy_train_size: int = field(default=4000, metadata={"help": "Toy task: training pairs."})
    toy_test_size: int = field(default=500, metadata={"help": "Toy task: held-out pairs for accuracy."})
    toy_conversational: bool = field(default=False, metadata={"help": "Toy task: pairs as chat messages."})
    toy_model_size: str = field(default="small", metadata={"help": "Toy model size.", "choices": ["tiny", "small"]})
    toy_rejected_slip_rate: float = field(
        default=0.0, metadata={"help": "Toy task: share of pairs whose rejected answer is the demonstrator's slip "
                                       "(hf_rlhf.toy.tasks.slip_answer); the rest get a plausible wrong answer."})
    toy_seed: int = field(default=0, metadata={"help": "Seed of the toy data and the toy model's init."})


def is_full_model_dir(path: str | None) -> bool:
    """A directory with a saved model (config and weights), not a LoRA adapter."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return any(name.startswith("model") and name.endswith((".safetensors", ".bin", ".json"))
               and name != "config.json" for name in os.listdir(path))


def load_reward_base(script_args, model_config, training_args):
    """(model or path, tokenizer, description of the starting point)."""
    from hf_rlhf.models.loading import load_tokenizer

    if model_config.model_name_or_path is not None:
        # RewardTrainer loads it as AutoModelForSequenceClassification(num_labels=1), quantized if asked
        return model_config.model_name_or_path, load_tokenizer(model_config), model_config.model_name_or_path
    if is_full_model_dir(script_args.sft_model_path):
        model_config.model_name_or_path = script_args.sft_model_path
        return script_args.sft_model_path, load_tokenizer(model_config), f"SFT model {script_args.sft_model_path}"
    model, tokenizer = prepare_toy_base(model_config, training_args, script_args.toy_model_size,
                                        script_args.toy_seed, reward=True)
    return model, tokenizer, f"new toy model ({script_args.toy_model_size})"


def validate_rows(training_args):
    """The preference-pair row check of a dataset file's raw rows (`load_text_dataset`)."""
    from hf_rlhf.data import column_names, detect_preference_format, validate_preference_dataset

    def validate(rows):
        use_margin = training_args.use_margin if training_args.use_margin is not None else \
            "margin" in column_names(rows)
        validate_preference_dataset(rows, detect_preference_format(rows), use_margin)

    return validate


def main(argv: list[str] | None = None) -> dict:
    script_args, model_config, training_args = parse_recipe_args(
        (ScriptArguments, ModelConfig, RewardConfig), argv, TOY_CONFIG)
    toy = is_toy_run(script_args)
    resume = resume_argument(training_args.resume_from_checkpoint)

    # the data first: a bad file or row fails here, before any model is loaded
    if toy:
        from hf_rlhf.toy import preference_dataset

        train = preference_dataset(script_args.toy_train_size, seed=script_args.toy_seed, split="train",
                                   conversational=script_args.toy_conversational,
                                   rejected_slip_rate=script_args.toy_rejected_slip_rate)
        test = preference_dataset(script_args.toy_test_size, seed=script_args.toy_seed, split="test",
                                  conversational=script_args.toy_conversational,
                                  rejected_slip_rate=script_args.toy_rejected_slip_rate)
    else:
        train, test = load_text_dataset(script_args, validate_rows(training_args))
        if model_config.model_name_or_path is not None:
            # tokenizer-level checks (unknown tokens, over-long pairs) before the weights are read
            from hf_rlhf.models.loading import load_tokenizer

            train, test = tokenize_first(train, test, prepare_preference_dataset, load_tokenizer(model_config),
                                         training_args)
    model, tokenizer, start = load_reward_base(script_args, model_config, training_args)
    print(f"[hf_rlhf] reward model starts from: {start}")

    trainer = RewardTrainer(model, args=training_args, train_dataset=train, eval_dataset=test,
                            processing_class=tokenizer, model_config=model_config)
    # Under DeepSpeed, transformers 5.23 evaluates through an inference-only engine that train() cannot use
    # afterwards, so the untrained model is not evaluated there (results.json says so).
    skip_before = trainer.is_deepspeed_enabled
    before = _accuracy(trainer) if test is not None and not skip_before else {}
    metrics = train_run(trainer, resume)
    task = "toy" if toy else script_args.dataset_name
    exit_after_stop(trainer, training_args.output_dir, metrics, {"before": before, "start": start,
                                                                           "task": task})
    trainer.save_model(training_args.output_dir)

    after = _accuracy(trainer) if test is not None else {}
    after.update({k: v for k, v in metrics.items() if k in ("reward_mean", "reward_std")})
    results = {"before": before, "after": after, "train": metrics, "start": start, "task": task}
    if skip_before and test is not None:
        results["notes"] = ["before: not evaluated under DeepSpeed (evaluate() before train() breaks training)"]
    if trainer.is_world_process_zero():
        write_results(training_args.output_dir, results)
        print_outputs("Reward modelling", training_args.output_dir, results)
    return results


def _accuracy(trainer) -> dict:
    metrics = trainer.evaluate()
    return {"accuracy": metrics["eval_accuracy"], "margin": metrics["eval_margin"], "loss": metrics["eval_loss"]}


if __name__ == "__main__":
    run_recipe(main)
