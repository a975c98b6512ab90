"""PPO episodes/s and peak RSS: hf_rlhf `PPOTrainer` vs TRL 1.12's `trl.experimental.ppo.PPOTrainer`.

TRL 1.12.0, the last TRL release with PPO, is pip-installed (`--no-deps`) into a side directory outside the repository
(`$HF_RLHF_BENCH_CACHE/trl-1.12.0`, default `~/.cache/hf_rlhf/bench/trl-1.12.0`) the first time a TRL configuration
runs; only TRL's workers put it first on their PYTHONPATH (and assert `trl.__version__`), hf_rlhf's use the installed
TRL. It runs unchanged on transformers 5.23 / accelerate 1.15 on CPU: no shim was needed (see `build_trl`).

One process per run (no DDP), each configuration in its own subprocess, rounds interleaved (A B C A B C ...) so that
drifts in the load of this shared machine hit every configuration alike. All runs of a group load the same saved
models and prompts and do the same PPO work: prompts per rollout, micro-batch, gradient accumulation, one mini-batch
(TRL steps the optimizer once per pass over a rollout whatever its num_mini_batches), PPO epochs, response length,
temperature, stop token (eos), KL and value coefficients, AdamW and learning rate, fp32, no activation checkpointing,
one torch thread, one log per rollout; the episodes generated and optimizer steps taken are counted and checked.
Models: a seeded toy Llama policy; the reward model = its base + a seeded LoRA reward adapter with a score head,
merged into a full classifier for every configuration but the one-base ones, which load the adapter itself; the value
model (where there is one) starts from the reward model, as in TRL's examples.

    speed group (the toy "small" Llama, 0.9M parameters per model):
      trl                   TRL 1.12: policy, reference copy, separate value model, reward model.
      hf_rlhf               hf_rlhf with the same separate value model (`value_model=`): the same four models.
      hf_rlhf_value_head    hf_rlhf's default: a value head on the policy backbone.
    memory group (a 40M-parameter Llama per model: the weights dominate memory), LoRA r=16 on all linears:
      trl_peft              TRL 1.12 `peft_config=`: LoRA policy (reference = adapters off), separate fully trained
                            value model, separate reward model.
      hf_rlhf_one_base      hf_rlhf's one-base setup: LoRA policy, reference = adapters off, reward = `RewardAdapter`
                            on the same frozen base, value head on the policy's hidden states.
      hf_rlhf_one_base_value_adapter   the same with `value_model="adapter"`: a value LoRA adapter + value head.
      extras (--configs): hf_rlhf_value_head_forward (the default with logprobs_from_generation=False: the rollout's
                          old log-probs and values from a policy forward, not off the decoding; speed group),
                          hf_rlhf_lora_head (LoRA policy + value head, separate merged reward model),
                          hf_rlhf_peft (TRL's peft setup in hf_rlhf: separate value and reward models).

episodes/s = prompts rolled out / wall time of `trainer.train()`. Peak RSS = the worker's high-water mark at the end
(VmHWM); "increase" = that minus the high-water mark after the imports, before any model is loaded. Each run also
times where `train()` went (`PhaseTimer`: generation, forwards by model, backward, optimizer, gc) and counts the bytes
of weights, trainable parameters and optimizer state.

    python bench/ppo.py                          # ~20 min on 2 busy CPU cores
    python bench/ppo.py --quick --repeats 1      # smoke run of 4 configurations: ~80 s (~2 min on 2 busy cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

TRL_VERSION = "1.12.0"
GROUPS = {"hf_rlhf": "speed", "hf_rlhf_value_head": "speed", "hf_rlhf_value_head_forward": "speed", "trl": "speed",
          "hf_rlhf_one_base": "memory",
          "hf_rlhf_one_base_value_adapter": "memory", "hf_rlhf_lora_head": "memory", "hf_rlhf_peft": "memory",
          "trl_peft": "memory"}
REFERENCE = {"speed": "trl", "memory": "trl_peft"}  # the ratio column of each group
DEFAULT_CONFIGS = ("hf_rlhf", "hf_rlhf_value_head", "trl", "hf_rlhf_one_base", "hf_rlhf_one_base_value_adapter",
                   "trl_peft")
EXTRA_CONFIGS = ("hf_rlhf_value_head_forward", "hf_rlhf_lora_head", "hf_rlhf_peft")
OPTIONS = {"hf_rlhf_value_head_forward": {"logprobs_from_generation": False}}  # PPOConfig options of a config
QUICK_CONFIGS = ("hf_rlhf", "trl", "hf_rlhf_one_base", "trl_peft")  # --quick's default: one worker costs ~10 s
MB = 2**20
SMALL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384)  # toy "small"
PRESETS = {
    # rollout = micro x grad_accum prompts; episodes = rollouts x rollout
    "full": {
        "speed": dict(model=SMALL, micro=4, grad_accum=4, ppo_epochs=4, response_length=24, rollouts=8),
        "memory": dict(model=dict(hidden_size=640, num_hidden_layers=8, num_attention_heads=10, intermediate_size=1728),
                       micro=4, grad_accum=2, ppo_epochs=2, response_length=16, rollouts=2),
    },
    "quick": {
        "speed": dict(model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
                      micro=2, grad_accum=2, ppo_epochs=1, response_length=8, rollouts=2),
        "memory": dict(model=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=384),
                       micro=2, grad_accum=2, ppo_epochs=1, response_length=8, rollouts=2),
    },
}
COMMON = dict(temperature=0.7, learning_rate=1e-5, kl_coef=0.05, vf_coef=0.1, lora_r=16, lora_alpha=32)


def rollout_size(group: dict) -> int:
    return group["micro"] * group["grad_accum"]


# ----------------------------------------------------------------------------------------------- worker side
class PhaseTimer:
    """Wall time of `train()` by phase, from hooks both libraries go through alike.

    generate: `GenerationMixin.generate`, or the lean engine's decode loop (and the rows it generated = the
    episodes); forward/reward/no_grad: hf_rlhf's reward source (re-tokenization + forward), TRL's reward-model
    backbone; forward/<model>/<grad|no_grad>: the other forwards of each model's backbone (a LoRA reference is the
    policy backbone with adapters off, so it counts as policy; so do a value adapter's forwards on the shared base);
    backward: `Tensor.backward`; optimizer: `Optimizer.step`; gc: explicit `gc.collect()` calls (TRL makes two per
    rollout). The rest is "other".
    """

    def __init__(self):
        self.seconds, self.calls, self.rows = {}, {}, 0
        self._outer, self._starts = None, {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def timed(self, phase: str, fn):
        """`fn` timed as `phase`; hooks and nested timed calls inside it are not counted again."""

        def wrapper(*args, **kwargs):
            if self._outer is not None:
                return fn(*args, **kwargs)
            self._outer, start = phase, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._outer = None
                self.add(phase, time.perf_counter() - start)

        return wrapper

    def install(self, backbones: dict) -> None:
        import gc

        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from transformers import GenerationMixin

        generate = GenerationMixin.generate

        def counted_generate(model, *args, **kwargs):
            self.rows += (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape[0]
            return generate(model, *args, **kwargs)

        GenerationMixin.generate = self.timed("generate", counted_generate)
        try:  # hf_rlhf's lean engine decodes without `generate`: its calls are the generation phase then
            from hf_rlhf.generation.engines import LeanDecodeEngine
        except ImportError:  # a TRL worker's path may lack it
            LeanDecodeEngine = None
        if LeanDecodeEngine is not None:
            lean = LeanDecodeEngine._generate

            def counted_lean(engine, model, query_ids, *args, **kwargs):
                self.rows += query_ids.shape[0]
                return lean(engine, model, query_ids, *args, **kwargs)

            LeanDecodeEngine._generate = self.timed("generate", counted_lean)
        torch.Tensor.backward = self.timed("backward", torch.Tensor.backward)
        gc.collect = self.timed("gc", gc.collect)
        register_optimizer_step_pre_hook(lambda *a: self._start("optimizer"))
        register_optimizer_step_post_hook(lambda *a: self._stop("optimizer", "optimizer"))
        for role, module in backbones.items():
            module.register_forward_pre_hook(lambda *a, _role=role: self._start(_role))
            module.register_forward_hook(lambda *a, _role=role: self._stop(
                _role, f"forward/{_role}/{'grad' if torch.is_grad_enabled() else 'no_grad'}"))

    def _start(self, key: str) -> None:
        self._starts[key] = time.perf_counter()

    def _stop(self, key: str, phase: str) -> None:
        start = self._starts.pop(key, None)
        if start is not None and self._outer is None:
            self.add(phase, time.perf_counter() - start)

    def report(self, total: float) -> dict:
        phases = {k: round(v, 4) for k, v in sorted(self.seconds.items())}
        phases["other"] = round(total - sum(self.seconds.values()), 4)
        return {"seconds": phases, "calls": dict(sorted(self.calls.items())), "generated_rows": self.rows}


def backbone(model):
    """The transformer body (LlamaModel) of a causal LM, sequence classifier or PeftModel of one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix)


