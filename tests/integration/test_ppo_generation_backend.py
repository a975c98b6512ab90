"""PPO with `generation_backend="static"` resumes exactly like the reference runs of test_ppo_trainer.py; with "lean"
it logs exactly what "generate" logs (same seed)."""

import logging
import shutil

import pytest
from test_ppo_trainer import _resume_trainer, digit_reward, make_args, step_logs

from hf_rlhf.toy import build_toy_model, build_toy_reward_model
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def _static_trainer(output_dir, tokenizer, prompts, calls, **kw):
    trainer = _resume_trainer(output_dir, tokenizer, prompts, calls, generation_backend="static", **kw)
    engine = trainer.rollout_maker.engine
    assert engine.name == "static"
    engine.compile = False  # the static cache eagerly: the compile costs ~20 s a model on CPU (tests/zoo compiles)
    return trainer


def test_static_backend_resumes_exactly(tmp_path, tokenizer, prompts):
    calls = []
    full = _static_trainer(tmp_path / "full", tokenizer, prompts, calls)
    full.train()
    reference = step_logs(full)
    assert sorted(reference) == list(range(1, 21)) and len(calls) == 5
    assert full.rollout_maker.engine.stats.calls == 5
    step = 6  # mid-rollout: that rollout comes from the checkpoint, the next three are generated
    shutil.copytree(tmp_path / "full" / f"checkpoint-{step}", tmp_path / "resume" / f"checkpoint-{step}")
    calls.clear()
    resumed = _static_trainer(tmp_path / "resume", tokenizer, prompts, calls)
    resumed.train(resume_from_checkpoint=True)
    logs = step_logs(resumed, after=step)
    assert sorted(logs) == list(range(step + 1, 21)) and len(calls) == 3
    for s, log in logs.items():
        assert log == reference[s], f"step {s}"


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_lean_backend_logs_what_generate_logs(tmp_path, tokenizer, prompts, estimator):
    """The rollouts sample the same tokens, so with the old log-probs from the policy forward every logged metric of
    every step is equal (PPO and GRPO); a stop token, so rows end at different steps. With them read off each
    engine's own decoding (`logprobs_from_generation`, the default) the two decodings round apart (generate prefills
    the G rows' shared prompt once, lean does not): the same tokens, the same logs to 1e-4."""
    logs = {}
    for backend, from_generation in (("generate", False), ("lean", False), ("generate", None), ("lean", None)):
        calls = []
        trainer = _resume_trainer(tmp_path / f"{backend}-{from_generation}", tokenizer, prompts, calls, estimator,
                                  generation_backend=backend, logprobs_from_generation=from_generation)
        assert trainer.rollout_maker.engine.name == backend
        assert trainer.rollout_maker.capture_decoding is (from_generation is None)
        trainer.train()
        logs[backend, from_generation] = {s: {k: v for k, v in log.items() if k not in ("train_runtime",)}
                                          for s, log in step_logs(trainer).items()}
        if backend == "lean":
            assert not calls and trainer.rollout_maker.engine.stats.calls == 5  # generate was never called
    assert sorted(logs["lean", False]) == list(range(1, 21))
    assert logs["lean", False] == logs["generate", False]
    for s, log in logs["generate", None].items():  # val/clipfrac_avg counts rounding: see the test below
        log = {k: v for k, v in log.items() if k != "val/clipfrac_avg"}
        for other in (logs["lean", None][s], logs["generate", False][s]):
            assert log == pytest.approx({k: other[k] for k in log}, rel=1e-4, abs=1e-6), f"step {s}"


# -- logprobs_from_generation: the old log-probs and the value head's values read off the decoding -------------------
def _rollout_forwards(monkeypatch):
    """Counts the rollout's policy forwards (`response_scores` on the trained `PolicyAndValue`, not the reference)."""
    import hf_rlhf.rollout.rollout_maker as rollout
    from hf_rlhf.models.policy_value import PolicyAndValue

    calls, original = [], rollout.response_scores

    def counted(model, *args, **kwargs):
        if isinstance(model, PolicyAndValue):
            calls.append(1)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(rollout, "response_scores", counted)
    return calls


def _ppo_trainer(tmp_path, tokenizer, prompts, name, value_model=None, **kw):
    # rollouts of 4 prompts, 2 PPO epochs of one optimizer step: 3 rollouts in 6 steps
    args = make_args(tmp_path / name, **{"rollout_batch_size": 4, "num_ppo_epochs": 2, "max_steps": 6, **kw})
    return PPOTrainer(build_toy_model(tokenizer), digit_reward, args=args, train_dataset=prompts,
                      processing_class=tokenizer, value_model=value_model)


