"""Real sizes: peak memory and throughput at real vocabularies, real lengths and real model shapes, hf_rlhf against
TRL, and generation against the memory-bandwidth roofline.

Shapes (`--shapes`, built locally from configs with random weights, no download; depth cut by `--layers`, widths
and vocabulary NOT cut), each with a word-level tokenizer of exactly the model's vocabulary size (`t0 t1 ...`, so
every sampled id decodes and re-encodes to itself), saved once under the cache directory and loaded by path:

    qwen2.5-0.5b   Qwen2: hidden 896, intermediate 4864, 14 heads, 2 kv heads, vocabulary 151,936, tied, rope 1e6
    smollm2-135m   Llama: hidden 576, intermediate 1536, 9 heads, 3 kv heads, vocabulary 49,152, tied
    llama-3.2-1b   Llama: hidden 2048, intermediate 8192, 32 heads, 8 kv heads, vocabulary 128,256, tied
    tiny           Llama: hidden 64, 4 heads, vocabulary 1,000 (the smoke test)

Workloads (`--workloads`; each (workload, library) runs in its own subprocess, rounds interleaved A B A B):

    sft_padded        TRL SFTTrainer vs hf_rlhf SFTTrainer on the same pre-tokenized rows (up to `--sft_len` tokens,
                      a long tail), right-padded batches of 2; the first logged loss must agree.
    sft_packed        the same rows packed (bfd) into rows of `--sft_len`, batch 1.
    dpo_padded        trl.DPOTrainer vs hf_rlhf.DPOTrainer: prompt `--dpo_prompt` + completions `--dpo_completion`
                      tokens, sigmoid loss, frozen reference, batch 1 pair, 2 steps.
    dpo_padding_free  hf_rlhf's padding-free layout (TRL 1.16 has none on this path): against TRL's padded run.
    dpo_prefix_sharing  hf_rlhf's prefix-shared layout (the prompt once per pair): against TRL's padded run.
    reward            trl.RewardTrainer vs hf_rlhf.RewardTrainer on the DPO workload's pairs (a one-label classifier
                      on the shape's base: no vocabulary logits).
    ppo               TRL 1.12's PPOTrainer (policy, reference, value model, reward model) vs hf_rlhf's PPOTrainer
                      (value head on the policy, reference, reward model): one rollout of `--ppo_batch` x
                      `--ppo_accum` prompts of `--grpo_prompt` tokens, responses of exactly `--grpo_completion`
                      tokens, one PPO epoch, KL 0.05.
    grpo              trl.GRPOTrainer vs hf_rlhf.GRPOTrainer: one prompt of `--grpo_prompt` tokens, G = 8
                      completions of exactly `--grpo_completion` tokens (hf_rlhf `stop_token=None`; TRL
                      `generation_kwargs={"min_new_tokens": L}`: eos is masked until L, so neither stops early),
                      beta = 0, micro-batch `--grpo_batch` (G / grpo_batch accumulation steps), one optimizer step.

Both libraries run their default optimizer (`--optim`, transformers' `adamw_torch_fused`) and the micro-batches of
`BATCHES` unless told otherwise.
    roofline          not against TRL: this machine's memory bandwidth (a 1 GiB tensor copy), then decoding at batch 1
                      and batch G = 8 with each hf_rlhf engine (`generate`, `lean`, `static`) against the bandwidth
                      roofline: every decode step reads all the weights it uses (layers + LM head) and the KV cache,
                      so tokens/s <= batch x bandwidth / bytes per step.

Memory: peak RSS (VmHWM) minus the RSS before the model was loaded, on CPU; `torch.cuda.max_memory_allocated` on
CUDA. Each run is checked against `hf_rlhf.training.memory_plan` (the `hf-rlhf plan` prediction for the same run),
with the error per configuration. `--sweep grpo` runs the GRPO pair over completion lengths (and `--shapes`) and
draws tokens/s and peak memory against the length (`bench/results/scale_sweep.png`).

    python bench/scale.py                                    # qwen2.5-0.5b, 2 layers: sft, dpo, grpo (~25 min CPU)
    python bench/scale.py --workloads roofline --shapes qwen2.5-0.5b,smollm2-135m
    python bench/scale.py --sweep grpo --shapes smollm2-135m --lengths 256,512,1024,2048
    python bench/scale.py --quick --repeats 1 --output /tmp/scale.json       # smoke test (tiny shape), ~1 min
    python bench/scale.py --device cuda ...                  # bench/gpu_scale.sh: the same on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_rlhf from this tree when not installed

SHAPES = {
    "qwen2.5-0.5b": dict(kind="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, layers=24),
    "smollm2-135m": dict(kind="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, layers=30),
    "llama-3.2-1b": dict(kind="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=5e5, layers=16),
    "tiny": dict(kind="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=1e4, layers=2),
}
WORKLOADS = {  # workload -> the libraries it runs, in order (the first one is the reference of the ratios)
    "sft_padded": ("trl", "hf_rlhf"), "sft_packed": ("trl", "hf_rlhf"),
    "dpo_padded": ("trl", "hf_rlhf"), "dpo_padding_free": ("hf_rlhf",), "dpo_prefix_sharing": ("hf_rlhf",),
    "grpo": ("trl", "hf_rlhf"), "reward": ("trl", "hf_rlhf"),
    "ppo": ("trl", "hf_rlhf"),  # TRL 1.12's PPOTrainer (the last TRL with one), side-installed as bench/ppo.py does
    "grpo_static": ("hf_rlhf",), "grpo_lean": ("hf_rlhf",),  # hf_rlhf GRPO on another generation engine
    "roofline": ("generate", "lean", "static"),
}
# hf_rlhf with one memory lever changed, run only when `--libraries` names it (against TRL and hf_rlhf's default)
EXTRA_LIBRARIES = {"hf_rlhf_ac": {"gradient_checkpointing": True}}
# a workload TRL lacks: compared with TRL's run of another
REFERENCE_OF = {"dpo_padding_free": "dpo_padded", "dpo_prefix_sharing": "dpo_padded", "grpo_static": "grpo",
                "grpo_lean": "grpo"}
DEFAULT_WORKLOADS = ("sft_padded", "sft_packed", "dpo_padded", "dpo_padding_free", "grpo")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
G = 8
PRESETS = {
    "full": dict(shapes="qwen2.5-0.5b", layers=2, sft_len=2048, dpo_prompt=512, dpo_completion=512,
                 grpo_prompt=64, grpo_completion=256, decode_tokens=32, roofline_prompt=64),
    "quick": dict(shapes="tiny", layers=2, sft_len=128, dpo_prompt=32, dpo_completion=32, grpo_prompt=16,
                  grpo_completion=16, decode_tokens=8, roofline_prompt=16),
}
# options of every preset: the optimizer both libraries default to (transformers' `adamw_torch_fused`), micro-batches
# (SFT padded rows, DPO / reward pairs, GRPO completions: G / grpo_batch accumulation steps), PPO's rollout
BATCHES = dict(optim="adamw_torch_fused", sft_batch=2, dpo_batch=1, grpo_batch=1, ppo_batch=4, ppo_accum=2)
MB = 2**20


# ----------------------------------------------------------------------------------------------- models, data
def cache_root() -> Path:
    return Path(os.environ.get("HF_RLHF_BENCH_CACHE", Path.home() / ".cache" / "hf_rlhf" / "bench")) / "scale"


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer with exactly `vocab_size` entries: the specials, then `t4 ... t{V-1}` (whitespace
    split), so any id decodes to one word that encodes back to the same id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>")
    tokenizer.padding_side = "right"
    return tokenizer


def model_config(shape: str, layers: int, max_positions: int = 8192):
    from transformers import LlamaConfig, Qwen2Config

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    spec.pop("layers")
    common = dict(num_hidden_layers=layers, tie_word_embeddings=True, max_position_embeddings=max_positions,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2, rms_norm_eps=1e-6)
    if kind == "qwen2":
        config = Qwen2Config(**spec, **common, use_sliding_window=False)
    else:
        config = LlamaConfig(**spec, **common)
    return config


def prepare_model(shape: str, layers: int) -> str:
    """Build (once) the shape's model with seeded random weights and its tokenizer; return their directory."""
    root = cache_root() / f"{shape}-L{layers}"
    if (root / "done").exists():
        return str(root)
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(shape, layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.generation_config.bos_token_id = 2
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    build_tokenizer(config.vocab_size).save_pretrained(root)
    (root / "done").write_text("ok\n")
    return str(root)


def words(ids) -> str:
    return " ".join(f"t{i}" for i in ids)


def random_ids(rng, n: int, vocab: int) -> list[int]:
    return [rng.randrange(len(SPECIALS), vocab) for _ in range(n)]


def sft_lengths(total_len: int) -> list[int]:
    """A long tail that fills exactly two packed rows of `total_len`: [T, T/2, 5T/16, 3T/16]."""
    t = total_len
    return [t, t // 2, (5 * t) // 16, t - t // 2 - (5 * t) // 16]


def sft_dataset(settings: dict, vocab: int):
    import random

    from datasets import Dataset

    rng = random.Random(0)
    rows = [random_ids(rng, n - 1, vocab) + [1] for n in sft_lengths(settings["sft_len"])]
    return Dataset.from_dict({"input_ids": rows})


def dpo_dataset(settings: dict, vocab: int, pairs: int = 2):
    import random

    from datasets import Dataset

    rng = random.Random(1)
    p, c = settings["dpo_prompt"], settings["dpo_completion"]
    rows = [{"prompt": words(random_ids(rng, p, vocab)), "chosen": " " + words(random_ids(rng, c - 1, vocab)),
             "rejected": " " + words(random_ids(rng, c - 1, vocab))} for _ in range(pairs)]
    return Dataset.from_list(rows)


def grpo_dataset(settings: dict, vocab: int):
    import random

    from datasets import Dataset

    rng = random.Random(2)
    return Dataset.from_list([{"prompt": words(random_ids(rng, settings["grpo_prompt"], vocab))}])


def word_reward(prompts, completions, **kwargs):
    """Varies with a random policy's text (so the advantages are not all zero): the share of words whose id ends
    in 0-4; cheap at any length."""
    return [sum(w[-1] in "01234" for w in c.split()) / max(len(c.split()), 1) for c in completions]


# ----------------------------------------------------------------------------------------------- worker side
def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def training_options(settings: dict, output_dir: str, batch: int, steps: int | None = None, accum: int = 1) -> dict:
    cuda = settings["device"] == "cuda"
    options = dict(output_dir=output_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                   learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                   optim=settings["optim"], logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                   seed=0, data_seed=0, use_cpu=not cuda, bf16=cuda, fp16=False, dataloader_num_workers=0,
                   dataloader_pin_memory=False, gradient_checkpointing=settings.get("gradient_checkpointing", False))
    if steps is None:
        options["num_train_epochs"] = 1
    else:
        options["max_steps"] = steps
    return options


def build_sft(library: str, variant: str, model_dir: str, tokenizer, dataset, settings: dict, out: str):
    packed = variant == "packed"
    common = training_options(settings, out, batch=1 if packed else settings["sft_batch"])
    common.update(max_length=settings["sft_len"], packing=packed, packing_strategy="bfd")
    if library == "trl":
        from trl import SFTConfig, SFTTrainer

        if not packed:
            common["padding_free"] = False
        return SFTTrainer(model=model_dir, args=SFTConfig(**common), train_dataset=dataset, processing_class=tokenizer)
    from hf_rlhf import SFTConfig, SFTTrainer

    return SFTTrainer(model_dir, args=SFTConfig(**common), train_dataset=dataset, processing_class=tokenizer)


def build_dpo(library: str, variant: str, model_dir: str, tokenizer, dataset, settings: dict, out: str):
    common = training_options(settings, out, batch=settings["dpo_batch"])
    common.update(max_length=settings["dpo_prompt"] + settings["dpo_completion"] + 8, loss_type="sigmoid")
    if library == "trl":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer(model=model_dir, args=DPOConfig(**common), train_dataset=dataset, processing_class=tokenizer)
    from hf_rlhf import DPOConfig, DPOTrainer

    args = DPOConfig(**common, padding_free=variant == "padding_free", prefix_sharing=variant == "prefix_sharing")
    return DPOTrainer(model_dir, args=args, train_dataset=dataset, processing_class=tokenizer)


def build_reward(library: str, model_dir: str, tokenizer, dataset, settings: dict, out: str):
    """A one-label sequence classifier on the shape's base (its score head seeded by the Trainer's seed), the
    pairs of the DPO workload."""
    common = training_options(settings, out, batch=settings["dpo_batch"])
    common.update(max_length=settings["dpo_prompt"] + settings["dpo_completion"] + 8)
    if library == "trl":
        from trl import RewardConfig, RewardTrainer

        return RewardTrainer(model=model_dir, args=RewardConfig(**common), train_dataset=dataset,
                             processing_class=tokenizer)
    from hf_rlhf import RewardConfig, RewardTrainer

    return RewardTrainer(model_dir, args=RewardConfig(**common), train_dataset=dataset, processing_class=tokenizer)


def ppo_group(settings: dict) -> dict:
    """bench/ppo.py's group: one rollout of `ppo_batch` x `ppo_accum` prompts of `grpo_prompt` tokens, responses of
    exactly `grpo_completion` tokens (no stop token), one PPO epoch, KL 0.05 against the reference."""
    return dict(micro=settings["ppo_batch"], grad_accum=settings["ppo_accum"], ppo_epochs=1,
                response_length=settings["grpo_completion"], rollouts=1, optim=settings["optim"], stop_token=None)


def prepare_ppo_models(model_dir: str, settings: dict) -> str:
    """bench/ppo.py's layout for the shape: policy (the shape's model), reward (a one-label classifier on the same
    base, seeded score head), tokenizer, prompts (a spare rollout, as bench/ppo.py keeps)."""
    import random

    root = Path(model_dir + "-ppo")
    rows = 2 * settings["ppo_batch"] * settings["ppo_accum"]
    marker = root / f"done-{settings['grpo_prompt']}-{rows}"
    if marker.exists():
        return str(root)
    import torch
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.save_pretrained(root / "tokenizer")
    if not (root / "policy").exists():
        (root / "policy").symlink_to(Path(model_dir).resolve())
    torch.manual_seed(1)
    reward = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(root / "reward")
    rng = random.Random(3)
    prompts = []
    for _ in range(rows):
        ids = random_ids(rng, settings["grpo_prompt"], len(tokenizer))
        prompts.append({"prompt": words(ids), "input_ids": ids})
    (root / "prompts.json").write_text(json.dumps(prompts))
    marker.write_text("ok\n")
    return str(root)


def ppo_worker(library: str, settings: dict, model_dir: str) -> dict:
    """hf_rlhf's PPO (a value head on the policy, the default) against TRL 1.12's (separate value model), both with
    a reference and a reward model, built by bench/ppo.py's functions."""
    import ppo  # bench/ppo.py
    import torch

    if library == "trl":
        import trl.experimental.ppo  # noqa: F401

        assert trl.__version__ == ppo.TRL_VERSION, f"TRL worker imported trl {trl.__version__}"
    else:
        import hf_rlhf.trainers.ppo_trainer  # noqa: F401
    import datasets  # noqa: F401

    ppo_dir = prepare_ppo_models(model_dir, settings)
    group = ppo_group(settings)
    prompts = json.loads(Path(ppo_dir, "prompts.json").read_text())
    timer = ppo.PhaseTimer()
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(sys.stderr):
        rss_before = rss_mb()
        reset_peak()
        build = ppo.build_trl if library == "trl" else ppo.build_hf_rlhf
        trainer, models = build("trl" if library == "trl" else "hf_rlhf_value_head", ppo_dir, prompts, group, out,
                                timer)
        load_before = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), time.process_time()
        trainer.train()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        episodes = timer.rows
        tokens = episodes * group["response_length"]
        run = {"seconds": seconds, "cpu_seconds": cpu_seconds, "steps": trainer.state.global_step,
               "first_loss": None, "param_dtype": str(next(trainer.model.parameters()).dtype),
               "chunked_lm_head": library != "trl" and bool(getattr(trainer, "lm_heads", None)),
               "params_m": sum(p.numel() for m in models.values() for p in m.parameters()) / 1e6,
               "load_before": load_before, "threads": torch.get_num_threads(), "episodes": episodes,
               "completion_tokens": tokens, "episodes_per_s": episodes / seconds, "tokens_per_s": tokens / seconds,
               "tokens_per_cpu_s": tokens / cpu_seconds, "models": sorted(models)}
    run["peak_mb"] = peak_mb() - rss_before
    run["memory"] = "peak RSS - RSS before the model"
    run["rss_before_model_mb"], run["peak_rss_mb"] = rss_before, peak_mb()
    return run


def build_grpo(library: str, model_dir: str, tokenizer, dataset, settings: dict, out: str, backend: str | None):
    length = settings["grpo_completion"]
    batch = settings["grpo_batch"]
    if G % batch:
        raise ValueError(f"--grpo_batch {batch} must divide G = {G}")
    common = training_options(settings, out, batch=batch, steps=1, accum=G // batch)
    common.update(num_generations=G, max_completion_length=length, beta=settings.get("beta", 0.0), temperature=1.0)
    if library == "trl":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, num_iterations=1, generation_kwargs={"min_new_tokens": length})
        return GRPOTrainer(model=model_dir, reward_funcs=word_reward, args=args, train_dataset=dataset,
                           processing_class=tokenizer)
    from hf_rlhf import GRPOConfig, GRPOTrainer

    extra = {"generation_backend": backend} if backend else {}
    args = GRPOConfig(**common, num_iterations=1, stop_token=None, **extra)
    return GRPOTrainer(model_dir, reward_funcs=word_reward, args=args, train_dataset=dataset,
                       processing_class=tokenizer)


class Counter:
    """Wraps a collator: the real (non-pad) tokens and positions of the batches it built."""

    def __init__(self, collator):
        self.collator, self.real_tokens, self.positions, self.shapes = collator, 0, 0, []

    def __call__(self, features):
        batch = self.collator(features)
        mask = batch.get("attention_mask")
        ids = batch["input_ids"]
        self.positions += ids.numel()
        self.shapes.append(list(ids.shape))  # (rows, width) of each batch, in order: what the plan is given
        self.real_tokens += int(mask.sum()) if mask is not None else ids.numel()
        if "chosen_input_ids" in batch:  # a collator with separate chosen / rejected tensors
            for key in ("chosen", "rejected"):
                m = batch.get(f"{key}_attention_mask")
                self.real_tokens += int(m.sum()) if m is not None else batch[f"{key}_input_ids"].numel()
        return batch


def pair_tokens(dataset) -> int:
    """Tokens of a tokenized preference dataset's pairs as a padded layout runs them: (prompt + chosen) + (prompt +
    rejected) per row (TRL's and hf_rlhf's prepared columns `prompt_ids`, `chosen_ids`, `rejected_ids`)."""
    return sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"],
                                                               dataset["rejected_ids"]))


