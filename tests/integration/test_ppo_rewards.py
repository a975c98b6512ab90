"""PPOTrainer with a reward served over HTTP (a real server on 127.0.0.1): trains exactly as the same function
called in process, and fails clearly when the endpoint is down or answers badly."""

import socket
import time

import pytest
import torch

from hf_rlhf.rewards.base import RewardError
from hf_rlhf.rewards.http_client import HTTPReward
from hf_rlhf.rewards.server import RewardServer
from hf_rlhf.toy import build_toy_model
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def make_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    num_ppo_epochs=1, response_length=6, max_steps=3, logging_steps=1, save_strategy="no",
                    report_to="none", learning_rate=3e-3, seed=0, disable_tqdm=True, temperature=1.0)
    defaults.update(kw)
    return PPOConfig(**defaults)


def digit_reward(prompts, completions, answer=None, **kwargs):
    """Varies with the random policy's text; uses the `answer` column so that columns must arrive."""
    assert answer is not None and len(answer) == len(completions)
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def step_logs(trainer):
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def test_http_reward_trains_exactly_like_the_same_function_in_process(tmp_path, tokenizer, prompts):
    served = []

    def recording(prompts, completions, **columns):
        scores = digit_reward(prompts, completions, **columns)
        served.append(scores)
        return scores

    local = PPOTrainer(build_toy_model(tokenizer), digit_reward, args=make_args(tmp_path / "local"),
                       train_dataset=prompts, processing_class=tokenizer)
    local.train()
    with RewardServer(recording) as server:
        remote = PPOTrainer(build_toy_model(tokenizer), server.url, args=make_args(tmp_path / "remote"),
                            train_dataset=prompts, processing_class=tokenizer)
        assert isinstance(remote.reward_source, HTTPReward)
        before = {n: p.detach().clone() for n, p in remote.model.named_parameters()}
        remote.train()

    assert len(served) == 3  # one request per rollout (one rollout per optimizer step here)
    logs = step_logs(remote)
    for step, scores in enumerate(served, start=1):
        assert logs[step]["objective/raw_scores"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
    assert any(s > 0 for scores in served for s in scores)
    assert logs == step_logs(local)  # same seed, same rewards: the same run
    assert any(not torch.equal(p, before[n]) for n, p in remote.model.named_parameters())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_endpoint_stops_training_with_a_clear_error(tmp_path, tokenizer, prompts):
    url = f"http://127.0.0.1:{_closed_port()}/score"
    trainer = PPOTrainer(build_toy_model(tokenizer), HTTPReward(url, timeout=1.0, max_retries=2, backoff=0.01),
                         args=make_args(tmp_path, max_steps=1), train_dataset=prompts, processing_class=tokenizer)
    start = time.monotonic()
    with pytest.raises(RewardError, match=rf"reward endpoint {url} failed after 3 attempts .*ConnectionRefused"):
        trainer.train()
    assert time.monotonic() - start < 30  # generation included; the retries themselves take ~0.03 s


def test_a_500_then_200_is_retried_during_training(tmp_path, tokenizer, prompts):
    calls = []

    def flaky(prompts, completions, **columns):
        calls.append(len(completions))
        if len(calls) == 1:
            raise RuntimeError("model still loading")
        return digit_reward(prompts, completions, **columns)

    with RewardServer(flaky) as server:
        trainer = PPOTrainer(build_toy_model(tokenizer), HTTPReward(server.url, backoff=0.01),
                             args=make_args(tmp_path, max_steps=1), train_dataset=prompts, processing_class=tokenizer)
        trainer.train()
    assert calls == [4, 4] and 1 in step_logs(trainer)


def test_a_wrong_number_of_scores_stops_training_with_a_clear_error(tmp_path, tokenizer, prompts):
    with RewardServer(lambda prompts, completions, **kw: [0.0] * (len(completions) - 1)) as server:
        trainer = PPOTrainer(build_toy_model(tokenizer), server.url, args=make_args(tmp_path, max_steps=1),
                             train_dataset=prompts, processing_class=tokenizer)
        with pytest.raises(RewardError, match=r"reward endpoint http://127\.0\.0\.1:\d+/ returned 3 scores for 4 "
                                              r"completions"):
            trainer.train()
