"""PPO with `generation_backend="static"` resumes exactly like the reference runs of test_ppo_trainer.py; with "lean"
it logs exactly what "generate" logs (same seed)."""

import shutil

import pytest
from test_ppo_trainer import _resume_trainer, step_logs

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
    """The rollouts sample the same tokens, so every logged metric of every step is equal (PPO and GRPO); a stop
    token, so rows end at different steps."""
    logs = {}
    for backend in ("generate", "lean"):
        calls = []
        trainer = _resume_trainer(tmp_path / backend, tokenizer, prompts, calls, estimator, generation_backend=backend)
        assert trainer.rollout_maker.engine.name == backend
        trainer.train()
        logs[backend] = {s: {k: v for k, v in log.items() if k not in ("train_runtime",)}
                         for s, log in step_logs(trainer).items()}
        if backend == "lean":
            assert not calls and trainer.rollout_maker.engine.stats.calls == 5  # generate was never called
    assert sorted(logs["lean"]) == list(range(1, 21))
    assert logs["lean"] == logs["generate"]
