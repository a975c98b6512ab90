"""Merge a LoRA adapter into its base model and save a plain transformers model.

    python -m hf_rlhf.merge --adapter outputs/sft --output outputs/sft-merged [--base path] [--dtype float32]

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

from .models import resolve_dtype


def _base_path(adapter_dir: str, base: str | None) -> str:
    if base is not None:
        return base
    config_file = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json: is it a LoRA adapter directory?")
    with open(config_file) as f:
        return json.load(f)["base_model_name_or_path"]


def merge_adapter(adapter_dir: str, output_dir: str, base_model: str | None = None, dtype: str = "float32",
                  task: str = "causal_lm"):
    """Load `base_model` (default: the adapter's recorded base), apply the adapter, merge, save.

    The output is written to a temporary directory first and moved into place at the end, so a failed
    merge leaves no half-written `output_dir`. Returns the merged model.
    """
    from peft import PeftModel

    model_class = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
    base = model_class.from_pretrained(_base_path(adapter_dir, base_model), dtype=resolve_dtype(dtype))
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_rlhf.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, help="directory of a saved LoRA adapter")
    parser.add_argument("--output", required=True, help="where to write the merged model")
    parser.add_argument("--base", default=None, help="base model (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--task", default="causal_lm", choices=["causal_lm", "seq_cls"])
    args = parser.parse_args(argv)
    merge_adapter(args.adapter, args.output, args.base, args.dtype, args.task)
    print(f"merged model written to {args.output}")


if __name__ == "__main__":
    main()
