"""Bad environments (issue 44, item 3), each named, none leaving a half-written checkpoint: a disk that fills up
during a save (`OSError(ENOSPC)` injected where the writer writes, and torch's own error on a write to /dev/full),
an output directory that is read-only from the start or becomes so, an output directory deleted between two saves
or during one, and a reward HTTP server (`python -m hf_rlhf.rewards.server`) killed and restarted mid-run, or gone.
After each failure the last published checkpoint loads: the run resumes from it and ends as the uninterrupted one.
"""

import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import hf_rlhf.training.checkpoints as checkpoints
from hf_rlhf import SFTConfig, SFTTrainer
from hf_rlhf.rewards.base import RewardError
from hf_rlhf.rewards.http_client import HTTPReward
from hf_rlhf.toy import build_toy_model, prompt_dataset, sft_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer
from hf_rlhf.training.checkpoints import CheckpointWriteError, checkpoint_problem, latest_complete_checkpoint

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def sft(output_dir, tokenizer, callbacks=()):
    args = SFTConfig(output_dir=str(output_dir), max_steps=6, per_device_train_batch_size=8, max_length=48,
                     logging_steps=1, save_strategy="steps", save_steps=2, report_to="none", seed=0,
                     disable_tqdm=True, learning_rate=3e-3, warmup_steps=0)
    return SFTTrainer(build_toy_model(tokenizer, "tiny", seed=0), args=args, train_dataset=sft_dataset(64, seed=1),
                      processing_class=tokenizer, callbacks=list(callbacks))


@pytest.fixture(scope="module")
def reference(tokenizer, tmp_path_factory):
    trainer = sft(tmp_path_factory.mktemp("reference") / "out", tokenizer)
    trainer.train()
    return trainer


def assert_resumes_to_the_reference(out, tokenizer, reference):
    """The last published checkpoint loads: a resume from it ends with the reference's weights and logs."""
    resumed = sft(out, tokenizer)
    resumed.train(resume_from_checkpoint="latest")
    weights, expected = resumed.model.state_dict(), reference.model.state_dict()
    assert max((weights[k] - expected[k]).abs().max().item() for k in expected) == 0.0
    logs = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    assert logs == {h["step"]: h["loss"] for h in reference.state.log_history if "loss" in h}


