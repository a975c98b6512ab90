"""Supervised fine-tuning recipe.

    python recipes/sft.py                                   # the embedded toy task, end to end on a CPU
    python recipes/sft.py --config recipes/configs/sft_toy_lora.yaml
    accelerate launch recipes/sft.py --model_name_or_path Qwen/Qwen2.5-0.5B \
        --dataset_name trl-lib/Capybara --use_peft --output_dir outputs/sft-qwen

Options are the fields of `ScriptArguments` (below), `hf_rlhf.ModelConfig` and `hf_rlhf.SFTConfig`,
on the command line or in a YAML file given with `--config` (command-line values win). Unknown
options are errors. Writes the model (or adapter) and tokenizer to `output_dir`, and
`<output_dir>/results.json` with the metrics before and after training.

The data is read and checked (a local .json/.jsonl file as written: file, line, row and field in every error)
before any model is loaded. `--resume_from_checkpoint true` (or `latest`) resumes from the latest complete
checkpoint in `output_dir`, a path from that checkpoint; results.json then covers the whole run. After a
non-finite stop nothing is saved or evaluated: results.json holds `stopped` and the recipe exits 1 with the message.
A SIGTERM saves a checkpoint at the next optimizer step, writes results.json with `preempted` and exits 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hf_rlhf import ModelConfig, SFTConfig, SFTTrainer
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.cli.data_loading import load_text_dataset, tokenize_first
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.cli.printing import print_outputs
from hf_rlhf.cli.results import exit_after_stop, write_results
from hf_rlhf.cli.resume import resume_argument, train_run
from hf_rlhf.data import prepare_sft_dataset
from hf_rlhf.toy.chain import is_toy_run, prepare_toy_base

TOY_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "sft_toy.yaml")


@dataclass
class ScriptArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id, a local dataset directory, or a .json/.jsonl/.parquet "
                                        "file. None: the embedded toy task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str | None = field(default="test", metadata={"help": "Held-out split (if present)."})
    toy_train_size: int = field(default=20000, metadata={"help": "Toy task: training examples."})
    toy_test_size: int = field(default=200, metadata={"help": "Toy task: held-out prompts for exact match."})
    toy_format: str = field(
        default="prompt_completion", metadata={
            "help": "Toy task dataset format.",
            "choices": ["prompt_completion", "text", "messages", "conversational_prompt_completion"]})
    toy_model_size: str = field(default="small", metadata={"help": "Toy model size.", "choices": ["tiny", "small"]})
    toy_seed: int = field(default=0, metadata={"help": "Seed of the toy data and the toy model's init."})
    toy_slip_rate: float = field(
        default=0.0, metadata={"help": "Toy task: share of demonstrations with the demonstrator's systematic slip "
                                       "(an answer copied from the prompt; hf_rlhf.toy.tasks.slip_answer)."})
    toy_task: str = field(default="arithmetic", metadata={
        "help": "Toy task: arithmetic (the mixed tasks of hf_rlhf.toy.tasks) or tools (calculator demonstrations, "
                "hf_rlhf.toy.tool_task; the toy_tool_* options).", "choices": ["arithmetic", "tools"]})
    toy_tool_operation: str = field(default="multiply", metadata={
        "help": "Toy tools task: the operation (and its tool).", "choices": ["add", "multiply"]})
    toy_tool_digits: int = field(default=3, metadata={"help": "Toy tools task: digits of each operand."})
    toy_tool_rate: float = field(default=1.0, metadata={
        "help": "Toy tools task: share of demonstrations that call the tool (the others answer at once)."})


def toy_exact_match(model, tokenizer, rows, script_args) -> dict:
    """Greedy exact match on the held-out toy prompts (the tools task: with its tool, and the tool calls made)."""
    if script_args.toy_task == "tools":
        from hf_rlhf.toy import tool_exact_match
        from hf_rlhf.toy.tool_task import operation_tool

        return tool_exact_match(model, tokenizer, rows, tools=[operation_tool(script_args.toy_tool_operation)])
    from hf_rlhf.toy import exact_match

    return {"exact_match": exact_match(model, tokenizer, rows)}


def toy_data(script_args) -> tuple:
    """(SFT rows, held-out prompt rows) of the toy task."""
    if script_args.toy_task == "tools":
        from hf_rlhf.toy import tool_prompt_dataset, tool_sft_dataset
        from hf_rlhf.toy.tool_task import TEST_SEED_OFFSET

        task = {"digits": script_args.toy_tool_digits, "operation": script_args.toy_tool_operation}
        train = tool_sft_dataset(script_args.toy_train_size, seed=script_args.toy_seed,
                                 tool_rate=script_args.toy_tool_rate, **task)
        # another seed than the training rows' (the PPO recipe's held-out prompts are these too)
        return train, tool_prompt_dataset(script_args.toy_test_size, seed=script_args.toy_seed + TEST_SEED_OFFSET,
                                          **task)
    from hf_rlhf.toy import prompt_dataset, sft_dataset

    conversational = script_args.toy_format in ("messages", "conversational_prompt_completion")
    train = sft_dataset(script_args.toy_train_size, seed=script_args.toy_seed, split="train",
                        format=script_args.toy_format, slip_rate=script_args.toy_slip_rate)
    return train, prompt_dataset(script_args.toy_test_size, seed=script_args.toy_seed, split="test",
                                 conversational=conversational)


def validate_rows(training_args):
    """The SFT row check of a dataset file's raw rows (`load_text_dataset`)."""
    from hf_rlhf.data import detect_format, validate_sft_dataset

    def validate(rows):
        fmt = detect_format(rows, training_args.dataset_text_field)
        validate_sft_dataset(rows, fmt, training_args.dataset_text_field,
                             require_assistant=training_args.assistant_only_loss)

    return validate