def first_loss(trainer) -> float | None:
    for entry in trainer.state.log_history:
        if "loss" in entry:
            return float(entry["loss"])
    return None


def train_worker(workload: str, library: str, settings: dict, model_dir: str) -> dict:
    import torch
    from transformers import PreTrainedTokenizerFast

    # every trainer module imported before the baseline: lazy imports during train() are not the model's memory
    if library == "trl":
        from trl import DPOTrainer, GRPOTrainer, SFTTrainer  # noqa: F401
    else:
        from hf_rlhf import DPOTrainer, GRPOTrainer, SFTTrainer  # noqa: F401
    import datasets  # noqa: F401

    # the class named, not AutoTokenizer: transformers 5 maps model_type qwen2 to Qwen2Tokenizer, whose byte-level
    # pre-tokenizer replaces the saved word-level one (and turns "t5 t6" into no tokens at all)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    vocab = len(tokenizer)
    cuda = settings["device"] == "cuda"
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON
        if workload.startswith("sft"):
            dataset = sft_dataset(settings, vocab)
        elif workload.startswith(("dpo", "reward")):
            dataset = dpo_dataset(settings, vocab, pairs=2 * settings["dpo_batch"])  # two optimizer steps
        else:
            dataset = grpo_dataset(settings, vocab)
        rss_before = rss_mb()
        reset_peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        variant = workload.split("_", 1)[1] if "_" in workload else ""
        if workload.startswith("sft"):
            trainer = build_sft(library, variant, model_dir, tokenizer, dataset, settings, out)
        elif workload.startswith("dpo"):
            trainer = build_dpo(library, variant, model_dir, tokenizer, dataset, settings, out)
        elif workload == "reward":
            trainer = build_reward(library, model_dir, tokenizer, dataset, settings, out)
        else:
            backend = workload.split("_")[1] if "_" in workload else settings.get("backend")
            trainer = build_grpo(library, model_dir, tokenizer, dataset, settings, out, backend)
        counter = None
        if not workload.startswith("grpo"):
            counter = trainer.data_collator = Counter(trainer.data_collator)
        model = trainer.model
        params = [p for p in model.parameters()]
        # hf_rlhf's LM head in chunks of tokens (SFTConfig / PPOConfig.chunked_lm_head), where this tree has it
        heads = getattr(trainer, "lm_heads", None)
        heads = list(heads.values()) if isinstance(heads, dict) else list(heads or [getattr(trainer, "lm_head", None)])
        chunked = library != "trl" and any(head is not None for head in heads)
        load_before = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), time.process_time()
        trainer.train()
        if cuda:
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        run = {"seconds": seconds, "cpu_seconds": cpu_seconds, "steps": trainer.state.global_step,
               "first_loss": first_loss(trainer), "param_dtype": str(params[0].dtype), "chunked_lm_head": chunked,
               "params_m": sum(p.numel() for p in params) / 1e6, "load_before": load_before,
               "threads": torch.get_num_threads()}
        if counter is not None:
            if workload.startswith("dpo"):  # the pairs' tokens, whatever the layout (prefix sharing holds the prompt
                counter.real_tokens = pair_tokens(trainer.train_dataset)  # once; its mask is 4D)
            run.update(real_tokens=counter.real_tokens, positions=counter.positions, batch_shapes=counter.shapes,
                       tokens_per_s=counter.real_tokens / seconds)
        else:
            episodes = G * run["steps"]
            tokens = episodes * settings["grpo_completion"]
            run.update(episodes=episodes, completion_tokens=tokens, episodes_per_s=episodes / seconds,
                       tokens_per_s=tokens / seconds)
        # per CPU-second of this process: moves far less with the shared machine's load than wall time (one thread)
        run["tokens_per_cpu_s"] = run["tokens_per_s"] * seconds / cpu_seconds
    if cuda:
        run["peak_mb"] = torch.cuda.max_memory_allocated() / MB
        run["memory"] = "cuda max_memory_allocated"
    else:
        run["peak_mb"] = peak_mb() - rss_before
        run["memory"] = "peak RSS - RSS before the model"
        run["rss_before_model_mb"], run["peak_rss_mb"] = rss_before, peak_mb()
    return run