def failing_write(monkeypatch, target: str, how: str):
    """The write of `target` (a file of checkpoint-4) fails: `how` "ENOSPC" / "EROFS" raise that OSError after a
    partial write; "silent" cuts the written file in half without an error, as torch's writer left a full disk
    (writing to /dev/full, always full, it reported nothing)."""
    import transformers.modeling_utils as modeling_utils

    save, safe_save = torch.save, modeling_utils.safe_save_file

    def fail(path):
        with open(path, "wb") as f:
            f.write(b"\0" * 16)  # what got onto the disk before it filled up
        raise OSError(getattr(errno, how), os.strerror(getattr(errno, how)), str(path))

    def hit(path):
        return isinstance(path, (str, os.PathLike)) and str(path).endswith(os.path.join("checkpoint-4", target))

    def torch_save(obj, f, *args, **kwargs):
        if hit(f) and how != "silent":
            fail(f)
        out = save(obj, f, *args, **kwargs)
        if hit(f):
            os.truncate(f, os.path.getsize(f) // 2)
        return out

    def safetensors_save(tensors, filename, *args, **kwargs):
        if hit(filename) and how != "silent":
            fail(filename)
        out = safe_save(tensors, filename, *args, **kwargs)
        if hit(filename):
            os.truncate(filename, os.path.getsize(filename) // 2)
        return out

    monkeypatch.setattr(torch, "save", torch_save)
    monkeypatch.setattr(modeling_utils, "safe_save_file", safetensors_save)


@pytest.mark.parametrize("target,how,reason", [
    ("optimizer.pt", "ENOSPC", "No space left on device"),
    ("model.safetensors", "ENOSPC", "No space left on device"),
    ("optimizer.pt", "silent", "optimizer.pt is unreadable (BadZipFile: File is not a zip file); the disk may be full"),
    ("model.safetensors", "silent", "model.safetensors is cut short ("),
    ("rng_state.pth", "EROFS", "Read-only file system"),  # remounted read-only during the run
])
def test_a_failed_save_is_named_publishes_nothing_and_the_last_checkpoint_loads(tmp_path, tokenizer, reference,
                                                                              monkeypatch, target, how, reason):
    out = tmp_path / "out"
    trainer = sft(out, tokenizer)
    with monkeypatch.context() as patch:
        failing_write(patch, target, how)
        with pytest.raises(CheckpointWriteError) as raised:
            trainer.train()
    message = str(raised.value)
    assert message.startswith(f"checkpoint-4 could not be written to {out} (") and reason in message
    assert "MiB free there" in message
    assert f"the last complete checkpoint is {out / 'checkpoint-2'}" in message
    assert "resume with --resume_from_checkpoint latest" in message
    if how != "silent":
        assert raised.value.errno == getattr(errno, how)
    assert sorted(os.listdir(out)) == ["checkpoint-2"]  # no staging folder, no checkpoint-4
    assert latest_complete_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert_resumes_to_the_reference(out, tokenizer, reference)


def test_a_read_only_output_dir_stops_before_the_first_step(tmp_path, tokenizer, monkeypatch):
    out = tmp_path / "out"
    mkstemp = checkpoints.tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == out:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(checkpoints.tempfile, "mkstemp", read_only)  # root writes through chmod: injected
    trainer = sft(out, tokenizer)
    with pytest.raises(CheckpointWriteError, match=rf"output_dir '{out}' cannot be written \(Read-only file system\)"):
        trainer.train()
    assert trainer.state.global_step == 0 and os.listdir(out) == []


def test_the_recipe_names_a_read_only_output_dir_in_one_line(tmp_path, tiny_model_dir, monkeypatch):
    from hf_rlhf.cli.errors import run_recipe
    from recipes import sft as sft_recipe

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_dataset(16, seed=1)))
    out = tmp_path / "out"
    monkeypatch.setattr(checkpoints.tempfile, "mkstemp", lambda *a, **k: (_ for _ in ()).throw(
        PermissionError(errno.EACCES, os.strerror(errno.EACCES))))
    with pytest.raises(SystemExit) as exited:
        run_recipe(lambda: sft_recipe.main(["--dataset_name", str(data), "--model_name_or_path", str(tiny_model_dir),
                                            "--output_dir", str(out), "--max_steps", "2", "--save_steps", "1",
                                            "--report_to", "none", "--max_length", "48"]))
    assert str(exited.value.code) == (f"[hf_rlhf] error: output_dir '{out}' cannot be written (Permission denied): "
                                      "checkpoints and the trained model are saved there; give a writable "
                                      "--output_dir (or save_strategy='no' to train without checkpoints)")


class DeleteOutputDir(TrainerCallback):
    def __init__(self, out, at_step):
        self.out, self.at_step = out, at_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            shutil.rmtree(self.out)


def test_an_output_dir_deleted_between_saves_is_written_again(tmp_path, tokenizer, reference, caplog):
    out = tmp_path / "out"
    trainer = sft(out, tokenizer, callbacks=[DeleteOutputDir(out, 3)])
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        trainer.train()
    assert f"output_dir {out} was deleted since {out / 'checkpoint-2'} was saved; writing checkpoint-4" in caplog.text
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6"]
    assert checkpoint_problem(str(out / "checkpoint-4")) is None
    shutil.rmtree(out / "checkpoint-6")
    assert_resumes_to_the_reference(out, tokenizer, reference)


def test_an_output_dir_deleted_during_a_save_is_named(tmp_path, tokenizer, monkeypatch):
    out = tmp_path / "out"
    save = torch.save

    def deleting_save(obj, f, *args, **kwargs):
        if str(f).endswith(os.path.join("checkpoint-4", "optimizer.pt")):
            shutil.rmtree(out)  # a clean-up job, or a user, removes the run's folder
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", deleting_save)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint-4 could not be written to .* \(output_dir was "
                                                   r"deleted during the save\).*last complete checkpoint is none"):
        sft(out, tokenizer).train()
    assert not out.exists()  # nothing half-written was left or re-created


