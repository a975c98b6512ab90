"""Peak memory and time of one SFT forward + backward at a real vocabulary: the full logits against the LM head in
chunks of tokens (`SFTConfig.chunked_lm_head`), each run in its own subprocess.

The model: Qwen2.5-0.5B's shape (hidden 896, intermediate 4864, 14 heads, 2 kv heads, vocabulary 151,936, tied) cut
to `--layers` layers, random weights from a `Qwen2Config` (no download), float32; `--rows` rows of `--tokens` random
tokens, every token trained. One `SFTTrainer.compute_loss` + backward, `--steps` times (the first one warms up).

    python bench/lm_head_memory.py                          # 2 layers, 2 x 1000 tokens, plain and chunked
    python bench/lm_head_memory.py --device cuda --tokens 4000

Memory: the peak RSS of the process (`resource.getrusage` ru_maxrss) and its RSS after the model was built, on CPU;
`torch.cuda.max_memory_allocated` and the allocation after the model was built, on CUDA.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def run_one(args) -> dict:
    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if args.chunk_elements:
        import hf_rlhf.losses.chunked_head as chunked_head

        chunked_head.CHUNK_ELEMENTS = args.chunk_elements
    torch.manual_seed(0)
    vocab = 151_936
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
    return {"mode": args.mode, "direct": args.direct, "chunk_elements": args.chunk_elements, "peak_mb": round(peak),
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
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_one(args)))
        return
    forwarded = sys.argv[1:]
    results = []
    for _ in range(args.repeats):
        for mode in ("plain", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--mode", mode, *forwarded], capture_output=True,
                                 text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
