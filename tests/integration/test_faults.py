"""Faults, for SFT, reward, DPO and PPO on the toy world (KTO: the kills): kill -9 at many points inside a checkpoint
save (and between saves) then resume from the latest checkpoint = the uninterrupted run, exactly; broken checkpoints
of an older in-place writer are skipped by name; an injected NaN loss at a save step stops (nothing saved from that
step on) or is skipped (the parameters unchanged by that step); huge finite rewards keep their logged mean finite.

The killed runs are forked from the test process (no re-import of torch), their saves slowed by patching the
writers in the child only, and killed with SIGKILL when the output folder shows the wanted point of the save.
"""

import logging
import math
import multiprocessing
import os
import shutil
import signal
import time

import pytest
import torch
from transformers import TrainerCallback
from transformers.trainer_callback import TrainerState

import hf_rlhf.training.checkpoints as checkpoints
from hf_rlhf import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from hf_rlhf.toy import build_toy_model, build_toy_reward_model, preference_dataset, sft_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer
from hf_rlhf.training.checkpoints import checkpoint_problem, latest_complete_checkpoint
from hf_rlhf.training.nonfinite import NonFiniteError

pytestmark = pytest.mark.integration

SAVE_DELAY = 0.2  # seconds each slowed write of the killed save takes
NOT_COMPARED = {"tokens_per_second", "step_time"}  # wall-clock; SFT's num_tokens is compared


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py); forking is safe with one."""


# ---------------------------------------------------------------------------------------------------
# tiny runs: (trainer factory, max_steps, the save step the kills aim at)


def digit_reward(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def build(kind, output_dir, tokenizer, callbacks=(), trainer_class=None, reward=digit_reward, **kw):
    common = dict(max_steps=8 if kind in ("ppo", "distill") else 6, output_dir=str(output_dir), logging_steps=1,
                  save_strategy="steps", save_steps=2, report_to="none", seed=0, disable_tqdm=True, learning_rate=3e-3)
    common.update(kw)
    if kind == "sft":
        args = SFTConfig(per_device_train_batch_size=8, max_length=48, warmup_steps=0, **common)
        return (trainer_class or SFTTrainer)(build_toy_model(tokenizer, "tiny", seed=0), args=args,
                                             train_dataset=sft_dataset(64, seed=1), processing_class=tokenizer,
                                             callbacks=list(callbacks))
    if kind == "reward":
        args = RewardConfig(per_device_train_batch_size=8, max_length=48, warmup_steps=0, **common)
        return (trainer_class or RewardTrainer)(build_toy_reward_model(tokenizer, seed=0), args=args,
                                                train_dataset=preference_dataset(64, seed=1),
                                                processing_class=tokenizer, callbacks=list(callbacks))
    if kind == "dpo":  # the reference: a frozen copy of the policy, rebuilt identically on resume
        args = DPOConfig(per_device_train_batch_size=8, max_length=48, warmup_steps=0, **common)
        return (trainer_class or DPOTrainer)(build_toy_model(tokenizer, "tiny", seed=0), args=args,
                                             train_dataset=preference_dataset(64, seed=1),
                                             processing_class=tokenizer, callbacks=list(callbacks))
    if kind == "kto":  # the same, on unpaired rows with their mismatched completions (sequential order)
        from hf_rlhf.toy import unpaired_dataset

        args = KTOConfig(per_device_train_batch_size=8, max_length=48, warmup_steps=0, **common)
        return (trainer_class or KTOTrainer)(build_toy_model(tokenizer, "tiny", seed=0), args=args,
                                             train_dataset=unpaired_dataset(32, seed=1),
                                             processing_class=tokenizer, callbacks=list(callbacks))
    from hf_rlhf.toy import prompt_dataset

    if kind == "distill":  # a rollout of 8 rows = 4 optimizer steps of 2; checkpoint-6 cuts a rollout
        from hf_rlhf import DistillationConfig, DistillationTrainer

        args = DistillationConfig(per_device_train_batch_size=2, rollout_batch_size=8, max_completion_length=6,
                                  beta=0.5, **common)
        return (trainer_class or DistillationTrainer)(build_toy_model(tokenizer, seed=0),
                                                      build_toy_model(tokenizer, seed=1), args=args,
                                                      train_dataset=prompt_dataset(16, seed=0),
                                                      processing_class=tokenizer, callbacks=list(callbacks))
    # PPO: a rollout = 2 mini-batches x 2 ppo epochs = 4 optimizer steps; checkpoint-6 cuts a rollout

    common = {"kl_target": 0.5, "kl_horizon": 40, "reward_normalization": "running", **common}
    args = PPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=1, num_mini_batches=2,
                     num_ppo_epochs=2, response_length=6, temperature=1.0, **common)
    return (trainer_class or PPOTrainer)(build_toy_model(tokenizer), reward, args=args,
                                         train_dataset=prompt_dataset(16, seed=0), processing_class=tokenizer,
                                         callbacks=list(callbacks))


TARGET_STEP = {"sft": 4, "reward": 4, "dpo": 4, "kto": 4, "ppo": 6, "distill": 6}


def step_logs(trainer, after=0):
    return {h["step"]: {k: v for k, v in h.items() if k not in NOT_COMPARED}
            for h in trainer.state.log_history if "loss" in h and h["step"] > after}


def max_weight_difference(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def max_log_difference(reference, logs) -> float:
    assert sorted(logs) == sorted(s for s in reference if s in logs) and logs
    return max(abs(reference[s][k] - v) for s in logs for k, v in logs[s].items())


# ---------------------------------------------------------------------------------------------------
# kill -9 inside the save


class _MarkSteps(TrainerCallback):
    """In the killed child: a marker file per finished step; a pause after `slow_step` to be killed in."""

    def __init__(self, output_dir, slow_step):
        self.output_dir, self.slow_step = output_dir, slow_step

    def on_step_end(self, args, state, control, **kwargs):
        open(os.path.join(self.output_dir, f".step-{state.global_step}"), "w").close()
        if state.global_step == self.slow_step:
            time.sleep(2 * SAVE_DELAY)


def _slow_saves(target: str):
    """Patch the writers (in the forked child only) so that the save of `target` takes a while, file by file;
    `torch.save` leaves its file empty while it waits, as a write cut by a kill would."""
    import transformers.modeling_utils as modeling_utils

    save, save_json, fsync_tree = torch.save, TrainerState.save_to_json, checkpoints._fsync_tree
    safe_save = modeling_utils.safe_save_file

    def slow_torch_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and target in str(f):
            open(f, "wb").close()
            time.sleep(SAVE_DELAY)
        return save(obj, f, *args, **kwargs)

    def slow_safe_save(tensors, filename, *args, **kwargs):
        out = safe_save(tensors, filename, *args, **kwargs)
        if target in str(filename):
            time.sleep(SAVE_DELAY)
        return out

    def slow_save_json(self, path):
        save_json(self, path)
        if target in path:
            time.sleep(SAVE_DELAY)

    def slow_fsync_tree(root):
        if target in root:
            time.sleep(SAVE_DELAY)
        fsync_tree(root)

    torch.save, TrainerState.save_to_json, checkpoints._fsync_tree = slow_torch_save, slow_save_json, slow_fsync_tree
    modeling_utils.safe_save_file = slow_safe_save


def _own_progress_bar_lock():
    """tqdm's write lock holds a multiprocessing RLock: a POSIX semaphore shared with the forked child. A child
    killed inside a bar (transformers' "Writing model shards", right before model.safetensors) would leave it taken
    and the parent's next bar (the resume's weight loading) would wait forever: this hung CI for 85 minutes. The
    child gets locks of its own."""
    from tqdm.std import TqdmDefaultWriteLock, tqdm

    TqdmDefaultWriteLock.mp_lock = multiprocessing.get_context("fork").RLock()
    classes = [tqdm]
    while classes:  # every bar class that made its own lock (tqdm.auto's, datasets', transformers' ...)
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if "_lock" in vars(cls) or cls is tqdm:
            cls.set_lock(TqdmDefaultWriteLock())


def _train_in_child(kind, output_dir, tokenizer, target_step):
    _own_progress_bar_lock()
    _slow_saves(f"checkpoint-{target_step}")
    build(kind, output_dir, tokenizer, callbacks=[_MarkSteps(str(output_dir), target_step - 1)]).train()


def kill_points(d, step):
    """(name, predicate on the output folder `d`, the checkpoint a resume must pick): where the kill lands."""
    staged = os.path.join(d, f".tmp-checkpoint-{step}", f"checkpoint-{step}")
    earlier = os.path.join(d, f"checkpoint-{step - 2}")
    return [
        ("between saves", lambda: os.path.exists(os.path.join(d, f".step-{step - 1}")), earlier),
        ("staging folder created", lambda: os.path.isdir(staged), earlier),
        ("optimizer.pt half written (0 bytes)",
         lambda: os.path.isfile(os.path.join(staged, "optimizer.pt"))
         and os.path.getsize(os.path.join(staged, "optimizer.pt")) == 0, earlier),
        ("rng state being written", lambda: os.path.isfile(os.path.join(staged, "rng_state.pth")), earlier),
        ("trainer_state.json written, before the rename",
         lambda: os.path.isfile(os.path.join(staged, "trainer_state.json")), earlier),
        ("just after the rename", lambda: os.path.isdir(os.path.join(d, f"checkpoint-{step}")),
         os.path.join(d, f"checkpoint-{step}")),
    ]


def kill_when(process, predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if not process.is_alive():
            raise AssertionError("the run ended before the kill point was reached")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the kill point was not reached in time")
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    assert process.exitcode == -signal.SIGKILL


def _hold_the_bar_lock_until_killed(held):
    from transformers.utils import logging as hf_logging

    _own_progress_bar_lock()
    hf_logging.tqdm.get_lock().acquire()  # as inside "Writing model shards" when the kill lands
    held.set()  # the parent kills only once the lock is taken
    time.sleep(60)


def test_a_child_killed_inside_a_progress_bar_leaves_the_parents_bars_working():
    """The regression behind an 85-minute CI hang: with the child's own bar locks the parent's next bar runs."""
    import threading

    from datasets.utils import tqdm as datasets_tqdm
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    list(tqdm(range(1)))  # the parent has made its locks before the fork, as a test session has
    fork = multiprocessing.get_context("fork")
    held = fork.Event()
    child = fork.Process(target=_hold_the_bar_lock_until_killed, args=(held,))
    child.start()
    if not held.wait(timeout=120):  # a handshake, not a sleep: killed before taking the lock, it would prove nothing
        child.kill()
        raise AssertionError("the child did not take the progress-bar lock within 120 s")
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    bars = threading.Thread(target=lambda: [list(bar(range(1))) for bar in (tqdm, hf_logging.tqdm, datasets_tqdm)],
                            daemon=True)
    bars.start()
    bars.join(timeout=20)
    assert not bars.is_alive(), "the parent's progress bar waits for a lock the killed child held"


@pytest.mark.parametrize("kind", ["sft", "reward", "dpo", "kto", "ppo", "distill"])
def test_kill_inside_and_between_saves_then_resume_is_exact(tmp_path, tokenizer, kind, caplog):
    full = build(kind, tmp_path / "full", tokenizer)
    full.train()
    reference = step_logs(full)
    step = TARGET_STEP[kind]
    fork = multiprocessing.get_context("fork")
    for i, (point, _, _) in enumerate(kill_points("", step)):
        run_dir = str(tmp_path / f"killed-{i}")
        os.makedirs(run_dir)
        name, predicate, expected = kill_points(run_dir, step)[i]
        child = fork.Process(target=_train_in_child, args=(kind, run_dir, tokenizer, step))
        child.start()
        kill_when(child, predicate)
        if expected.endswith(f"checkpoint-{step - 2}"):  # atomic: the cut save left no checkpoint-N folder
            assert not os.path.exists(os.path.join(run_dir, f"checkpoint-{step}")), point
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
            assert latest_complete_checkpoint(run_dir) == expected, point
            resumed = build(kind, run_dir, tokenizer)
            resumed.train(resume_from_checkpoint=True)
        if point not in ("between saves", "just after the rename"):
            assert f".tmp-checkpoint-{step}: a checkpoint save that never finished" in caplog.text, point
        done = int(expected.rsplit("-", 1)[1])
        logs = step_logs(resumed, after=done)
        assert sorted(logs) == list(range(done + 1, full.state.max_steps + 1)), point
        assert max_log_difference(reference, logs) == 0.0, point
        assert max_weight_difference(full.model, resumed.model) == 0.0, point
        assert not any(n.startswith(".tmp-") for n in os.listdir(run_dir)), point  # the stale staging was removed


def test_broken_checkpoints_of_an_in_place_writer_are_skipped_by_name(tmp_path, tokenizer, caplog):
    full = build("sft", tmp_path / "full", tokenizer)
    full.train()
    reference = step_logs(full)
    good = tmp_path / "full" / "checkpoint-2"
    assert checkpoint_problem(str(good)) is None
    run = tmp_path / "run"
    shutil.copytree(good, run / "checkpoint-2")
    (run / "checkpoint-3").mkdir()  # empty folder
    shutil.copytree(good, run / "checkpoint-4")
    os.remove(run / "checkpoint-4" / "trainer_state.json")  # weights without trainer_state.json
    shutil.copytree(good, run / "checkpoint-5")
    open(run / "checkpoint-5" / "optimizer.pt", "wb").close()  # a 0-byte optimizer.pt
    shutil.copytree(good, run / "checkpoint-6")
    open(run / "checkpoint-6" / "trainer_state.json", "w").close()  # a 0-byte trainer_state.json
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        assert latest_complete_checkpoint(str(run)) == str(run / "checkpoint-2")
        for n in (3, 4, 5, 6):
            assert f"skipping incomplete checkpoint {run / f'checkpoint-{n}'}" in caplog.text
        assert "optimizer.pt missing or empty" in caplog.text
        # save_only_model checkpoints carry no optimizer: checkpoint-5 is complete then
        assert latest_complete_checkpoint(str(run), save_only_model=True) == str(run / "checkpoint-5")
        for n in (3, 4, 5, 6):
            shutil.rmtree(run / f"checkpoint-{n}")
        (run / "checkpoint-4").mkdir()
        resumed = build("sft", run, tokenizer)
        resumed.train(resume_from_checkpoint="latest")
    assert max_log_difference(reference, step_logs(resumed, after=2)) == 0.0
    assert max_weight_difference(full.model, resumed.model) == 0.0
    # the re-run's checkpoint-4 replaced the broken folder of that name, whole
    assert checkpoint_problem(str(run / "checkpoint-4")) is None

    empty = tmp_path / "empty"
    (empty / "checkpoint-1").mkdir(parents=True)
    with pytest.raises(ValueError, match="no complete checkpoint-N folder in output_dir"):
        build("sft", empty, tokenizer).train(resume_from_checkpoint=True)


# ---------------------------------------------------------------------------------------------------
# an injected NaN loss at a save step


NAN_STEP = 4  # a save step (save_steps=2)


def nan_at(trainer_class, nan_step):
    """`trainer_class` whose loss is NaN on every micro-batch of optimizer step `nan_step`."""

    class NaNAt(trainer_class):
        def compute_loss(self, model, inputs, *args, **kwargs):
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if self.state.global_step + 1 == nan_step:
                return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")
            return out

    return NaNAt


class _Params(TrainerCallback):
    """A copy of the trained parameters after each optimizer step (the test's own view of the model)."""

    def __init__(self):
        self.after = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()
                                         if p.requires_grad}