def peak_rss_mb() -> float:
    """The process's peak RSS in MB: VmHWM, the high-water mark of this process image. Not `ru_maxrss`, which Linux
    carries over from the parent across fork + exec (the parent's RSS when it started the worker would count)."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux; no /proc elsewhere


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def memory_report(models: dict, optimizer) -> dict:
    """MB of weights per model (storage shared between models counted once, in the first), of the trainable
    parameters (= their gradients' bytes at the peak) and of the optimizer state after training."""
    import torch

    out, seen = {}, set()
    for role, module in models.items():
        params = [p for p in module.parameters() if p.data_ptr() not in seen]
        seen |= {p.data_ptr() for p in params}
        out[f"weights/{role}"] = round(tensor_bytes(params) / MB, 2)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out["trainable"] = round(tensor_bytes(params) / MB, 2)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out["optimizer_state"] = round(tensor_bytes(state) / MB, 2)
    return out


def load_models(model_dir: str):
    """(policy, reward model, value model): the value model starts from the reward model, as in TRL's examples."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy = AutoModelForCausalLM.from_pretrained(f"{model_dir}/policy")
    reward = AutoModelForSequenceClassification.from_pretrained(f"{model_dir}/reward", num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(f"{model_dir}/reward", num_labels=1)
    return policy, reward, value


def lora(task_type: str = "CAUSAL_LM"):
    from peft import LoraConfig

    return LoraConfig(r=COMMON["lora_r"], lora_alpha=COMMON["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type=task_type)


def ppo_options(group: dict, output_dir: str) -> dict:
    """The options both PPOConfigs share, by the same names."""
    return dict(
        output_dir=output_dir, per_device_train_batch_size=group["micro"],
        gradient_accumulation_steps=group["grad_accum"], num_mini_batches=1, num_ppo_epochs=group["ppo_epochs"],
        response_length=group["response_length"], temperature=COMMON["temperature"],
        stop_token=group.get("stop_token", "eos"),
        local_rollout_forward_batch_size=rollout_size(group), kl_coef=COMMON["kl_coef"], vf_coef=COMMON["vf_coef"],
        learning_rate=COMMON["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim=group.get("optim", "adamw_torch"), bf16=False, fp16=False, use_cpu=True, seed=0, report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )


def build_trl(name: str, model_dir: str, prompts: list[dict], group: dict, output_dir: str, timer: PhaseTimer):
    """TRL 1.12's PPOTrainer as its docs use it. No shim: it runs as is on transformers 5.23 / accelerate 1.15
    (only FutureWarnings: `gradient_checkpointing` renamed, `generation_config` passed with generation arguments).

    Set here, as TRL needs: a left-padding tokenizer, pre-tokenized `input_ids`, bf16 and gradient checkpointing off
    (TRL's defaults are on), `stop_token="eos"` (TRL's default is none), no sample generations. Chosen so that both
    libraries do the same steps: `num_mini_batches=1` (TRL's accelerator accumulates over the whole rollout, so with
    2 mini-batches it still steps once per PPO epoch, measured) and one spare rollout of prompts (`prepare_models`).
    """
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(f"{model_dir}/tokenizer", padding_side="left")  # TRL needs left pads
    policy, reward, value = load_models(model_dir)
    args = PPOConfig(**ppo_options(group, output_dir), gradient_checkpointing=False,  # TRL's default is on
                     total_episodes=group["rollouts"] * rollout_size(group), logging_steps=1, num_sample_generations=0)
    dataset = Dataset.from_dict({"input_ids": [row["input_ids"] for row in prompts]})
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
                         train_dataset=dataset, value_model=value, peft_config=lora() if name == "trl_peft" else None)
    models = {"policy": trainer.model.policy, "reference": trainer.ref_model, "value": trainer.model.value_model,
              "reward": trainer.reward_model}
    models = {role: model for role, model in models.items() if model is not None}
    timer.install({role: backbone(model) for role, model in models.items()})
    return trainer, models


def build_hf_rlhf(name: str, model_dir: str, prompts: list[dict], group: dict, output_dir: str, timer: PhaseTimer):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from hf_rlhf import PPOConfig, PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(f"{model_dir}/tokenizer")
    if name.startswith("hf_rlhf_one_base"):  # reward and value on the policy's own base
        from transformers import AutoModelForCausalLM

        from hf_rlhf.rewards import RewardAdapter

        policy = AutoModelForCausalLM.from_pretrained(f"{model_dir}/policy")
        reward = RewardAdapter(f"{model_dir}/reward_adapter")
        value = "adapter" if name == "hf_rlhf_one_base_value_adapter" else None  # None: a value head
    else:
        policy, reward, value = load_models(model_dir)
        value = value if name in ("hf_rlhf", "hf_rlhf_peft") else None  # None: a value head on the policy
    args = PPOConfig(**ppo_options(group, output_dir), activation_checkpointing=False, **OPTIONS.get(name, {}),
                     max_steps=group["rollouts"] * group["ppo_epochs"],  # num_mini_batches = 1
                     logging_steps=group["ppo_epochs"])  # once per rollout, as TRL
    dataset = Dataset.from_dict({key: [row[key] for row in prompts] for key in ("prompt", "input_ids")})
    peft_config = lora() if GROUPS[name] == "memory" else None
    trainer = PPOTrainer(policy, reward, args=args, train_dataset=dataset, processing_class=tokenizer,
                         value_model=value, reward_processing_class=tokenizer, peft_config=peft_config)
    module, source = trainer.model, trainer.reward_source
    models = {"policy": module.policy, "reference": trainer.ref_model, "value": module.value_model,
              "value_head": module.value_head, "reward": getattr(source, "model", None),
              "reward_head": getattr(source, "head", None)}
    models = {role: model for role, model in models.items() if model is not None}
    timer.install({role: backbone(model) for role, model in models.items() if "head" not in role})
    trainer.reward_source = timer.timed("forward/reward/no_grad", source)  # compute_rewards reads it per rollout
    return trainer, models


def worker(name: str, settings: dict, threads: int, model_dir: str) -> dict:
    import contextlib
    import gc
    import importlib.util

    import peft  # noqa: F401
    import psutil
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if name.startswith("trl"):
        import trl
        import trl.experimental.ppo  # noqa: F401

        assert trl.__version__ == TRL_VERSION, f"the TRL worker imported trl {trl.__version__} from {trl.__file__}"
    else:
        import hf_rlhf.trainers.ppo_trainer  # noqa: F401
    if importlib.util.find_spec("deepspeed"):  # accelerate imports it on the first unwrap_model, inside train()
        import deepspeed  # noqa: F401

    torch.set_num_threads(threads)
    rss_import = peak_rss_mb()
    group = settings[GROUPS[name]]
    prompts = json.loads(Path(model_dir, "prompts.json").read_text())
    timer, steps = PhaseTimer(), []
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON
        build = build_trl if name.startswith("trl") else build_hf_rlhf
        trainer, models = build(name, model_dir, prompts, group, tmp, timer)
        register_optimizer_step_post_hook(lambda *a: steps.append(1))
        rss_before_train, peak_before_train = psutil.Process().memory_info().rss / MB, peak_rss_mb()
        python_objects = len(gc.get_objects())  # what each gc.collect() walks
        load_before = os.getloadavg()[0]
        cpu_start, start = time.process_time(), time.perf_counter()
        trainer.train()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = peak_rss_mb()
    return {
        "config": name,
        "group": GROUPS[name],
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "episodes": timer.rows,
        "episodes_per_s": timer.rows / seconds,
        "episodes_per_s_without_gc": timer.rows / (seconds - timer.seconds.get("gc", 0.0)),
        "episodes_per_cpu_s": timer.rows / cpu_seconds,
        "optimizer_steps": len(steps),
        "peak_rss_mb": peak,
        "rss_after_import_mb": rss_import,
        "rss_before_train_mb": rss_before_train,
        "peak_before_train_mb": peak_before_train,
        "python_objects": python_objects,
        "peak_increase_mb": peak - rss_import,
        "memory": memory_report(models, trainer.optimizer),
        "phases": timer.report(seconds),
        "trl_version": sys.modules["trl"].__version__,
        "bf16": any(p.dtype != torch.float32 for m in models.values() for p in m.parameters()),
        "activation_checkpointing": bool(getattr(backbone(models["policy"]), "gradient_checkpointing", False)),
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


# ----------------------------------------------------------------------------------------------- parent side
def build_model(kind: str, tokenizer, shape: dict, seed: int):
    """A seeded fp32 toy Llama of `shape`: a causal LM (`policy`) or a one-label sequence classifier (`reward`)."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from hf_rlhf.toy import toy_model_config

    config = toy_model_config(tokenizer, "tiny")
    for key, value in shape.items():
        setattr(config, key, value)
    config.num_key_value_heads = config.num_attention_heads
    config.head_dim = config.hidden_size // config.num_attention_heads  # else the toy config's stays
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (LlamaForCausalLM if kind == "policy" else LlamaForSequenceClassification)(config).float()
    if kind == "policy":
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def prepare_models(settings: dict, configs: list[str], root: str) -> dict[str, str]:
    """Per group, saved once: tokenizer, policy, reward model, its LoRA adapter, prompts.

    The reward model is the policy's base + a seeded LoRA reward adapter (all linears, and a score head): saved as
    the adapter alone (`reward_adapter/`, what `RewardTrainer` saves, for the one-base configurations) and merged
    into a full sequence classifier (`reward/`, for every other configuration, and the value model's init), so
    every configuration scores with the same reward function.
    """
    import torch
    from peft import get_peft_model

    from hf_rlhf.toy import build_toy_tokenizer, prompt_dataset

    dirs = {}
    for name in sorted({GROUPS[c] for c in configs}):
        group, path = settings[name], os.path.join(root, name)
        tokenizer = build_toy_tokenizer(f"{path}/tokenizer")
        policy = build_model("policy", tokenizer, group["model"], seed=0)
        policy.save_pretrained(f"{path}/policy")
        group["params_per_model"] = sum(p.numel() for p in policy.parameters())
        reward = build_model("reward", tokenizer, group["model"], seed=1)
        reward.model.load_state_dict(policy.model.state_dict())  # the same base; the score head stays seeded
        reward.name_or_path = reward.config._name_or_path = f"{path}/policy"  # the adapter's base, as recorded
        reward = get_peft_model(reward, lora("SEQ_CLS"))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(2)
            for param_name, param in reward.named_parameters():
                if "lora_B" in param_name:  # peft starts B at 0: an adapter that changes nothing
                    param.normal_(0.0, 0.02)
        reward.save_pretrained(f"{path}/reward_adapter")
        probe = tokenizer(["12+3=45", "sort abc=abc"], return_tensors="pt", padding=True)
        with torch.no_grad():
            adapter_scores = reward(**probe).logits
            merged = reward.merge_and_unload()
            torch.testing.assert_close(merged(**probe).logits, adapter_scores, rtol=1e-4, atol=1e-4)
        merged.save_pretrained(f"{path}/reward")
        # one rollout of prompts more than used: on the last batch of TRL's prepared dataloader accelerate flags
        # "end of dataloader" and steps the optimizer at every micro-batch of that rollout (not the same work)
        rows = prompt_dataset((group["rollouts"] + 1) * rollout_size(group), seed=0)
        prompts = [{"prompt": p, "input_ids": tokenizer(p)["input_ids"]} for p in rows["prompt"]]
        Path(path, "prompts.json").write_text(json.dumps(prompts))
        dirs[name] = path
    return dirs


def trl_side_install() -> str:
    """The directory holding trl==TRL_VERSION, pip-installed there (no dependencies) if it is missing."""
    import shutil

    cache = os.environ.get("HF_RLHF_BENCH_CACHE", os.path.expanduser("~/.cache/hf_rlhf/bench"))
    target = os.path.join(cache, f"trl-{TRL_VERSION}")
    if not os.path.isfile(os.path.join(target, "trl", "experimental", "ppo", "ppo_trainer.py")):
        print(f"installing trl=={TRL_VERSION} into {target} (once)", flush=True)
        os.makedirs(cache, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f"trl-{TRL_VERSION}-", dir=cache)  # same filesystem: the rename is atomic
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", staging,
                        f"trl=={TRL_VERSION}"], check=True)
        shutil.rmtree(target, ignore_errors=True)  # an interrupted install
        os.replace(staging, target)
    return target


