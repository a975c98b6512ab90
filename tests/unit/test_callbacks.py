"""hf_rlhf.callbacks with fake Trainer states and logs: the plot PNG, the non-finite stop, sample completions."""

import json
import logging
import math

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from hf_rlhf.callbacks import NonFiniteStopCallback, PlotCallback, SampleCompletionsCallback, plot_log_history
from hf_rlhf.callbacks.plot import curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")


def fake_state(log_history=(), step=0):
    state = TrainerState()
    state.log_history, state.global_step = list(log_history), step
    return state


def ppo_history(steps=10):
    history = [{"step": s, "loss": 1.0 / s, "objective/kl": 0.1 * s, "objective/kl_coef": 0.05 + 0.001 * s,
                "objective/raw_scores": math.log(s)} for s in range(1, steps + 1)]
    return history + [{"step": steps, "train_runtime": 12.0}]  # the Trainer's final summary has no curves


# ---------------------------------------------------------------------------------------------------
# plot


def test_curve_keeps_finite_numbers_of_one_metric():
    history = [{"step": 1, "kl": 0.5}, {"step": 2, "loss": 3.0}, {"step": 3, "kl": float("nan")}, {"step": 4, "kl": 2}]
    assert curve(history, "kl") == ([1, 4], [0.5, 2.0])


def test_plot_callback_writes_a_png_at_train_end(args):
    pytest.importorskip("matplotlib")
    callback = PlotCallback(["objective/raw_scores", "objective/kl", "objective/kl_coef"], filename="c.png",
                            bands={"objective/kl": (0.75, 1.25)})
    callback.on_train_end(args, fake_state(ppo_history()), TrainerControl())
    assert callback.path.endswith("c.png")
    with open(callback.path, "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_plot_callback_skips_other_processes_and_unlogged_metrics(args, caplog):
    pytest.importorskip("matplotlib")
    state = fake_state(ppo_history())
    state.is_world_process_zero = False
    callback = PlotCallback(["objective/kl"])
    callback.on_train_end(args, state, TrainerControl())
    assert callback.path is None

    callback = PlotCallback(["never/logged"])
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        callback.on_train_end(args, fake_state(ppo_history()), TrainerControl())
    assert callback.path is None and "none of ['never/logged'] was logged" in caplog.text


def test_plot_log_history_marks_a_missing_panel(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_log_history(ppo_history(), ["objective/kl", "not/logged"], str(tmp_path / "sub" / "p.png"))
    assert open(path, "rb").read(8) == PNG_MAGIC
    with pytest.raises(ValueError, match="at least one metric"):
        PlotCallback([])


# ---------------------------------------------------------------------------------------------------
# non-finite stop


@pytest.mark.parametrize("metric, value", [("loss", float("nan")), ("objective/kl", float("inf")),
                                           ("grad_norm", float("-inf"))])
def test_nonfinite_value_stops_training(args, metric, value, caplog):
    callback, control = NonFiniteStopCallback(), TrainerControl()
    with caplog.at_level(logging.ERROR, logger="hf_rlhf"):
        callback.on_log(args, fake_state(step=7), control, logs={"loss": 0.5, metric: value, "epoch": 1.0})
    assert control.should_training_stop is True
    assert callback.stopped["step"] == 7 and callback.stopped["metric"] == metric
    assert f"stopping training at step 7: {metric} = {value}" in caplog.text


def test_a_stop_cancels_the_save_of_that_step_and_of_the_epoch_end(args):
    callback, control = NonFiniteStopCallback(), TrainerControl()
    control.should_save = True  # set at on_step_end: the save comes after the log in the Trainer
    callback.on_log(args, fake_state(step=4), control, logs={"loss": float("nan")})
    assert control.should_save is False
    control.should_save = True  # DefaultFlowCallback at the epoch end
    callback.on_epoch_end(args, fake_state(step=4), control)
    assert control.should_save is False


def test_skip_policy_only_warns(args, caplog):
    args.nonfinite_policy = "skip"  # as hf_rlhf's configs have it; the trainer dropped those steps already
    callback, control = NonFiniteStopCallback(), TrainerControl()
    control.should_save = True
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        callback.on_log(args, fake_state(step=3), control, logs={"loss": float("nan")})
    assert control.should_training_stop is False and control.should_save is True and callback.stopped is None
    assert "step 3: loss = nan logged" in caplog.text


def test_finite_values_and_other_metrics_do_not_stop(args):
    callback, control = NonFiniteStopCallback(), TrainerControl()
    for logs in ({"loss": 0.5, "objective/kl": 1.2, "grad_norm": 3.0}, {"learning_rate": float("nan")},
                 {"loss": "nan as text"}, {}):
        callback.on_log(args, fake_state(step=1), control, logs=logs)
    assert control.should_training_stop is False and callback.stopped is None


def test_fp16_does_not_watch_grad_norm(tmp_path):
    callback, control = NonFiniteStopCallback(), TrainerControl()
    fp16_args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    fp16_args.fp16 = True  # set after construction: fp16 needs a GPU to validate
    callback.on_log(fp16_args, fake_state(step=1), control, logs={"grad_norm": float("inf"), "loss": 1.0})
    assert control.should_training_stop is False
    callback.on_log(fp16_args, fake_state(step=2), control, logs={"loss": float("nan")})
    assert control.should_training_stop is True


# ---------------------------------------------------------------------------------------------------
# sample completions


class EchoPolicy(torch.nn.Module):
    """A stand-in causal LM whose `generate` appends `answer` then eos (greedy)."""

    def __init__(self, tokenizer, answer="4"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.answer = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    @property
    def device(self):
        return self.weight.device

    def generate(self, input_ids, max_new_tokens, **kwargs):
        new = torch.tensor(self.answer[:max_new_tokens]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, new], dim=1)


class Wrapper(torch.nn.Module):  # like PPO's PolicyAndValue: the LM is `.policy`
    def __init__(self, policy):
        super().__init__()
        self.policy = policy


def test_sample_completions_print_score_and_append_jsonl(args, capsys, tokenizer):
    from hf_rlhf.toy import reward_fn

    callback = SampleCompletionsCallback(["2+2=", "1+1="], every_n_steps=5, max_new_tokens=4, score_fn=reward_fn)
    model = Wrapper(EchoPolicy(tokenizer))
    control = TrainerControl()
    callback.on_train_begin(args, fake_state(step=0), control, model=model, processing_class=tokenizer)
    for step in (1, 5):
        callback.on_step_end(args, fake_state(step=step), control, model=model, processing_class=tokenizer)
    callback.on_train_end(args, fake_state(step=5), control, model=model, processing_class=tokenizer)  # no repeat

    assert [(r["step"], r["prompt"], r["completion"], r["score"]) for r in callback.history] == [
        (0, "2+2=", "4", 1.0), (0, "1+1=", "4", 0.0), (5, "2+2=", "4", 1.0), (5, "1+1=", "4", 0.0)]
    with open(f"{args.output_dir}/completions.jsonl") as f:
        assert [json.loads(line) for line in f] == callback.history
    out = capsys.readouterr().out
    assert "sample completions at step 5" in out and "1+1= -> '4'  (score 0)" in out


def test_sample_completions_only_on_the_main_process(args, tmp_path, tokenizer):
    state = fake_state(step=0)
    state.is_world_process_zero = False
    callback = SampleCompletionsCallback(["2+2="], filename=None)
    callback.on_train_begin(args, state, TrainerControl(), model=EchoPolicy(tokenizer), processing_class=tokenizer)
    assert callback.history == []
    with pytest.raises(ValueError, match="at least one prompt"):
        SampleCompletionsCallback([])
