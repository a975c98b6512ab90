"""Merge a LoRA adapter into its base model and save a plain transformers model.

    python -m hf_rlhf.models.merge --adapter outputs/sft --output outputs/sft-merged [--dtype float32]

(`--base_model_name_or_path path` when the base is not the adapter's own `base_model_name_or_path`.)

The merged model's logits match the adapter model's (on the same, unquantized base). A QLoRA adapter is
merged into the base loaded in `--dtype` (not 4-bit): merging into 4-bit weights would round the sum.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from .loading import ModelUnavailableError, hub_errors, resolve_dtype


def _recorded_base(adapter_dir: str) -> str:
    config_file = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json: is it a LoRA adapter directory?")
    with open(config_file) as f:
        return json.load(f)["base_model_name_or_path"]


def load_merged(adapter_dir: str, base_model: str | None = None, dtype: str = "float32", task: str = "causal_lm"):
    """The adapter merged into its base: `peft.AutoPeftModelFor*.from_pretrained(...).merge_and_unload()`.

    Args:
        base_model: load this base instead of the one recorded in adapter_config.json (then through
            `PeftModel.from_pretrained`, since AutoPeftModel reads the base only from the adapter's config).
        task: "causal_lm", or "seq_cls" for a reward model (one label, as `RewardTrainer` trains it).

    Raises:
        FileNotFoundError: no adapter_config.json, or the base model cannot be found.
    """
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification, PeftModel

    recorded = _recorded_base(adapter_dir)
    auto_class, model_class, kwargs = (
        (AutoPeftModelForCausalLM, AutoModelForCausalLM, {}) if task == "causal_lm"
        else (AutoPeftModelForSequenceClassification, AutoModelForSequenceClassification, {"num_labels": 1}))
    kwargs["dtype"] = resolve_dtype(dtype)
    base = base_model or recorded
    where = "given as --base_model_name_or_path" if base_model else "recorded in adapter_config.json"
    try:
        with hub_errors(base, "base model"):
            if base_model is None:
                model = auto_class.from_pretrained(adapter_dir, **kwargs)
            else:
                model = PeftModel.from_pretrained(model_class.from_pretrained(base_model, **kwargs), adapter_dir)
    except OSError as err:
        if os.path.isdir(base) or getattr(err, "kind", "local") not in ("local", "offline"):
            raise  # a Hub that cannot be reached or has no such repo: hub_errors' own line
        raise ModelUnavailableError(
            f"base model {base!r} {where} not found: pass --base_model_name_or_path (a local directory, or a hub "
            "id, in the Hugging Face cache when offline)") from err
    return model.merge_and_unload()


def merge_adapter(adapter_dir: str, output_dir: str, base_model: str | None = None, dtype: str = "float32",
                  task: str = "causal_lm"):
    """Merge the adapter into its base (`load_merged`) and save it with the adapter's tokenizer.

    The output is written to a temporary directory first and moved into place at the end, so a failed
    merge leaves no half-written `output_dir`. Returns the merged model.
    """
    merged = load_merged(adapter_dir, base_model, dtype, task)
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".merge-", dir=parent)
    try:
        merged.save_pretrained(tmp)
        try:
            AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(tmp)
        except (OSError, ValueError):
            pass  # adapter saved without a tokenizer: the merged model is still complete
        if os.path.exists(output_dir):
            shutil.rmtree(output_dir)
        os.replace(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return merged


def main(argv: list[str] | None = None, prog: str = "python -m hf_rlhf.models.merge") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, help="directory of a saved LoRA adapter")
    parser.add_argument("--output", required=True, help="where to write the merged model")
    parser.add_argument("--base_model_name_or_path", "--base", dest="base", default=None,
                        help="base model (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--task", default="causal_lm", choices=["causal_lm", "seq_cls"])
    args = parser.parse_args(argv)
    merge_adapter(args.adapter, args.output, args.base, args.dtype, args.task)
    print(f"merged model written to {args.output}")


if __name__ == "__main__":
    main()