def run_worker(name: str, cli: argparse.Namespace, model_dir: str, trl_dir: str | None) -> dict:
    # TRL 1.12 first on the path for TRL's runs: `import trl` must give it, not the installed TRL
    return harness.run_worker(__file__, ["--worker", name, "--threads", str(cli.threads), "--model-dir", model_dir]
                              + (["--quick"] if cli.quick else []),
                              extra_pythonpath=trl_dir if name.startswith("trl") else None)


def check_same_work(runs: list[dict], settings: dict) -> None:
    """Within a group every run rolled out the same episodes and made the same optimizer steps, fp32, no AC."""
    for group_name in {run["group"] for run in runs}:
        group = settings[group_name]
        expected = (group["rollouts"] * rollout_size(group), group["rollouts"] * group["ppo_epochs"])
        for run in (r for r in runs if r["group"] == group_name):
            if (run["episodes"], run["optimizer_steps"]) != expected:
                raise AssertionError(f"{run['config']} did other work: {run['episodes']} episodes, "
                                     f"{run['optimizer_steps']} optimizer steps; expected {expected}")
    for run in runs:
        if run["bf16"] or run["activation_checkpointing"]:
            raise AssertionError(f"{run['config']} used bf16 or activation checkpointing")
        want = TRL_VERSION if run["config"].startswith("trl") else None
        if want and run["trl_version"] != want:
            raise AssertionError(f"{run['config']} ran trl {run['trl_version']}")


