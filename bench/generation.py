"""Rollout generation tokens/s: each `PPOConfig.generation_backend` engine vs transformers' `generate`.

One process per run, each configuration in its own subprocess, rounds interleaved (A B C A B C ...) so that drifts
in the load of this shared machine hit every configuration alike. Every run builds the same seeded model, then
samples `calls` rollout-shaped batches (prompts of `prompt_min`..`prompt_len` toy tokens, left-padded; exactly
`new_tokens` new tokens per row: no stop token, so every engine does the same work) at temperature 0.7:

    generate          `GenerateEngine`: transformers `generate`, dynamic KV cache (today's path, the reference).
    static_eager      `StaticCacheEngine(compile=False)`: static KV cache, prompts bucketed, no compile.
    static            `StaticCacheEngine()`: static KV cache, decoding forward compiled (inductor on CPU).
    lean              `LeanDecodeEngine`: a minimal decode loop with a `DynamicCache` (generate's tokens).
    *_lora            the same engine on a peft LoRA policy (r=16 on q/k/v/o), adapters unmerged.
    *_lora_merged     the same, with `merge_adapter()` before and `unmerge_adapter()` after each batch (timed).

Models (--model): `toy` (`hf_rlhf.toy` "small" Llama) and `llama40m` (a 42M-parameter Llama from a config:
hidden 512, 8 layers, vocabulary 16000). tokens/s excl. compile = tokens of calls 2..n / their time; incl. compile =
all tokens / all time (the first call pays the compile); compile s = first call - median later call.

    python bench/generation.py --model toy --repeats 2
    python bench/generation.py --model toy --repeats 5 --configs generate,lean
    python bench/generation.py --model llama40m --repeats 5 --configs generate,lean,generate_lora,lean_lora
    python bench/generation.py --model llama40m --repeats 2 \
        --configs generate,static_eager,static,generate_lora,generate_lora_merged,static_lora,static_lora_merged
    python bench/generation.py --quick --repeats 1 --output /tmp/smoke.json     # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

DEFAULT_CONFIGS = ("generate", "static_eager", "static")
EXTRA_CONFIGS = ("lean", "lean_lora", "generate_lora", "generate_lora_merged", "static_eager_lora", "static_lora",
                 "static_lora_merged")
REFERENCE = "generate"
PRESETS = {
    "full": dict(batch=32, prompt_len=48, prompt_min=40, new_tokens=32, calls=4),
    "quick": dict(batch=4, prompt_len=12, prompt_min=8, new_tokens=8, calls=2),
}


# ----------------------------------------------------------------------------------------------- worker side
def build_model(name: str, tokenizer, **config):
    """"toy" / "toy_tiny": the toy Llamas; "llama40m": a 42M Llama (hidden 512, 8 layers, vocabulary 16,000), seeded;
    `config` overrides its `LlamaConfig` fields (e.g. the vocabulary)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_rlhf.toy import build_toy_model

    if name == "toy":
        return build_toy_model(tokenizer, "small", seed=0)
    if name == "toy_tiny":
        return build_toy_model(tokenizer, "tiny", seed=0)
    fields = dict(vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                  tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**fields, **config}))


def worker(name: str, model_name: str, settings: dict, threads: int) -> dict:
    import torch

    from hf_rlhf.generation import build_engine
    from hf_rlhf.toy import build_toy_tokenizer

    torch.set_num_threads(threads)
    tokenizer = build_toy_tokenizer()
    model = build_model(model_name, tokenizer)
    lora, merged = "_lora" in name, name.endswith("_merged")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"], lora_dropout=0.0))
    model.eval()
    backend = name.split("_lora")[0]
    engine = build_engine(backend) if backend in ("generate", "lean") else build_engine(
        "static", compile=backend == "static")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    b, width = settings["batch"], settings["prompt_len"]
    lengths = torch.randint(settings["prompt_min"], width + 1, (b,), generator=generator)
    ids = torch.randint(5, min(vocab, 60), (b, width), generator=generator)
    mask = (torch.arange(width) >= (width - lengths).unsqueeze(1)).long()
    ids[mask == 0] = tokenizer.pad_token_id
    times, cpu_times, tokens, digests = [], [], 0, []
    load_before = os.getloadavg()[0]
    for call in range(settings["calls"]):
        torch.manual_seed(call)
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.no_grad():
            if merged:
                model.merge_adapter()
            out = engine.generate(model, ids, mask, max_new_tokens=settings["new_tokens"], do_sample=True,
                                  temperature=0.7, top_k=0, top_p=1.0, eos_token_id=None,
                                  pad_token_id=tokenizer.pad_token_id)
            if merged:
                model.unmerge_adapter()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        tokens += out.response_ids.numel()
        digests.append(hash(tuple(out.response_ids.flatten().tolist())))
    per_call = tokens // settings["calls"]
    later = times[1:]
    return {
        "config": name, "model": model_name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "tokens_per_call": per_call, "call_seconds": times,
        # the sampled tokens of every call (same seeds in every run): equal across engines that sample alike
        "tokens_digest": str(hash(tuple(digests))),
        "tokens_per_s_excl_compile": per_call * len(later) / sum(later),
        "tokens_per_s_incl_compile": tokens / sum(times),
        # per CPU-second (one thread): steadier than wall time when other jobs load the machine
        "tokens_per_cpu_s_excl_compile": per_call * len(later) / sum(cpu_times[1:]),
        "compile_s": times[0] - statistics.median(later), "engine_compiles": engine.stats.compiles,
        "threads": torch.get_num_threads(), "load_before": load_before, "load_after": os.getloadavg()[0],
    }