# ---------------------------------------------------------------------------------------------------
# the reward server restarts mid-run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "hf_rlhf.rewards.server", "--port", str(port), "--reward",
                               "hf_rlhf.toy:reward_fn"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert server.stdout.readline().startswith("serving "), "the reward server did not start"
    return server


def ppo(output_dir, tokenizer, url, callbacks=(), max_retries=8):
    # 4 optimizer steps a rollout: the rewards are fetched at steps 0, 4, 8 (backoff 0.25 s doubling: ~60 s in all)
    args = PPOConfig(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     num_mini_batches=2, num_ppo_epochs=2, response_length=6, max_steps=12, logging_steps=1,
                     save_strategy="steps", save_steps=2, report_to="none", seed=0, disable_tqdm=True,
                     learning_rate=3e-3, temperature=1.0)
    reward = HTTPReward(url, timeout=10.0, max_retries=max_retries, backoff=0.25)
    return PPOTrainer(build_toy_model(tokenizer), reward, args=args, train_dataset=prompt_dataset(12, seed=0),
                      processing_class=tokenizer, callbacks=list(callbacks))


class KillServer(TrainerCallback):
    """At `at_step`, SIGKILL the server; with `restart`, start it again on the same port in the background."""

    def __init__(self, servers, port, at_step, restart):
        self.servers, self.port, self.at_step, self.restart = servers, port, at_step, restart

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.at_step:
            return
        self.servers[-1].send_signal(signal.SIGKILL)
        self.servers[-1].wait()
        if self.restart:
            threading.Thread(target=lambda: self.servers.append(start_server(self.port)), daemon=True).start()


def test_a_reward_server_restarted_mid_run_is_retried_and_the_run_is_unchanged(tmp_path, tokenizer, caplog):
    port = free_port()
    servers = [start_server(port)]
    try:
        url = f"http://127.0.0.1:{port}/"
        full = ppo(tmp_path / "full", tokenizer, url)
        full.train()
        restarted = ppo(tmp_path / "restarted", tokenizer, url, callbacks=[KillServer(servers, port, 2, True)])
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
            restarted.train()
        assert len(servers) == 2 and time.monotonic() - start < 120
    finally:
        for server in servers:
            server.kill()
            server.wait()
    assert f"reward endpoint {url}: attempt 1/9 failed (ConnectionRefusedError" in caplog.text
    weights, expected = restarted.model.state_dict(), full.model.state_dict()
    assert max((weights[k] - expected[k]).abs().max().item() for k in expected) == 0.0
    logs = [{k: v for k, v in h.items() if k != "tokens_per_second"} for h in restarted.state.log_history
            if "loss" in h]
    assert logs == [{k: v for k, v in h.items() if k != "tokens_per_second"} for h in full.state.log_history
                    if "loss" in h]


def test_a_reward_server_that_stays_down_stops_the_run_with_the_last_checkpoint_loadable(tmp_path, tokenizer):
    port = free_port()
    servers = [start_server(port)]
    url = f"http://127.0.0.1:{port}/"
    try:
        trainer = ppo(tmp_path / "out", tokenizer, url, callbacks=[KillServer(servers, port, 2, False)], max_retries=2)
        with pytest.raises(RewardError, match=rf"reward endpoint {url} failed after 3 attempts \(1 \+ max_retries=2, "
                                              r"timeout=10.0s\); last error: ConnectionRefusedError"):
            trainer.train()
    finally:
        servers[-1].kill()
        servers[-1].wait()
    out = tmp_path / "out"
    assert latest_complete_checkpoint(str(out)) == str(out / "checkpoint-4")
    assert not any(n.startswith(".tmp-") for n in os.listdir(out))
    servers = [start_server(port)]  # back up: the run goes on from the checkpoint
    try:
        resumed = ppo(out, tokenizer, url)
        resumed.train(resume_from_checkpoint="latest")
    finally:
        servers[0].kill()
        servers[0].wait()
    assert resumed.state.global_step == 12