def main(argv: list[str] | None = None) -> dict:
    script_args, model_config, training_args = parse_recipe_args(
        (ScriptArguments, ModelConfig, SFTConfig), argv, TOY_CONFIG)
    toy = is_toy_run(script_args)
    resume = resume_argument(training_args.resume_from_checkpoint)

    # the data first: a bad file or row fails here, before any model is loaded
    if toy:
        train, held_out = toy_data(script_args)
        test = None
    else:
        train, test = load_text_dataset(script_args, validate_rows(training_args))
        held_out = None

    if model_config.model_name_or_path is None:
        model, tokenizer = prepare_toy_base(model_config, training_args, script_args.toy_model_size,
                                            script_args.toy_seed, tools=script_args.toy_task == "tools")
    else:
        from hf_rlhf.models.loading import load_model, load_tokenizer

        tokenizer = load_tokenizer(model_config)
        if not toy:  # tokenizer-level checks (unknown tokens, over-long rows) before the weights are read
            train, test = tokenize_first(train, test, prepare_sft_dataset, tokenizer, training_args)
        model = load_model(model_config)

    before = toy_exact_match(model, tokenizer, held_out, script_args) if toy else {}
    trainer = SFTTrainer(model, args=training_args, train_dataset=train, eval_dataset=test,
                         processing_class=tokenizer, model_config=model_config)
    metrics = train_run(trainer, resume)
    task = "toy" if toy else script_args.dataset_name
    exit_after_stop(trainer, training_args.output_dir, metrics, {"before": before, "task": task})
    trainer.save_model(training_args.output_dir)

    after = toy_exact_match(trainer.accelerator.unwrap_model(trainer.model), tokenizer, held_out,
                            script_args) if toy else {}
    if test is not None:
        after.update({k.removeprefix("eval_"): v for k, v in trainer.evaluate().items()})
    results = {"before": before, "after": after, "train": metrics, "task": task}
    if trainer.is_world_process_zero():
        write_results(training_args.output_dir, results)
        print_outputs("SFT", training_args.output_dir, results)
    return results


if __name__ == "__main__":
    run_recipe(main)