CLASSES = {"sft": SFTTrainer, "reward": RewardTrainer, "dpo": DPOTrainer, "ppo": PPOTrainer}


@pytest.mark.parametrize("kind", ["sft", "reward", "dpo", "ppo"])
def test_nan_at_a_save_step_stops_without_saving_it(tmp_path, tokenizer, kind, caplog):
    params = _Params()
    trainer = build(kind, tmp_path / "out", tokenizer, callbacks=[params],
                    trainer_class=nan_at(CLASSES[kind], NAN_STEP))
    with caplog.at_level(logging.ERROR, logger="hf_rlhf"):
        output = trainer.train()
    out = tmp_path / "out"
    assert trainer.state.global_step == NAN_STEP and output.metrics["nonfinite_stop_step"] == NAN_STEP
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint")) == ["checkpoint-2"]
    assert not any(n.startswith(".tmp") for n in os.listdir(out))
    stop = trainer.nonfinite_stop
    assert stop["step"] == NAN_STEP and stop["metric"] in ("loss", "grad_norm") and math.isnan(stop["value"])
    assert f"training stopped at step {NAN_STEP}: " in caplog.text
    assert f"the last good checkpoint is {out / 'checkpoint-2'}" in caplog.text
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert math.isnan(logged[NAN_STEP]["loss"])  # logged as NaN, not 0
    for name, before in params.after[NAN_STEP - 1].items():  # the NaN update was never applied
        assert torch.equal(params.after[NAN_STEP][name], before), name
    with pytest.raises(NonFiniteError, match=f"step {NAN_STEP}"):
        trainer.save_model()
    assert not os.path.exists(out / "model.safetensors") and not os.path.exists(out / "policy")