METRICS = ("episodes_per_s", "peak_rss_mb", "peak_increase_mb", "episodes_per_s_without_gc", "episodes_per_cpu_s")


def summarize(runs: list[dict], configs: list[str], repeats: int) -> dict:
    by = {(run["round"], run["config"]): run for run in runs}
    summary = {}
    for name in configs:
        entry = {"group": GROUPS[name]}
        for metric in METRICS:
            values = [by[r, name][metric] for r in range(repeats)]
            entry[metric] = values
            entry[f"median_{metric}"] = statistics.median(values)
        ref = REFERENCE[GROUPS[name]]
        if ref in configs:
            for metric in METRICS:
                ratios = [by[r, name][metric] / by[r, ref][metric] for r in range(repeats)]
                entry[f"ratios_{metric}"] = ratios
                entry[f"median_ratio_{metric}"] = statistics.median(ratios)
        summary[name] = entry
    return summary


def markdown_table(summary: dict) -> str:
    lines = ["| config | group | median episodes/s | median peak RSS MB | median peak increase MB "
             "| episodes/s vs TRL | peak RSS vs TRL | peak increase vs TRL |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in summary.items():
        def ratio(m, e=e):
            return f"{e[f'median_ratio_{m}']:.2f}×" if f"median_ratio_{m}" in e else "–"

        lines.append(f"| {name} | {e['group']} | {e['median_episodes_per_s']:.2f} | {e['median_peak_rss_mb']:,.0f} "
                     f"| {e['median_peak_increase_mb']:,.0f} | {ratio('episodes_per_s')} | {ratio('peak_rss_mb')} "
                     f"| {ratio('peak_increase_mb')} |")
    return "\n".join(lines)


def phase_table(runs: list[dict], configs: list[str]) -> str:
    """Median seconds per phase of `train()`, per configuration (the phases of PhaseTimer)."""
    phases = sorted({p for run in runs for p in run["phases"]["seconds"]})
    lines = ["| config | " + " | ".join(phases) + " | total |", "|---|" + "---:|" * (len(phases) + 1)]
    for name in configs:
        mine = [run for run in runs if run["config"] == name]
        def cell(p, mine=mine):
            return statistics.median(run["phases"]["seconds"].get(p, 0.0) for run in mine)

        lines.append(f"| {name} | " + " | ".join(f"{cell(p):.2f}" for p in phases)
                     + f" | {statistics.median(run['seconds'] for run in mine):.2f} |")
    return "\n".join(lines)


def memory_table(runs: list[dict], configs: list[str]) -> str:
    """Median MB of what each configuration holds, and whether its peak came in setup or in `train()`."""
    lines = ["| config | weights MB | trainable MB | optimizer state MB | after imports MB | peak before train() MB "
             "| peak MB | Python objects |", "|---|" + "---:|" * 7]
    for name in configs:
        mine = [run for run in runs if run["config"] == name]
        weights = statistics.median(sum(v for k, v in run["memory"].items() if k.startswith("weights/"))
                                    for run in mine)
        cells = [weights] + [statistics.median(get(run) for run in mine) for get in (
            lambda r: r["memory"]["trainable"], lambda r: r["memory"]["optimizer_state"],
            lambda r: r["rss_after_import_mb"], lambda r: r["peak_before_train_mb"], lambda r: r["peak_rss_mb"],
            lambda r: r["python_objects"])]
        lines.append(f"| {name} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    return "\n".join(lines)


def notes_for(runs: list[dict], summary: dict, settings: dict, repeats: int) -> list[str]:
    notes = [f"{name} group: Llama {g['model']}, {g['params_per_model'] / 1e6:.1f}M parameters per model; rollouts "
             f"of {rollout_size(g)} prompts (micro-batch {g['micro']} x {g['grad_accum']} accumulation, 1 "
             f"mini-batch), {g['ppo_epochs']} PPO epochs, response_length {g['response_length']}, {g['rollouts']} "
             f"rollouts = {g['rollouts'] * rollout_size(g)} episodes and {g['rollouts'] * g['ppo_epochs']} optimizer "
             "steps." for name, g in settings.items() if "params_per_model" in g]
    notes += [
        f"Both: temperature {COMMON['temperature']}, kl_coef {COMMON['kl_coef']}, vf_coef {COMMON['vf_coef']}, "
        f"AdamW lr {COMMON['learning_rate']} constant, LoRA r={COMMON['lora_r']} alpha={COMMON['lora_alpha']} "
        f"all-linear, fp32, no activation checkpointing, {runs[0]['threads']} torch thread(s); value model init = "
        "the reward model.",
        f"Medians of {repeats} interleaved rounds; ratios are medians of per-round ratios. Shared machine: load "
        f"average {min(r['load_before'] for r in runs):.1f}–{max(r['load_before'] for r in runs):.1f} on "
        f"{os.cpu_count()} cores.",
    ]
    for name, e in summary.items():
        ref = REFERENCE[e["group"]]
        if "ratios_episodes_per_s" in e and name != ref:
            def per_round(m, e=e):
                return ", ".join(f"{x:.2f}" for x in e[f"ratios_{m}"])

            notes.append(f"{name} / {ref}: episodes/s {per_round('episodes_per_s')} (per round); per CPU-second "
                         f"{e['median_ratio_episodes_per_cpu_s']:.2f}×; with every explicit gc.collect() taken out "
                         f"of both {e['median_ratio_episodes_per_s_without_gc']:.2f}×; peak RSS "
                         f"{per_round('peak_rss_mb')}.")
    return notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, few episodes, four configurations: a smoke run")
    parser.add_argument("--output", default="bench/results/ppo.json", help="JSON results path")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in every run (default 1: on a shared 2-core machine, 2 threads wait on "
                             "each other whenever one is descheduled)")
    parser.add_argument("--configs", help=f"comma-separated, from {DEFAULT_CONFIGS + EXTRA_CONFIGS} (default: "
                                          f"{','.join(DEFAULT_CONFIGS)}; with --quick {','.join(QUICK_CONFIGS)})")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    settings = PRESETS["quick" if cli.quick else "full"]

    if cli.worker:
        print(json.dumps(worker(cli.worker, settings, cli.threads, cli.model_dir)))
        return

    chosen = cli.configs or ",".join(QUICK_CONFIGS if cli.quick else DEFAULT_CONFIGS)
    configs = [c.strip() for c in chosen.split(",") if c.strip()]
    unknown = set(configs) - set(GROUPS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}")
    command = " ".join(["python bench/ppo.py", *(argv if argv is not None else sys.argv[1:])])
    trl_dir = trl_side_install() if any(c.startswith("trl") for c in configs) else None
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-ppo-") as root:
        dirs = prepare_models(settings, configs, root)
        for r in range(cli.repeats):
            for name in configs:
                run = {"round": r, **run_worker(name, cli, dirs[GROUPS[name]], trl_dir)}
                runs.append(run)
                print(f"round {r + 1}/{cli.repeats} {name:>30}: {run['episodes_per_s']:6.2f} episodes/s "
                      f"({run['episodes']} episodes, {run['optimizer_steps']} steps, {run['seconds']:.1f} s, "
                      f"cpu {run['cpu_seconds']:.1f} s), peak RSS {run['peak_rss_mb']:,.0f} MB "
                      f"(+{run['peak_increase_mb']:,.0f}), load {run['load_before']:.1f}", flush=True)
    check_same_work(runs, settings)
    summary = summarize(runs, configs, cli.repeats)
    tables = {"table": markdown_table(summary), "phase_table": phase_table(runs, configs),
              "memory_table": memory_table(runs, configs)}
    notes = notes_for(runs, summary, settings, cli.repeats)
    harness.finish(cli.output, command, {"settings": settings, "common": COMMON, "configs": configs,
                                         "summary": summary, **tables, "notes": notes, "runs": runs},
                   ("torch", "transformers", "trl", "accelerate", "peft", "datasets"),
                   sections={"Median seconds of `train()` by phase": tables["phase_table"],
                             "Memory (median MB)": tables["memory_table"]},
                   trl_baseline=TRL_VERSION)


if __name__ == "__main__":
    main()