# ----------------------------------------------------------------------------------------------- parent side
def summarize(runs: list[dict], configs: list[str], repeats: int) -> dict:
    by = {(run["round"], run["config"]): run for run in runs}
    summary = {}
    for name in configs:
        entry = {}
        for key in ("tokens_per_s_excl_compile", "tokens_per_s_incl_compile", "compile_s",
                    "tokens_per_cpu_s_excl_compile"):
            values = [by[r, name][key] for r in range(repeats)]
            entry[key] = values
            entry["median_" + key] = statistics.median(values)
        # a *_lora config is compared with generate on the same LoRA model when that ran too (it samples from
        # another model than the plain one)
        reference = REFERENCE + name[len(name.split("_lora")[0]):]
        reference = reference if reference in configs else REFERENCE
        if reference in configs:
            for key in ("tokens_per_s_excl_compile", "tokens_per_s_incl_compile", "tokens_per_cpu_s_excl_compile"):
                ratios = [by[r, name][key] / by[r, reference][key] for r in range(repeats)]
                entry["ratios_" + key] = ratios
                entry["median_ratio_" + key] = statistics.median(ratios)
            if name != reference and (reference == REFERENCE) == ("_lora" not in name):
                entry["same_tokens"] = "yes" if all(by[r, name]["tokens_digest"] == by[r, reference]["tokens_digest"]
                                                    for r in range(repeats)) else "NO"
        summary[name] = entry
    return summary


def markdown_table(summary: dict) -> str:
    lines = ["| config | tokens/s excl. compile | ratio vs generate (same model) | tokens/s incl. compile "
             "| ratio vs generate | compile s | tokens/CPU-s excl. compile | ratio vs generate "
             "| same tokens as generate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in summary.items():
        ratio = {k: f"{e['median_ratio_' + k]:.2f}×" if "median_ratio_" + k in e else "–"
                 for k in ("tokens_per_s_excl_compile", "tokens_per_s_incl_compile", "tokens_per_cpu_s_excl_compile")}
        lines.append(f"| {name} | {e['median_tokens_per_s_excl_compile']:,.0f} | {ratio['tokens_per_s_excl_compile']} "
                     f"| {e['median_tokens_per_s_incl_compile']:,.0f} | {ratio['tokens_per_s_incl_compile']} "
                     f"| {max(e['median_compile_s'], 0):.1f} | {e['median_tokens_per_cpu_s_excl_compile']:,.0f} "
                     f"| {ratio['tokens_per_cpu_s_excl_compile']} | {e.get('same_tokens', '–')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny model and batches: a smoke run")
    parser.add_argument("--model", default="toy", choices=("toy", "toy_tiny", "llama40m"))
    parser.add_argument("--output", default=None, help="JSON results path (default bench/results/generation_<model>"
                                                        ".json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every run (default 1)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from {DEFAULT_CONFIGS + EXTRA_CONFIGS}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    settings = PRESETS["quick" if cli.quick else "full"]
    model = "toy_tiny" if cli.quick else cli.model

    if cli.worker:
        print(json.dumps(worker(cli.worker, model, settings, cli.threads)))
        return

    configs = [c.strip() for c in cli.configs.split(",") if c.strip()]
    unknown = set(configs) - set(DEFAULT_CONFIGS + EXTRA_CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}")
    output = cli.output or f"bench/results/generation_{model}.json"
    command = "python bench/generation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    for r in range(cli.repeats):
        for name in configs:
            args = ["--worker", name, "--threads", str(cli.threads), "--model", cli.model]
            run = {"round": r, **harness.run_worker(__file__, args + (["--quick"] if cli.quick else []))}
            runs.append(run)
            print(f"round {r + 1}/{cli.repeats} {name:>20}: {run['tokens_per_s_excl_compile']:8.1f} tok/s excl. "
                  f"compile, {run['tokens_per_s_incl_compile']:8.1f} incl., compile {run['compile_s']:.1f} s, "
                  f"calls {[round(t, 2) for t in run['call_seconds']]}, load {run['load_before']:.1f}", flush=True)
    summary = summarize(runs, configs, cli.repeats)
    first = runs[0]
    notes = [
        f"Model `{model}` ({first['params_m']:.1f}M parameters, fp32, sdpa), {first['threads']} torch thread(s); "
        f"{settings['calls']} calls of {settings['batch']} prompts ({settings['prompt_min']}-{settings['prompt_len']} "
        f"tokens, left-padded), {settings['new_tokens']} sampled new tokens each (temperature 0.7, no stop token).",
        f"Medians of {cli.repeats} interleaved rounds; ratios are medians of per-round ratios. Shared machine: "
        f"load average {min(r['load_before'] for r in runs):.1f}-{max(r['load_before'] for r in runs):.1f} "
        f"on {os.cpu_count()} cores.",
    ]
    harness.finish(output, command, {"settings": settings, "model": model, "configs": configs, "summary": summary,
                                     "table": markdown_table(summary), "notes": notes, "runs": runs},
                   ("torch", "transformers", "peft"))


if __name__ == "__main__":
    main()