@pytest.mark.parametrize("kind", ["sft", "reward", "dpo", "ppo"])
def test_nan_at_a_save_step_is_skipped_with_skip_policy(tmp_path, tokenizer, kind):
    params = _Params()
    trainer = build(kind, tmp_path / "out", tokenizer, callbacks=[params], nonfinite_policy="skip",
                    trainer_class=nan_at(CLASSES[kind], NAN_STEP))
    trainer.train()
    assert trainer.state.global_step == trainer.state.max_steps and trainer.nonfinite_stop is None
    for name, before in params.after[NAN_STEP - 1].items():
        assert torch.equal(params.after[NAN_STEP][name], before), name  # that step changed nothing
    changed = [not torch.equal(params.after[NAN_STEP + 1][n], p) for n, p in params.after[NAN_STEP].items()]
    assert any(changed)  # and training went on
    assert all(torch.isfinite(p).all() for p in params.after[trainer.state.max_steps].values())
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert logged[NAN_STEP]["nonfinite_skipped"] == 1 and math.isnan(logged[NAN_STEP]["loss"])
    assert all("nonfinite_skipped" not in log for s, log in logged.items() if s != NAN_STEP)
    assert checkpoint_problem(str(tmp_path / "out" / f"checkpoint-{NAN_STEP}")) is None


def test_unknown_nonfinite_policy_is_an_error_when_the_config_is_built(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"SFTConfig.nonfinite_policy='ignore'; expected one of \['stop', 'skip'\]"):
        build("sft", tmp_path / "out", tokenizer, nonfinite_policy="ignore")


# ---------------------------------------------------------------------------------------------------
# huge finite rewards


def test_huge_finite_rewards_keep_the_logged_mean_finite(tmp_path, tokenizer):
    def huge(prompts, completions, **kwargs):
        half = len(completions) // 2  # float32 sums the + half and the - half to +inf and -inf, then NaN
        return [3e38] * half + [-3e38] * (len(completions) - half)

    trainer = build("ppo", tmp_path / "out", tokenizer, max_steps=1, save_strategy="no",
                    reward=huge, reward_normalization="none", reward_clip=5.0)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["objective/raw_scores"] == 0.0  # float32: inf + -inf -> NaN
    assert math.isfinite(log["objective/scores"]) and math.isfinite(log["loss"])