def test_logprobs_from_generation_skips_the_rollout_policy_forward(tmp_path, tokenizer, prompts, monkeypatch, caplog):
    """On by default for PPO with a value head: the first rollout runs its policy forward once more to check the
    decoding's numbers, the next two none; the run logs what the forward-scored run logs, to float rounding."""
    calls = _rollout_forwards(monkeypatch)
    logs = {}
    for setting in (False, None):
        calls.clear()
        trainer = _ppo_trainer(tmp_path, tokenizer, prompts, f"run-{setting}", logprobs_from_generation=setting)
        assert trainer.rollout_maker.capture_decoding is (setting is None)
        with caplog.at_level(logging.INFO, logger="hf_rlhf"):
            trainer.train()
        logs[setting] = step_logs(trainer)
        assert len(calls) == (3 if setting is False else 1)
    assert "the rollout's policy forward is skipped from here on" in caplog.text
    assert sorted(logs[None]) == list(range(1, 7))
    # not val/clipfrac_avg: TRL's count of tokens whose clipped value error is the larger counts float rounding
    # (V_old + (V - V_old) != V), so a last-bit change of V_old moves it by a token
    for step, log in logs[None].items():
        log = {k: v for k, v in log.items() if k not in ("train_runtime", "val/clipfrac_avg")}
        assert log == pytest.approx({k: logs[False][step][k] for k in log}, rel=1e-4, abs=1e-6), f"step {step}"


def test_logprobs_from_generation_where_it_cannot_apply(tmp_path, tokenizer, prompts):
    with pytest.raises(ValueError, match="logprobs_from_generation=True cannot be honoured: generation_backend="
                                         "'static' returns no log-probs"):
        _ppo_trainer(tmp_path, tokenizer, prompts, "static", generation_backend="static", logprobs_from_generation=True)
    value_model = build_toy_reward_model(tokenizer)
    with pytest.raises(ValueError, match="a separate value model / value adapter needs its own forward"):
        _ppo_trainer(tmp_path, tokenizer, prompts, "value", value_model=value_model, logprobs_from_generation=True)
    trainer = _ppo_trainer(tmp_path, tokenizer, prompts, "value", value_model=value_model)  # None: off, logged
    assert not trainer.rollout_maker.capture_decoding
    grpo = _ppo_trainer(tmp_path, tokenizer, prompts, "grpo", advantage_estimator="grpo", num_generations=2,
                        num_ppo_epochs=1, kl_in_loss=True, logprobs_from_generation=True)
    assert not grpo.rollout_maker.capture_decoding  # the loss gives the old log-probs: nothing to capture


@pytest.mark.parametrize("fault", ["shifted", "one_position_late"])
def test_logprobs_from_generation_that_disagree_are_turned_off(tmp_path, tokenizer, prompts, monkeypatch, caplog,
                                                               fault):
    """A decoding whose log-probs differ from the forward's by more than rounding (shifted by 0.5; or every step's
    log-prob and hidden state read one position late, as a wrong hook would) is caught on the first rollout: off from
    there (the run is then the forward-scored one, exactly), or an error when required."""
    from hf_rlhf.generation.capture import DecodeCapture

    take, result = DecodeCapture._take, DecodeCapture.result

    def shifted(self, tokens):
        take(self, tokens)
        self._logprobs[-1] = self._logprobs[-1] + 0.5

    def late(self, response_ids):
        logprobs, hidden = result(self, response_ids)
        return logprobs.roll(1, dims=1), hidden.roll(1, dims=1)

    reference = _ppo_trainer(tmp_path, tokenizer, prompts, "forward", logprobs_from_generation=False)
    reference.train()
    if fault == "shifted":
        monkeypatch.setattr(DecodeCapture, "_take", shifted)
    else:
        monkeypatch.setattr(DecodeCapture, "result", late)
    trainer = _ppo_trainer(tmp_path, tokenizer, prompts, "faulty")
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        trainer.train()
    assert not trainer.rollout_maker.capture_decoding
    assert "logprobs_from_generation off: the log-probs / values taken off the decoding differ" in caplog.text
    strip = lambda logs: {s: {k: v for k, v in log.items() if k != "train_runtime"} for s, log in logs.items()}  # noqa: E731
    assert strip(step_logs(trainer)) == strip(step_logs(reference))
    required = _ppo_trainer(tmp_path, tokenizer, prompts, "required", logprobs_from_generation=True)
    with pytest.raises(ValueError, match="logprobs_from_generation=True cannot be honoured: the log-probs / values"):
        required.train()
