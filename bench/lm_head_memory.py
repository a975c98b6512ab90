"""Peak memory and time of one SFT forward + backward at a real vocabulary: the full logits against the LM head in
chunks of tokens (`SFTConfig.chunked_lm_head`), each run in its own subprocess.

The model: Qwen2.5-0.5B's shape (hidden 896, intermediate 4864, 14 heads, 2 kv heads, vocabulary 151,936, tied) cut
to `--layers` layers, random weights from a `Qwen2Config` (no download), float32; `--rows` rows of `--tokens` random
tokens, every token trained. One `SFTTrainer.compute_loss` + backward, `--steps` times (the first one warms up).

    python bench/lm_head_memory.py                          # 2 layers, 2 x 1000 tokens, plain and chunked
    python bench/lm_head_memory.py --device cuda --tokens 4000
    python bench/lm_head_memory.py --sweep vocab=32000,64000,128256,151936 --sweep layers=2,4,8 --plot out.png

`--sweep name=v1,v2,...` (vocab, layers, tokens) runs the plain / chunked pair at each value (the other options
fixed), prints the step's memory (peak minus the RSS after the model was built) beside `hf-rlhf plan`'s prediction
of the same, and draws memory against each swept option (`--plot`).

Memory: the peak RSS of the process (`resource.getrusage` ru_maxrss) and its RSS after the model was built, on CPU;
`torch.cuda.max_memory_allocated` and the allocation after the model was built, on CUDA.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_rlhf from this tree when not installed


def run_one(args) -> dict:
    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if args.chunk_elements:
        import hf_rlhf.losses.chunked_head as chunked_head

        chunked_head.CHUNK_ELEMENTS = args.chunk_elements
    torch.manual_seed(0)
    vocab = args.vocab
    config = Qwen2Config(vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=args.layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1e6)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").to(args.device)
    ids = torch.randint(2, vocab, (args.rows, args.tokens))
    compute_loss, batch = _sft_loss(model, ids, args) if not args.direct else _direct_loss(model, ids, args)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_mb()
    times, losses = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = compute_loss(model.train(), batch)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": args.mode, "direct": args.direct, "vocab": vocab, "layers": args.layers, "tokens": args.tokens,
            "rows": args.rows, "step_mb": round(peak - base), "predicted_step_mb": round(predicted_step_mb(args)),
            "chunk_elements": args.chunk_elements, "peak_mb": round(peak),
            "after_model_mb": round(base),
            "step_s": round(min(times[1:] or times), 3), "loss": losses[-1], "device": args.device,
            "threads": torch.get_num_threads()}


def _sft_loss(model, ids, args):
    """(`SFTTrainer.compute_loss`, a collated batch of `ids`), the trainer built with `chunked_lm_head` per mode."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from hf_rlhf import SFTConfig, SFTTrainer

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1},
                                                                                   unk_token="<unk>")),
                                        pad_token="<pad>", eos_token="<pad>")
    train = Dataset.from_list([{"input_ids": row} for row in ids.tolist()])
    sft = SFTConfig(output_dir="/tmp/lm_head_memory", report_to="none", per_device_train_batch_size=args.rows,
                    chunked_lm_head=args.mode == "chunked", save_strategy="no", disable_tqdm=True,
                    use_cpu=args.device == "cpu", bf16=False)
    trainer = SFTTrainer(model, args=sft, train_dataset=train, processing_class=tokenizer)
    return trainer.compute_loss, trainer._prepare_inputs(trainer.data_collator([row for row in train]))


def _direct_loss(model, ids, args):
    """Without the trainer (a machine without `datasets`): the model's own loss, or the chunked head's mean NLL."""
    from hf_rlhf.models.lm_head import last_hidden_states, split_lm_head

    batch = {"input_ids": ids.to(args.device)}
    if args.mode == "plain":
        return lambda model, batch: model(**batch, labels=batch["input_ids"], use_cache=False).loss, batch
    head = split_lm_head(model)

    def loss(model, batch):
        hidden, _ = last_hidden_states(model, **batch, use_cache=False)
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return -head.token_logprobs(flat, batch["input_ids"][:, 1:].reshape(-1))[0].mean()

    return loss, batch


def predicted_step_mb(args) -> float:
    """`hf_rlhf.training.memory_plan`'s step memory for this run: its peak phase without the weights and runtime
    (the RSS after the model was built holds those), one optimizer-free step."""
    from hf_rlhf.training.memory_plan import ModelShape, PlanOptions, plan_memory

    shape = ModelShape(vocab_size=args.vocab, hidden_size=896, intermediate_size=4864, num_layers=args.layers,
                       num_heads=14, num_kv_heads=2, head_dim=64, tied=True, qkv_bias=True)
    plan = plan_memory(shape, PlanOptions(command="sft", batch_size=args.rows, seq_len=args.tokens, steps=1,
                                          chunked_head=args.mode == "chunked", device=args.device.split(":")[0]))
    parts = dict((name, size) for name, size, _ in plan.parts)
    step = max(plan.phases["forward / backward"], plan.phases["end of backward"])
    return (step - parts["weights"] - parts.get("runtime", 0)) / 2**20


def plot(results: list[dict], sweeps: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 4.2), squeeze=False)
    for ax, name in zip(axes[0], sweeps):
        for mode in ("plain", "chunked"):
            rows = sorted((r for r in results if r["sweep"] == name and r["mode"] == mode), key=lambda r: r[name])
            xs = [r[name] for r in rows]
            line, = ax.plot(xs, [r["step_mb"] / 1024 for r in rows], marker="o", label=f"{mode} (measured)")
            ax.plot(xs, [r["predicted_step_mb"] / 1024 for r in rows], linestyle=":", color=line.get_color(),
                    label=f"{mode} (hf-rlhf plan)")
        ax.set_xlabel(name)
        ax.set_ylabel("one SFT step's memory above the model (GiB)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Qwen2.5-0.5B widths, fp32, CPU: the full logits against the chunked LM head")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["plain", "chunked"], help="one run, in this process (used by the driver)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved plain / chunked pairs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--direct", action="store_true", help="the model's loss / the chunked head, no SFTTrainer")
    parser.add_argument("--chunk_elements", type=int, default=None, help="logits per chunk (default: the library's)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2",
                        help="vocab, layers or tokens over these values (repeatable)")
    parser.add_argument("--plot", help="PNG of memory against each swept option")
    parser.add_argument("--output", help="JSON of every run")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_one(args)))
        return
    sweeps = [spec.partition("=") for spec in args.sweep]
    for name, _, values in sweeps:
        if name not in ("vocab", "layers", "tokens") or not values:
            parser.error(f"--sweep {name}={values}: expected vocab=..., layers=... or tokens=... with values")
    base = [a for a in sys.argv[1:] if a not in args.sweep and not a.startswith(("--sweep", "--plot", "--output"))
            and a not in (args.plot, args.output)]
    points = [(name, ["--" + name, value]) for name, _, values in sweeps for value in values.split(",")] or [
        (None, [])]
    results = []
    for _ in range(args.repeats):
        for name, extra in points:
            for mode in ("plain", "chunked"):
                out = subprocess.run([sys.executable, __file__, "--mode", mode, *base, *extra], capture_output=True,
                                     text=True, check=True).stdout
                results.append(dict(json.loads(out.strip().splitlines()[-1]), sweep=name))
                print(json.dumps(results[-1]), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": "python bench/lm_head_memory.py " + " ".join(sys.argv[1:]), "runs": results}, f,
                      indent=1)
    if args.plot and sweeps:
        plot(results, [name for name, _, _ in sweeps], args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
