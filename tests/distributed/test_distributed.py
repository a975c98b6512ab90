"""Two processes on CPU (gloo) under DDP, DeepSpeed ZeRO-2 and ZeRO-3, through `accelerate launch` and the configs in
`recipes/accelerate/`: each trainer's per-step losses equal a single-process run on the same global batch, the saved
outputs reload in one process, and per-rank state (KL coefficient, files) is what it must be.

Each engine's runs are one `tests/distributed/worker.py` launch in a subprocess, its tasks one after another in the
same processes (`LAUNCHES`; the worker's docstring): a launch's start is paid once per engine, not once per task (the
module took ~5 min instead of ~20 on 2 cores; a task's losses are bit-identical to a launch of that task alone). The
single-process reference is the same worker run with plain `python`, without DeepSpeed. Tolerance 1e-4 on the
losses, and on logits of the reloaded models: the runs are deterministic (fp32, no dropout, fixed seeds, greedy PPO
rollouts), and the only difference left is the order of floating-point sums (gradients all-reduced over 2 ranks,
each rank's micro-batches padded to its own longest row); the differences measured are ~5e-7.

DeepSpeed JIT-compiles its CPU Adam once (30-80 s) into $TORCH_EXTENSIONS_DIR, which is kept as set (CI sets
~/.cache/hf_rlhf/torch_extensions, and it defaults to that here too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# every test launches 2 processes; the first test of an engine waits for all of that engine's tasks (LAUNCHES)
pytestmark = [pytest.mark.distributed, pytest.mark.integration, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
CONFIGS = ROOT / "recipes" / "accelerate"
STEPS, GLOBAL_BATCH, TOLERANCE = 4, 8, 1e-4
ENGINES = ("ddp", "deepspeed_zero2", "deepspeed_zero3")
TASKS = ("sft", "sft_lora", "reward", "dpo", "ppo", "grpo", "rloo", "reinforce_pp")
PPO_TASKS = ("ppo", "grpo", "rloo", "reinforce_pp")  # PPOTrainer with each advantage estimator (worker.ESTIMATORS)


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # ImportError, or a broken install (e.g. no compiler)
        return False
    return True


needs_deepspeed = pytest.mark.skipif(not _has_deepspeed(), reason="deepspeed is not importable: "
                                     "pip install 'hf-rlhf[deepspeed]' to run the ZeRO tests")


def engine_param(engine: str):
    return pytest.param(engine, marks=needs_deepspeed) if engine.startswith("deepspeed") else engine


def launch_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # this checkout first
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/hf_rlhf/torch_extensions"))  # CI's cache
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def run(cmd: list[str], out: Path, timeout: int = 600) -> float:
    """Run `cmd`, fail with the end of its log; return the wall time in seconds."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    wall = time.perf_counter() - start
    (out / "log.txt").write_text(proc.stdout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    return wall


def free_port() -> int:
    """A free TCP port for the rendezvous (other jobs on the machine may hold accelerate's default 29500)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_cmd(engine: str | None, *worker_args: str) -> list[str]:
    """`accelerate launch` on 2 processes with a recipes/accelerate config, CPU overrides; None: plain python."""
    if engine is None:
        return [sys.executable, str(WORKER), *worker_args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{engine}.yaml"),
            "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()), str(WORKER),
            *worker_args]


# what each launch trains: worker.py runs a launch's tasks in turn in one pair of processes (one process for the
# single-process references, engine None), so a launch's start (~20 s of imports and set-up) is paid once per engine
LAUNCHES = {
    None: (*TASKS, "dpo_lora", "grpo_tools", "rloo_trainer"),
    "ddp": (*TASKS, "dpo_lora", "grpo_dynamic", "grpo_tools", "rloo_trainer"),
    "deepspeed_zero2": TASKS,
    "deepspeed_zero3": (*TASKS, "dpo_lora", "grpo_dynamic", "grpo_tools", "ppo@lean"),
}


class Runs:
    """Launch each engine's tasks (`LAUNCHES`) once per session; engine None is the single-process reference."""

    def __init__(self, root: Path):
        self.root, self.launched, self.done = root, {}, {}

    def get(self, engine: str | None, task: str, backend: str = "generate") -> dict:
        spec = task if backend == "generate" else f"{task}@{backend}"
        assert spec in LAUNCHES[engine], f"{spec} is not in LAUNCHES[{engine!r}]"
        if engine not in self.launched:
            self.launched[engine] = self.launch(engine)
        key = (engine, spec)
        if key not in self.done:
            out = self.root / (engine or "single") / spec
            if not (out / "rank0.json").is_file():  # the launch stopped before this task ended (written last)
                pytest.fail(f"{spec} under {engine or 'one process'} did not finish:\n{self.launched[engine]}")
            result = {"out": out, **json.loads((out / "losses.json").read_text())}
            result["ranks"] = [json.loads((out / f"rank{r}.json").read_text())
                               for r in range(result["world_size"])]
            self.done[key] = result
        return self.done[key]

    def launch(self, engine: str | None) -> str:
        """Run the engine's tasks; "" when every task ended, else the end of the launch's log."""
        out = self.root / (engine or "single")
        try:
            run(launch_cmd(engine, "--task", ",".join(LAUNCHES[engine]), "--out", str(out), "--steps", str(STEPS),
                           "--global_batch", str(GLOBAL_BATCH), "--policy_path", self.policy_dir()), out, timeout=1500)
        except (AssertionError, subprocess.TimeoutExpired) as failed:  # its tests fail with this; no second launch
            return str(failed)
        return ""

    def policy_dir(self) -> str:
        """The toy policy saved once: PPO loads it by path, so ZeRO-3 shards it while loading (zero.Init)."""
        path = self.root / "policy"
        if not (path / "config.json").is_file():
            from hf_rlhf.toy import build_toy_model

            tokenizer = _tokenizer()
            build_toy_model(tokenizer, "tiny", seed=0).save_pretrained(path)
            tokenizer.save_pretrained(path)
        return str(path)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("distributed"))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