def measure_bandwidth(device: str, gib: float = 1.0, repeats: int = 5) -> dict:
    """GB/s of a `gib` GiB fp32 tensor copy (bytes read + bytes written) and of a full read (sum), best of
    `repeats`, with this process's torch threads."""
    import torch

    n = int(gib * 2**30) // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    copy, read = [], []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        copy.append(2 * n * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        src.sum()
        sync()
        read.append(n * 4 / (time.perf_counter() - t) / 1e9)
    del src, dst
    # the other roof: matmul throughput (fp32 on CPU, bf16 on CUDA), for the batches where decoding is compute bound
    size = 8192 if device == "cuda" else 1024
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    flops = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        a @ b
        sync()
        flops.append(2 * size**3 / (time.perf_counter() - t) / 1e9)
    return {"copy_gb_s": max(copy), "read_gb_s": max(read), "matmul_gflops": max(flops), "tensor_gib": gib,
            "repeats": repeats}


def roofline_worker(engine_name: str, settings: dict, model_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_rlhf.generation import build_engine
    from hf_rlhf.training.memory_plan import ModelShape

    device = settings["device"]
    bandwidth = measure_bandwidth(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    shape = ModelShape.from_config(model.config)
    engine = build_engine(engine_name) if engine_name != "static" else build_engine("static", compile=True)
    prompt, new = settings["roofline_prompt"], settings["decode_tokens"]
    results = {}
    gen = torch.Generator().manual_seed(0)
    for batch in (1, G):
        ids = torch.randint(len(SPECIALS), shape.vocab_size, (batch, prompt), generator=gen).to(device)
        mask = torch.ones_like(ids)
        times = []
        for call in range(3):  # the first call warms up (compiles for `static`)
            torch.manual_seed(call)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                out = engine.generate(model, ids, mask, max_new_tokens=new, do_sample=True, temperature=1.0,
                                      eos_token_id=None, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            assert out.response_ids.shape == (batch, new), out.response_ids.shape
        steady = statistics.median(times[1:])
        wbytes = 2 if dtype == torch.bfloat16 else 4
        context = prompt + new / 2  # the KV cache read per step, on average
        step_bytes = (shape.decode_params() * wbytes
                      + shape.num_layers * 2 * shape.kv_dim * context * batch * wbytes)
        best = max(bandwidth["copy_gb_s"], bandwidth["read_gb_s"]) * 1e9
        roof_tokens_s = batch * best / step_bytes
        # compute bound: 2 FLOPs per parameter read per token (attention over the cache left out: short contexts)
        compute_tokens_s = bandwidth["matmul_gflops"] * 1e9 / (2 * shape.decode_params())
        # the prefill is one forward over the prompt: not a decode step; time per call ~ prefill + new steps
        tokens_s = batch * new / steady
        results[f"batch_{batch}"] = {
            "call_seconds": times, "tokens_per_s": tokens_s, "bytes_per_step_mb": step_bytes / MB,
            "roofline_tokens_per_s": roof_tokens_s, "fraction_of_roofline": tokens_s / roof_tokens_s,
            "compute_roof_tokens_per_s": compute_tokens_s,
            "fraction_of_min_roof": tokens_s / min(roof_tokens_s, compute_tokens_s),
            "compile_or_warmup_s": times[0] - steady}
    return {"bandwidth": bandwidth, "engine": engine_name, "prompt": prompt, "new_tokens": new,
            "decode_params_m": shape.decode_params() / 1e6, "dtype": str(dtype), "results": results,
            "threads": torch.get_num_threads(), "load_before": os.getloadavg()[0]}


def worker(config: str, settings: dict, model_dir: str) -> dict:
    import torch

    torch.set_num_threads(settings["threads"])
    workload, library = config.split(":")
    if library in EXTRA_LIBRARIES:  # hf_rlhf with one lever changed
        settings = dict(settings, **EXTRA_LIBRARIES[library])
    if workload == "roofline":
        run = roofline_worker(library, settings, model_dir)
    elif workload == "ppo":
        run = ppo_worker(library, settings, model_dir)
    else:
        run = train_worker(workload, library, settings, model_dir)
    return {"config": config, "workload": workload, "library": library, **run}


# ----------------------------------------------------------------------------------------------- predictions
def predict(workload: str, library: str, settings: dict, model_dir: str, run: dict,
            copies: float | None = None) -> dict:
    """`hf_rlhf.training.memory_plan`'s prediction for this run (the same call `hf-rlhf plan` makes); for padded
    SFT, whose batches differ in width, the largest over its steps (the first step holds no optimizer state).
    Results files written before the optimizer and batch options existed ran `adamw_torch` and the old batches."""
    from hf_rlhf.training.memory_plan import ModelShape, PlanOptions, plan_memory

    shape = ModelShape.load(model_dir)
    cuda = settings["device"] == "cuda"
    command = workload.split("_")[0]
    settings = dict(settings, **EXTRA_LIBRARIES.get(library, {}))
    common = dict(weight_dtype="float32", compute_dtype="bfloat16" if cuda else "float32",
                  activation_checkpointing=settings.get("gradient_checkpointing", False),
                  chunked_head=bool(run.get("chunked_lm_head")), optimizer=settings.get("optim", "adamw_torch"),
                  logits_copies=CALIBRATION.get((command, library)) if copies is None else copies,
                  device=settings["device"])
    if workload.startswith("sft"):
        t = settings["sft_len"]
        # the batches' shapes as counted; the seeded sampler gives both libraries this order (runs written before
        # the count was kept)
        shapes = run.get("batch_shapes") or ([[2, t], [2, (5 * t) // 16]] if workload == "sft_padded" else [[1, t]] * 2)
        plans = [plan_memory(shape, PlanOptions(command="sft", batch_size=rows, seq_len=width,
                                                steps=1 if step == 0 else 2, **common)).as_dict()
                 for step, (rows, width) in enumerate(shapes)]
        return max(plans, key=lambda plan: plan["peak"])
    if workload.startswith(("dpo", "reward")):
        seq = settings["dpo_prompt"] + settings["dpo_completion"]
        keep = settings["dpo_completion"] if library != "trl" else None  # hf_rlhf: logits at completions only
        options = PlanOptions(command=command, batch_size=settings.get("dpo_batch", 1), seq_len=seq,
                              logits_positions=keep, steps=2, **common)
    elif workload == "ppo":
        seq = settings["grpo_prompt"] + settings["grpo_completion"]
        rollout = settings["ppo_batch"] * settings["ppo_accum"]
        options = PlanOptions(command="ppo", batch_size=settings["ppo_batch"], seq_len=seq,
                              gradient_accumulation_steps=settings["ppo_accum"],
                              logits_positions=settings["grpo_completion"], generation_batch=rollout,
                              prompt_len=settings["grpo_prompt"], completion_len=settings["grpo_completion"],
                              beta=0.05, reward_model=True, value_model=library == "trl", steps=1,
                              prefix_sharing=False, **common)  # every prompt of a PPO rollout is distinct
    else:
        seq = settings["grpo_prompt"] + settings["grpo_completion"]
        batch = settings.get("grpo_batch", 1)
        options = PlanOptions(command="grpo", batch_size=batch, seq_len=seq, gradient_accumulation_steps=G // batch,
                              logits_positions=settings["grpo_completion"], generation_batch=G,
                              prompt_len=settings["grpo_prompt"], completion_len=settings["grpo_completion"], steps=1,
                              beta=settings.get("beta", 0.0), prefix_sharing=library != "trl", **common)
    return plan_memory(shape, options).as_dict()


# TRL's copies of the (positions x vocabulary) fp32 logits at its loss's peak, from this machine's CPU runs (the
# copies that make the forward / backward phase match the measured peak: `implied_logits_copies` in the JSON):
# SFT 1.92 padded, 1.45 packed; DPO 1.86; GRPO 7.8 / 6.9 / 6.3 at 512 / 1,024 / 2,048 completion tokens (a part that
# does not grow with the length). hf_rlhf's runs use memory_plan's own constants (what `hf-rlhf plan` prints).
CALIBRATION: dict[tuple[str, str], float] = {("sft", "trl"): 1.7, ("dpo", "trl"): 1.86, ("grpo", "trl"): 6.3}


# ----------------------------------------------------------------------------------------------- parent side
def trl_ppo_dir() -> str:
    """TRL 1.12 side-installed (bench/ppo.py's cache): only its PPO workers put it first on their path."""
    import ppo  # bench/ppo.py

    return ppo.trl_side_install()


def summarize(runs: list[dict], configs: list[str]) -> dict:
    summary = {}
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        entry = {"runs": len(mine), "workload": mine[0]["workload"], "library": mine[0]["library"],
                 "shape": mine[0]["shape"], "suffix": config[len(config.split("@")[0]):]}  # "@<length>" (--sweep)
        if mine[0]["workload"] == "roofline":
            for batch in ("batch_1", f"batch_{G}"):
                for key in ("tokens_per_s", "roofline_tokens_per_s", "fraction_of_roofline",
                            "compute_roof_tokens_per_s", "fraction_of_min_roof"):
                    entry[f"{batch}_{key}"] = statistics.median(r["results"][batch][key] for r in mine)
            entry["copy_gb_s"] = statistics.median(r["bandwidth"]["copy_gb_s"] for r in mine)
            entry["read_gb_s"] = statistics.median(r["bandwidth"]["read_gb_s"] for r in mine)
            entry["matmul_gflops"] = statistics.median(r["bandwidth"]["matmul_gflops"] for r in mine)
        else:
            for key in ("tokens_per_s", "peak_mb", "seconds", "predicted_mb", "prediction_error"):
                entry[key] = statistics.median(r[key] for r in mine)
            entry["first_loss"] = mine[0]["first_loss"]
            entry["steps"] = mine[0]["steps"]
        summary[config] = entry
    for config, entry in summary.items():  # paired ratios against TRL's run of the same (shape, workload)
        if entry["workload"] == "roofline" or entry["library"] == "trl":
            continue
        ref_workload = REFERENCE_OF.get(entry["workload"], entry["workload"])
        ref = f"{entry['shape']}/{ref_workload}:trl{entry['suffix']}"
        if ref not in summary:
            continue
        pairs = [(a, b) for a in runs if a["config"] == config for b in runs
                 if b["config"] == ref and b["round"] == a["round"]]
        entry["speed_vs_trl"] = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs)
        per_cpu = lambda r: r["tokens_per_s"] * r["seconds"] / r["cpu_seconds"]  # noqa: E731
        entry["cpu_speed_vs_trl"] = statistics.median(per_cpu(a) / per_cpu(b) for a, b in pairs)
        entry["memory_vs_trl"] = statistics.median(a["peak_mb"] / b["peak_mb"] for a, b in pairs)
    return summary


def markdown_table(summary: dict) -> str:
    if all(entry["workload"] == "roofline" for entry in summary.values()):
        return roofline_table(summary)
    return training_table(summary) + ("\n\n" + roofline_table(summary) if any(
        entry["workload"] == "roofline" for entry in summary.values()) else "")


def training_table(summary: dict) -> str:
    lines = ["| shape | workload | library | tokens/s | speed vs TRL | per CPU-s vs TRL | peak MB | memory vs TRL "
             "| predicted MB | prediction error | first loss | steps |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in summary.values():
        if entry["workload"] == "roofline":
            continue
        speed = f"{entry['speed_vs_trl']:.2f}×" if "speed_vs_trl" in entry else "–"
        cpu = f"{entry['cpu_speed_vs_trl']:.2f}×" if "cpu_speed_vs_trl" in entry else "–"
        memory = f"{entry['memory_vs_trl']:.2f}×" if "memory_vs_trl" in entry else "–"
        loss = f"{entry['first_loss']:.4f}" if entry["first_loss"] is not None else "–"
        lines.append(f"| {entry['shape']} | {entry['workload']}{entry['suffix']} | {entry['library']} "
                     f"| {entry['tokens_per_s']:,.1f} | {speed} | {cpu} | {entry['peak_mb']:,.0f} | {memory} "
                     f"| {entry['predicted_mb']:,.0f} "
                     f"| {entry['prediction_error']:+.1%} | {loss} | {entry['steps']} |")
    return "\n".join(lines)


def roofline_table(summary: dict) -> str:
    roof = [e for e in summary.values() if e["workload"] == "roofline"]
    lines = []
    if roof:
        lines += ["| shape | engine | copy GB/s | read GB/s | matmul GFLOP/s | batch | tokens/s | bandwidth roof "
                      "| fraction | compute roof | fraction of the lower roof |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in roof:
            for batch in (1, G):
                b = f"batch_{batch}_"
                lines.append(
                    f"| {e['shape']} | {e['library']} | {e['copy_gb_s']:.1f} | {e['read_gb_s']:.1f} "
                    f"| {e['matmul_gflops']:,.0f} | {batch} | {e[b + 'tokens_per_s']:,.1f} "
                    f"| {e[b + 'roofline_tokens_per_s']:,.1f} | {e[b + 'fraction_of_roofline']:.0%} "
                    f"| {e[b + 'compute_roof_tokens_per_s']:,.1f} | {e[b + 'fraction_of_min_roof']:.0%} |")
    return "\n".join(lines)


def check_runs(runs: list[dict], summary: dict) -> list[str]:
    """Same work across the libraries of a pair, and the first losses (not the GRPO ones: sampled) agree."""
    notes = []
    for config, entry in summary.items():
        if entry["workload"] == "roofline" or entry["library"] == "trl":
            continue
        ref = f"{entry['shape']}/{REFERENCE_OF.get(entry['workload'], entry['workload'])}:trl{entry['suffix']}"
        if ref not in summary:
            continue
        mine = next(r for r in runs if r["config"] == config)
        theirs = next(r for r in runs if r["config"] == ref)
        for key in ("real_tokens", "episodes", "completion_tokens"):
            if key in mine and mine[key] != theirs.get(key):
                notes.append(f"{config}: {key} {mine[key]} against TRL's {theirs.get(key)} (different work)")
        if entry["workload"].startswith(("sft", "dpo")) and None not in (mine["first_loss"], theirs["first_loss"]):
            gap = abs(mine["first_loss"] - theirs["first_loss"])
            notes.append(f"{config}: first loss {mine['first_loss']:.5f} vs TRL {theirs['first_loss']:.5f} "
                         f"({'same' if gap < 1e-3 * max(1.0, abs(theirs['first_loss'])) else 'DIFFERENT'})")
    return notes


def plot_sweep(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key in sorted({(r["shape"], r["library"]) for r in runs}):
        mine = sorted((r for r in runs if (r["shape"], r["library"]) == key), key=lambda r: r["length"])
        lengths = sorted({r["length"] for r in mine})
        tok = [statistics.median(r["tokens_per_s"] * r["seconds"] / r["cpu_seconds"] for r in mine
                                 if r["length"] == n) for n in lengths]
        mem = [statistics.median(r["peak_mb"] for r in mine if r["length"] == n) / 1024 for n in lengths]
        pred = [statistics.median(r["predicted_mb"] for r in mine if r["length"] == n) / 1024 for n in lengths]
        label = f"{key[1]} ({key[0]})"
        speed.plot(lengths, tok, marker="o", label=label)
        line, = memory.plot(lengths, mem, marker="o", label=label)
        memory.plot(lengths, pred, linestyle=":", color=line.get_color(), label=f"{label}, predicted")
    for ax, title, unit in ((speed, "GRPO throughput", "completion tokens per CPU-second (1 thread)"),
                            (memory, "GRPO peak memory", "GiB" + (" (max allocated)" if runs and runs[0].get(
                                "memory", "").startswith("cuda") else " (peak RSS above the pre-model mark)"))):
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel(f"completion length (G = {G}, one step, beta = 0)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def annotate(run: dict, settings: dict, model_dir: str) -> None:
    """Add the plan's prediction for `run` and its error against the measured peak."""
    prediction = predict(run["workload"], run["library"], dict(settings, grpo_completion=run["length"]), model_dir,
                         run)
    run["predicted_mb"] = prediction["peak"] / MB
    run["prediction"] = prediction
    run["prediction_error"] = run["predicted_mb"] / run["peak_mb"] - 1
    # the copies of the logits that would make the forward / backward phase match the measured peak (calibration)
    zero, one = (predict(run["workload"], run["library"], dict(settings, grpo_completion=run["length"]), model_dir,
                         run, copies=c)["phases"]["forward / backward"] / MB for c in (0.0, 1.0))
    run["implied_logits_copies"] = (run["peak_mb"] - zero) / (one - zero)


def repredict(path: str, plot: str | None = None) -> dict:
    """Recompute the predictions, table and notes of a results JSON (after the plan's constants changed)."""
    report = json.loads(Path(path).read_text())
    settings, runs = report["settings"], report["runs"]
    for run in runs:
        if run["workload"] != "roofline":
            annotate(run, settings, prepare_model(run["shape"], settings["layers"]))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    report["summary"] = summarize(runs, configs)
    report["table"] = markdown_table(report["summary"])
    report["notes"] = check_runs(runs, report["summary"]) + [n for n in report["notes"]
                                                             if "decoder layers" in n or n.startswith("Merged")]
    if plot:
        plot_sweep([r for r in runs if r["workload"] == "grpo"], plot)
    machine = report.pop("machine", None)
    Path(path).write_text(json.dumps({**report, "machine": machine}, indent=2) + "\n")
    print(report["table"] + "\n\n" + "\n".join(f"- {n}" for n in report["notes"]))
    return report


def merge(paths: list[str], output: str, plot: str | None = None) -> dict:
    """One results file from several runs of this script (a configuration rerun later replaces the earlier runs
    of it); the merged notes say which file each run came from."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    runs: dict[str, list[dict]] = {}
    for path, report in zip(paths, reports):
        mine: dict[str, list[dict]] = {}
        for run in report["runs"]:
            mine.setdefault(run["config"], []).append({**run, "source": path})
        runs.update(mine)  # a later file's runs of a configuration replace an earlier file's
    merged = {**reports[0], "runs": [run for group in runs.values() for run in group], "merged_from": paths}
    merged["notes"] = [n for n in reports[0]["notes"] if "decoder layers" in n] + [
        "Merged from " + ", ".join(paths) + ": runs of different files ran at different times (see each run's "
        "load_before), so their ratios are not paired in time."]
    Path(output).write_text(json.dumps(merged, indent=2) + "\n")
    return repredict(output, plot)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny shape and lengths: a smoke run")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds (default 1: the runs are long)")
    parser.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--layers", type=int, help="decoder layers (the depth cut; default 2)")
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--libraries", default="", help="only these libraries / engines (default: all)")
    parser.add_argument("--sft_len", type=int)
    parser.add_argument("--dpo_prompt", type=int)
    parser.add_argument("--dpo_completion", type=int)
    parser.add_argument("--grpo_prompt", type=int)
    parser.add_argument("--grpo_completion", type=int)
    parser.add_argument("--backend", help="hf_rlhf GRPO generation_backend (default: the trainer's)")
    parser.add_argument("--beta", type=float, help="GRPO's KL coefficient (default 0: no reference model)")
    parser.add_argument("--optim", help=f"both libraries' optimizer (default {BATCHES['optim']}, their default)")
    for key in ("sft_batch", "dpo_batch", "grpo_batch", "ppo_batch", "ppo_accum"):
        parser.add_argument(f"--{key}", type=int, help=f"micro-batch (default {BATCHES[key]}; see BATCHES)")
    parser.add_argument("--decode_tokens", type=int, help="roofline: new tokens per call")
    parser.add_argument("--roofline_prompt", type=int, help="roofline: prompt tokens")
    parser.add_argument("--sweep", choices=("grpo",), help="run the GRPO pair over --lengths")
    parser.add_argument("--lengths", default="256,512,1024,2048", help="--sweep: completion lengths")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="JSON path (default bench/results/scale.json, scale_sweep.json)")
    parser.add_argument("--plot", help="--sweep: PNG path (default bench/results/scale_sweep.png)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", help=argparse.SUPPRESS)
    parser.add_argument("--repredict", metavar="JSON", help="recompute the predictions of a results file and exit")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="join the runs of these results files (same settings) into --output, then --repredict it")
    cli = parser.parse_args(argv)
    if cli.merge:
        return merge(cli.merge, cli.output or "bench/results/scale.json", cli.plot)
    if cli.repredict:
        return repredict(cli.repredict, cli.plot)
    if cli.worker:
        print(json.dumps(worker(cli.worker, json.loads(cli.settings), cli.model_dir)))
        return {}
    if cli.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: skipped")
            return {"skipped": "no CUDA"}
    settings = dict(PRESETS["quick" if cli.quick else "full"], **BATCHES, device=cli.device, threads=cli.threads,
                    backend=cli.backend)
    for key in ("shapes", "layers", "sft_len", "dpo_prompt", "dpo_completion", "grpo_prompt", "grpo_completion",
                "decode_tokens", "roofline_prompt", "beta", *BATCHES):
        if getattr(cli, key) is not None:
            settings[key] = getattr(cli, key)
    shapes = settings["shapes"].split(",")
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}")
    workloads = ["grpo"] if cli.sweep else cli.workloads.split(",")
    if set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(set(workloads) - set(WORKLOADS))}")
    only = set(filter(None, cli.libraries.split(",")))
    lengths = [int(n) for n in cli.lengths.split(",")] if cli.sweep else [settings["grpo_completion"]]
    plan = [(shape, workload, library, length) for shape in shapes for length in lengths for workload in workloads
            for library in WORKLOADS[workload] + tuple(EXTRA_LIBRARIES) if (library in only if only else
                                                                             library not in EXTRA_LIBRARIES)]
    default_output = "bench/results/scale_sweep.json" if cli.sweep else "bench/results/scale.json"
    if cli.device == "cuda" and os.environ.get("OUT"):
        default_output = os.path.join(os.environ["OUT"], Path(default_output).name)
    output = cli.output or default_output
    dirs = {shape: prepare_model(shape, settings["layers"]) for shape in shapes}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for r in range(cli.repeats):
        for shape, workload, library, length in plan:  # interleaved: A B A B
            run_settings = dict(settings, grpo_completion=length)
            config = f"{workload}:{library}"
            try:
                side = trl_ppo_dir() if (workload, library) == ("ppo", "trl") else None
                run = harness.run_worker(__file__, ["--worker", config, "--settings", json.dumps(run_settings),
                                                    "--model_dir", dirs[shape]], extra_pythonpath=side)
            except RuntimeError as e:  # one failing configuration (out of memory, ...) does not lose the others
                print(f"round {r + 1} {shape} {config} FAILED: {str(e)[-600:]}", flush=True)
                continue
            run.update(round=r, shape=shape, length=length, config=f"{shape}/{config}"
                       + (f"@{length}" if cli.sweep else ""))
            if workload != "roofline":
                annotate(run, settings, dirs[shape])
                print(f"round {r + 1}/{cli.repeats} {run['config']}: {run['tokens_per_s']:,.1f} tokens/s, peak "
                      f"{run['peak_mb']:,.0f} MB (predicted {run['predicted_mb']:,.0f}, "
                      f"{run['prediction_error']:+.1%}), {run['seconds']:.1f} s, first loss {run['first_loss']}, "
                      f"load {run['load_before']:.1f}", flush=True)
            else:
                b1, bg = run["results"]["batch_1"], run["results"][f"batch_{G}"]
                print(f"round {r + 1}/{cli.repeats} {run['config']}: copy {run['bandwidth']['copy_gb_s']:.1f} GB/s, "
                      f"batch 1 {b1['tokens_per_s']:.1f} tok/s ({b1['fraction_of_roofline']:.0%} of roofline), "
                      f"batch {G} {bg['tokens_per_s']:.1f} tok/s ({bg['fraction_of_roofline']:.0%})", flush=True)
            runs.append(run)
            with open(f"{output}.runs.jsonl", "a") as f:  # each run as it ends: a stage cut by a timeout keeps them
                f.write(json.dumps(run) + "\n")
    if not runs:
        print("every run failed")
        return {}
    configs = list(dict.fromkeys(r["config"] for r in runs))
    summary = summarize(runs, configs)
    notes = check_runs(runs, summary)
    table = markdown_table(summary)
    command = "python bench/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    notes.append(f"{settings['layers']} decoder layers (depth cut; widths and vocabulary real), fp32 weights"
                 + (", bf16 autocast" if cli.device == "cuda" else "") + f", {cli.threads} torch thread(s), "
                 f"{cli.device}; memory = " + ("max_memory_allocated" if cli.device == "cuda" else
                                               "peak RSS minus the RSS before the model was loaded"))
    report = {"settings": settings, "repeats": cli.repeats, "summary": summary, "table": table, "notes": notes,
              "runs": runs}
    if cli.sweep:
        plot_sweep([r for r in runs if r["workload"] == "grpo"], cli.plot or str(Path(output).with_suffix(".png")))
    harness.finish(output, command, report, ("torch", "transformers", "trl", "accelerate", "peft"))
    return report


if __name__ == "__main__":
    main()
