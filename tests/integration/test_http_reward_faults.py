"""A reward HTTP server that fails in the middle of a tiny PPO run (HTTP 500, a hang past the timeout, a dropped
connection): bounded retries, then a clear `RewardError` out of `train()`, the last checkpoint intact, and a resume
from it (once the server answers again) that continues the run exactly (issue 13, item 5). The client's own
protocol, retry and error cases are in tests/unit/test_http_client.py.
"""

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hf_rlhf.rewards.base import RewardError
from hf_rlhf.rewards.http_client import HTTPReward
from hf_rlhf.toy import build_toy_model, prompt_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer
from hf_rlhf.training.checkpoints import checkpoint_problem, latest_complete_checkpoint

pytestmark = pytest.mark.integration

TIMEOUT = 0.5


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@contextmanager
def reward_server(fail_from: int, mode: str):
    """A server scoring completions by their share of digits; from request `fail_from` (1-based) on it fails with
    `mode`: "500", "hang" (answers after the client's timeout) or "drop" (closes the connection unanswered).
    `state["mode"] = "ok"` heals it. Yields the state dict (url, requests)."""
    state = {"mode": mode, "requests": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"] += 1
            failing = state["mode"] != "ok" and state["requests"] >= fail_from
            if failing and state["mode"] == "drop":
                self.close_connection = True
                return
            if failing and state["mode"] == "hang":
                time.sleep(3 * TIMEOUT)
            status = 500 if failing and state["mode"] == "500" else 200
            scores = [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in body["completions"]]
            raw = json.dumps({"scores": scores} if status == 200 else {"error": "injected"}).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except OSError:  # the client gave up (hang)
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        state["url"] = f"http://127.0.0.1:{server.server_address[1]}/score"
        yield state
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


def build(output_dir, tokenizer, url, max_steps=8):
    """A rollout = 2 mini-batches x 2 PPO epochs = 4 optimizer steps, one reward request per rollout."""
    args = PPOConfig(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     num_mini_batches=2, num_ppo_epochs=2, response_length=6, temperature=1.0, max_steps=max_steps,
                     logging_steps=1, save_strategy="steps", save_steps=2, report_to="none", seed=0,
                     disable_tqdm=True, learning_rate=3e-3, lr_scheduler_type="constant", kl_target=0.5,
                     kl_horizon=40, reward_normalization="running")
    reward = HTTPReward(url, timeout=TIMEOUT, max_retries=1, backoff=0.01)
    return PPOTrainer(build_toy_model(tokenizer), reward, args=args, train_dataset=prompt_dataset(16, seed=0),
                      processing_class=tokenizer)


def step_logs(trainer, after=0):
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h and h["step"] > after}


@pytest.mark.parametrize("mode, error", [("500", r"last error: HTTP 500"), ("hang", r"timed out"),
                                         ("drop", r"last error: RemoteDisconnected")])
def test_a_failing_reward_server_stops_the_run_with_the_last_checkpoint_intact(tmp_path, tokenizer, mode, error):
    out = tmp_path / "out"
    with reward_server(fail_from=2, mode=mode) as server:  # the second rollout's request fails
        trainer = build(out, tokenizer, server["url"])
        start = time.monotonic()
        with pytest.raises(RewardError, match=rf"reward endpoint .* failed after 2 attempts \(1 \+ max_retries=1, "
                                              rf"timeout={TIMEOUT}s\); .*{error}"):
            trainer.train()
        assert time.monotonic() - start < 60  # bounded: two attempts, not a hang
        assert server["requests"] == 3  # one good request, then 2 attempts
    assert trainer.state.global_step == 4
    assert latest_complete_checkpoint(str(out)) == str(out / "checkpoint-4")
    assert checkpoint_problem(str(out / "checkpoint-4")) is None
    assert not any(p.name.startswith(".tmp") for p in out.iterdir())


def test_after_a_reward_server_failure_the_run_resumes_exactly(tmp_path, tokenizer):
    with reward_server(fail_from=2, mode="500") as server:
        reference = build(tmp_path / "ref", tokenizer, server["url"])
        server["mode"] = "ok"
        reference.train()
        server["mode"], server["requests"] = "500", 0
        failed = build(tmp_path / "out", tokenizer, server["url"])
        with pytest.raises(RewardError):
            failed.train()
        server["mode"] = "ok"  # the endpoint is back
        resumed = build(tmp_path / "out", tokenizer, server["url"])
        resumed.train(resume_from_checkpoint="latest")
    assert resumed.state.global_step == 8
    expected, got = step_logs(reference, after=4), step_logs(resumed, after=4)
    assert sorted(got) == sorted(expected) == [5, 6, 7, 8]
    for step, h in expected.items():
        for key in ("loss", "grad_norm", "objective/kl", "objective/raw_scores"):
            if key in h:
                assert got[step][key] == h[key], (step, key)