# ---------------------------------------------------------------------------------------------------
# reloading what a run saved, in this process


def _tokenizer():
    from hf_rlhf.toy import build_toy_tokenizer

    return build_toy_tokenizer()


def _inputs(tokenizer):
    batch = tokenizer(["1+2=3", "abc reversed is cba", "7*8="], padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


@torch.no_grad()
def reloaded_outputs(task: str, out: Path) -> torch.Tensor:
    """Logits (or rewards) of the model saved in `out`, reloaded in this process from the saved files alone."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_rlhf.toy import build_toy_model, build_toy_reward_model

    tokenizer = _tokenizer()
    ids, mask = _inputs(tokenizer)
    if task in ("sft", "dpo", "kto", "distill", *PPO_TASKS):
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        logits = model(input_ids=ids, attention_mask=mask).logits
        if task not in ("sft", "dpo", "kto", "ppo"):  # critic-free: no value function saved
            assert not (out / "value").exists()
        if task == "ppo":  # the value head beside it, a (1, hidden) linear
            head = load_file(out / "value" / "value_head.safetensors")
            assert {k: v.shape for k, v in head.items()}["weight"] == (1, model.config.hidden_size)
            logits = torch.cat([logits.flatten(), head["weight"].flatten()])
        return logits
    if task in ("sft_lora", "dpo_lora"):
        model = PeftModel.from_pretrained(build_toy_model(tokenizer, "tiny", seed=0), out).eval()
        return model(input_ids=ids, attention_mask=mask).logits
    # reward: the LoRA adapter with its trained score head (modules_to_save)
    model = PeftModel.from_pretrained(build_toy_reward_model(tokenizer, "tiny", seed=0), out).eval()
    base_rewards = build_toy_reward_model(tokenizer, "tiny", seed=0).eval()(input_ids=ids, attention_mask=mask).logits
    rewards = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(rewards, base_rewards, atol=1e-4), "the reloaded reward adapter / head is untrained"
    return rewards


# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("engine", [engine_param(e) for e in ENGINES])
def test_two_processes_match_one(runs, engine, task):
    """2 ranks x (global batch / 2) rows give the single-process run's losses, and the saved model reloads to it."""
    single, multi = runs.get(None, task), runs.get(engine, task)
    assert multi["world_size"] == 2 and single["world_size"] == 1
    assert len(multi["loss"]) == len(single["loss"]) == STEPS
    diff = max(abs(a - b) for a, b in zip(multi["loss"], single["loss"]))
    print(f"\n[matrix] {task} x {engine}: pass, {multi['wall_s']:.1f} s, max |loss diff| {diff:.2e}")
    assert diff <= TOLERANCE, (multi["loss"], single["loss"])
    if task in PPO_TASKS:
        # one on-policy step per rollout: zero-mean advantages (RLOO, whitened) give a loss of 0 at ratio 1 however
        # the policy moves, so the gradients must agree too, and be real
        norms = [[h["grad_norm"] for h in run["log_history"] if "grad_norm" in h] for run in (multi, single)]
        assert len(norms[0]) == STEPS and norms[0] == pytest.approx(norms[1], rel=1e-3), norms
        assert min(norms[1]) > 1e-3, norms
    if task not in ("rloo", "reinforce_pp"):
        assert single["loss"][-1] != single["loss"][0]  # it trained

    # saved by rank 0 with the weights gathered (ZeRO-3), reloaded here: the single-process run's model. (rtol: with
    # prefix_sharing each rank lays out its own rows' prompts, the single process all of them, so the float rounding
    # differs; greedy groups whose first tokens agree have zero-mean advantages that cancel a gradient exactly, and
    # Adam turns the rounding left of it into a step: 1.1e-4 on a logit of 0.12 after 4 steps, on every engine)
    torch.testing.assert_close(reloaded_outputs(task, multi["out"] / "out"),
                               reloaded_outputs(task, single["out"] / "out"), atol=TOLERANCE, rtol=2e-3)


@pytest.mark.slow  # its own launches (~1 min each on 2 cores), outside LAUNCHES: `-m slow` runs it
@pytest.mark.parametrize("engine", [engine_param(e) for e in ("ddp", "deepspeed_zero3")])
def test_kto_two_processes_match_one(tmp_path, engine):
    """KTO with 2 ranks x 4 rows gives the single process's losses on 8 rows (its KL reference point z0 is the mean
    of the ranks' own, gathered as TRL does), and the saved model reloads to the single process's."""
    results = {}
    for launch in (None, engine):
        out = tmp_path / (launch or "single")
        run(launch_cmd(launch, "--task", "kto", "--out", str(out), "--steps", str(STEPS), "--global_batch",
                       str(GLOBAL_BATCH)), out)
        results[launch] = json.loads((out / "kto" / "losses.json").read_text())
    single, multi = results[None], results[engine]
    assert multi["world_size"] == 2 and single["world_size"] == 1 and len(single["loss"]) == STEPS
    diff = max(abs(a - b) for a, b in zip(multi["loss"], single["loss"]))
    kls = [[h["kl"] for h in r["log_history"] if "kl" in h] for r in (single, multi)]
    print(f"\n[matrix] kto x {engine}: max |loss diff| {diff:.2e}; kl single {kls[0]}, {engine} {kls[1]}")
    assert diff <= TOLERANCE, (multi["loss"], single["loss"])
    assert kls[0] == pytest.approx(kls[1], abs=TOLERANCE) and max(kls[0]) > 0  # z0 estimated, and the same
    assert single["loss"][-1] != single["loss"][0]
    torch.testing.assert_close(reloaded_outputs("kto", tmp_path / engine / "kto" / "out"),
                               reloaded_outputs("kto", tmp_path / "single" / "kto" / "out"), atol=TOLERANCE, rtol=0)


def test_rloo_trainer_two_processes_match_one(runs):
    """hf_rlhf.RLOOTrainer (TRL's RLOO math: k1 in the reward, summed sequence ratio, batch-whitened advantages) on 2
    DDP ranks gives the single process's losses and gradient norms."""
    single, multi = runs.get(None, "rloo_trainer"), runs.get("ddp", "rloo_trainer")
    assert multi["world_size"] == 2 and len(multi["loss"]) == len(single["loss"]) == STEPS
    assert max(abs(a - b) for a, b in zip(multi["loss"], single["loss"])) <= TOLERANCE
    norms = [[h["grad_norm"] for h in run["log_history"] if "grad_norm" in h] for run in (multi, single)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-3) and min(norms[1]) > 1e-3, norms
    kl = [[h["kl"] for h in run["log_history"] if "kl" in h] for run in (multi, single)]
    assert kl[0] == pytest.approx(kl[1], abs=TOLERANCE) and max(map(abs, kl[1])) > 0, kl


@pytest.mark.parametrize("engine", [engine_param(e) for e in ("ddp", "deepspeed_zero3")])
def test_dpo_with_lora_two_processes_match_one(runs, engine):
    """DPO of a LoRA policy, whose reference is the same model with its adapters off (under ZeRO-3 a sharded model
    switched off and on inside each step): 2 ranks give the single-process losses and reward margins, only the
    adapter trains, and the saved adapter reloads to the same logits."""
    single, multi = runs.get(None, "dpo_lora"), runs.get(engine, "dpo_lora")
    assert multi["world_size"] == 2 and len(multi["loss"]) == len(single["loss"]) == STEPS
    diff = max(abs(a - b) for a, b in zip(multi["loss"], single["loss"]))
    assert diff <= TOLERANCE, (multi["loss"], single["loss"])
    margins = [[h["rewards/margins"] for h in run["log_history"] if "rewards/margins" in h] for run in (multi, single)]
    assert len(margins[1]) == STEPS and margins[0] == pytest.approx(margins[1], abs=TOLERANCE), margins
    assert single["loss"][-1] < single["loss"][0]  # it trained (the first step's loss is log 2 at ref = policy)
    assert (multi["out"] / "out" / "adapter_model.safetensors").is_file()
    assert not (multi["out"] / "out" / "model.safetensors").exists()  # the adapter alone, not a merged copy
    torch.testing.assert_close(reloaded_outputs("dpo_lora", multi["out"] / "out"),
                               reloaded_outputs("dpo_lora", single["out"] / "out"), atol=TOLERANCE, rtol=0)


@needs_deepspeed
def test_lean_generation_under_zero3_matches_one_process_with_generate(runs):
    """generation_backend="lean" on 2 ZeRO-3 ranks (greedy rollouts whose rows stop at eos at different steps, so a
    rank that has finished keeps stepping with the other, as generate's synced_gpus) trains as one process with
    `generate` does."""
    single, multi = runs.get(None, "ppo"), runs.get("deepspeed_zero3", "ppo", backend="lean")
    assert multi["world_size"] == 2 and len(multi["loss"]) == STEPS
    diff = max(abs(a - b) for a, b in zip(multi["loss"], single["loss"]))
    assert diff <= TOLERANCE, (multi["loss"], single["loss"])
    norms = [[h["grad_norm"] for h in run["log_history"] if "grad_norm" in h] for run in (multi, single)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-3), norms


@pytest.mark.parametrize("engine", [engine_param(e) for e in ("ddp", "deepspeed_zero3")])
def test_dynamic_sampling_runs_the_same_rounds_on_every_rank(runs, engine):
    """filter_groups: each rank drops its own groups, but every rank runs as many generation rounds as the rank that
    needs the most (a ZeRO-3 generation gathers parameters collectively: unequal rounds would hang)."""
    multi = runs.get(engine, "grpo_dynamic")
    calls = [rank["generate_calls"] for rank in multi["ranks"]]
    logs = [h for h in multi["log_history"] if "filter/gen_batches" in h]
    # one rollout per optimizer step, one log per step carrying its rollout's rounds; some rollouts refilled
    assert calls[0] == calls[1] == sum(h["filter/gen_batches"] for h in logs) > STEPS
    assert sum(h["filter/dropped_groups"] for h in logs) > 0
    assert all(1 <= h["filter/gen_batches"] <= 3 for h in logs)


@pytest.mark.parametrize("engine", [engine_param(e) for e in ("ddp", "deepspeed_zero3")])
def test_grpo_with_tools_two_processes_match_one(runs, engine):
    """hf_rlhf.GRPOTrainer with a tool (worker `grpo_tools`: every first turn calls `add`, its result is appended,
    the model answers; β > 0, so the reference runs on the multi-turn rows): 2 ranks give the single-process run's
    losses and gradient norms, and every completion called the tool."""
    single, multi = runs.get(None, "grpo_tools"), runs.get(engine, "grpo_tools")
    assert multi["world_size"] == 2 and len(multi["loss"]) == len(single["loss"]) == STEPS
    diff = max(abs(a - b) for a, b in zip(multi["loss"], single["loss"]))
    print(f"\n[matrix] grpo_tools x {engine}: {multi['wall_s']:.1f} s, max |loss diff| {diff:.2e}")
    assert diff <= TOLERANCE, (multi["loss"], single["loss"])
    logs = [[h for h in run["log_history"] if "loss" in h] for run in (multi, single)]
    assert [h["grad_norm"] for h in logs[0]] == pytest.approx([h["grad_norm"] for h in logs[1]], rel=1e-3)
    assert min(h["grad_norm"] for h in logs[1]) > 1e-3
    for name in ("tools/call_frequency", "reward", "reward_std", "completions/mean_length", "num_tokens", "kl"):
        assert [h[name] for h in logs[0]] == pytest.approx([h[name] for h in logs[1]], rel=1e-4, abs=1e-6), name
    assert all(h["tools/call_frequency"] == 1.0 and h["tools/failure_frequency"] == 0.0 for h in logs[1])
    torch.testing.assert_close(reloaded_outputs("grpo", multi["out"] / "out"),
                               reloaded_outputs("grpo", single["out"] / "out"), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("engine", [engine_param(e) for e in ENGINES])
def test_kl_coefficient_equal_on_all_ranks(runs, engine):
    """The adaptive controller sees the KL averaged over ranks: after 4 rollouts every rank holds the same β, and it is
    the single-process run's β (ranks see different prompts, so a per-rank KL would give different coefficients)."""
    multi, single = runs.get(engine, "ppo"), runs.get(None, "ppo")
    coefs = [rank["kl_coef"] for rank in multi["ranks"]]
    assert coefs[0] != 0.05, "the controller never moved: the test would not see a per-rank KL"
    assert coefs[0] == coefs[1], coefs
    assert coefs[0] == pytest.approx(single["ranks"][0]["kl_coef"], rel=1e-5)
    logged = [h["objective/kl_coef"] for h in multi["log_history"] if "objective/kl_coef" in h]
    assert logged == pytest.approx([h["objective/kl_coef"] for h in single["log_history"] if "objective/kl_coef" in h],
                                   rel=1e-5)


@pytest.mark.parametrize("engine", [engine_param(e) for e in ENGINES])
def test_only_rank0_writes_files(runs, engine):
    """Plots, sample completions, the trainer state and the model are written by rank 0 alone, once."""
    multi = runs.get(engine, "ppo")
    rank0, rank1 = (set(rank["writes"]) for rank in multi["ranks"])
    assert {"out/ppo_curves.png", "out/completions.jsonl", "out/trainer_state.json", "out/config.json"} <= rank0
    assert not rank1, f"rank 1 wrote {sorted(rank1)}"
    rows = (multi["out"] / "out" / "completions.jsonl").read_text().splitlines()
    assert len(rows) == 2 * 2  # 2 prompts at the start and at the end, not once per rank


def _toy_model_dir(path: Path) -> Path:
    """A tiny toy causal LM and its tokenizer saved at `path` (what a recipe loads as its SFT model)."""
    from hf_rlhf.toy import build_toy_model

    tokenizer = _tokenizer()
    build_toy_model(tokenizer, "tiny", seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_ppo_recipe_writes_results_once(runs, tmp_path):
    """recipes/ppo.py on 2 DDP ranks: results.json and the plot come from rank 0 only; the others write nothing."""
    sft_dir = _toy_model_dir(tmp_path / "sft")
    out = tmp_path / "run"
    run(launch_cmd("ddp", "--recipe", "ppo", "--out", str(out), "--output_dir", str(out / "ppo"),
                   "--sft_model_path", str(sft_dir), "--reward_source", "function", "--toy_train_size", "32",
                   "--toy_test_size", "8", "--max_steps", "2", "--per_device_train_batch_size", "4",
                   "--gradient_accumulation_steps", "1",
                   "--rollout_batch_size", "4", "--num_ppo_epochs", "1", "--logging_steps", "1",
                   "--per_device_eval_batch_size", "8", "--sample_prompts", "2"), out)
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert {"ppo/results.json", "ppo/ppo_curves.png", "ppo/completions.jsonl"} <= set(rank0["writes"])
    assert not rank1["writes"], f"rank 1 wrote {rank1['writes']}"
    results = json.loads((out / "ppo" / "results.json").read_text())
    assert results["after"] == rank0["after"] == rank1["after"]  # every rank evaluated the same policy


def test_reward_recipe_trains_under_zero2(tmp_path):
    """recipes/reward.py under ZeRO-2: no evaluate() before train() (it would leave an inference-only DeepSpeed
    engine that training cannot use), the accuracy after training is reported, rank 0 alone writes results.json."""
    base = _toy_model_dir(tmp_path / "sft")
    out = tmp_path / "run"
    run(launch_cmd("deepspeed_zero2", "--recipe", "reward", "--out", str(out), "--output_dir", str(out / "reward"),
                   "--sft_model_path", str(base), "--toy_train_size", "64", "--toy_test_size", "16",
                   "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8",
                   "--reward_stats_num_samples", "16", "--disable_tqdm", "true"), out)
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert "reward/results.json" in rank0["writes"] and not rank1["writes"]
    results = json.loads((out / "reward" / "results.json").read_text())
    assert results["before"] == {} and "DeepSpeed" in results["notes"][0]
    assert 0.0 <= results["after"]["accuracy"] <= 1.0 and results["after"]["loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("engine", [engine_param(e) for e in ("ddp", "deepspeed_zero3")])
def test_distillation_two_processes_match_one(tmp_path, runs, engine):
    """DistillationTrainer (greedy student rollouts, a frozen teacher, the JSD over the step's tokens): 2 ranks x 4
    rows, under DDP and under ZeRO-3 (student and teacher sharded, generation collective), give the single-process
    losses and gradient norms, and the saved student reloads to the same logits. Launched on its own (not in
    `LAUNCHES`), so the other tasks' launches are not paid for it."""
    results = {}
    for launch in (None, engine):
        out = tmp_path / (launch or "single")
        run(launch_cmd(launch, "--task", "distill", "--out", str(out), "--steps", str(STEPS), "--global_batch",
                       str(GLOBAL_BATCH), "--policy_path", runs.policy_dir()), out, timeout=900)
        results[launch] = json.loads((out / "distill" / "losses.json").read_text())
    single, multi = results[None], results[engine]
    assert multi["world_size"] == 2 and len(single["loss"]) == len(multi["loss"]) == STEPS
    assert multi["loss"] == pytest.approx(single["loss"], abs=TOLERANCE) and single["loss"][-1] != single["loss"][0]
    norms = [[h["grad_norm"] for h in r["log_history"] if "grad_norm" in h] for r in (multi, single)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-3) and min(norms[1]) > 0
    torch.testing.assert_close(reloaded_outputs("distill", tmp_path / engine / "distill" / "out"),
                               reloaded_outputs("distill", tmp_path / "single" / "distill" / "out"),
                               atol=TOLERANCE, rtol=2e-3)
