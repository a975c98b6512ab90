"""GRPOTrainer's `environment_factory` as trl 1.16's: a dict of environments routed by each row's `environment` field
(each row rendered and run with its own environment's tools), an environment's `get_reward()` as one more reward
function after `reward_funcs` (named after its class, weight 1, None for other classes' rows), data owned by the
environment (no train_dataset: `reset()` writes the prompt), and the errors of each misuse, named."""

import pytest
import torch
from datasets import Dataset

from hf_rlhf import GRPOConfig, GRPOTrainer
from hf_rlhf.toy import build_toy_model, build_toy_tool_tokenizer
from tests.integration.test_ppo_tools import CALL, FirstTurnScripted

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_toy_tool_tokenizer()


class Counter:
    """Owns its reward: the sum its `add` tool reached."""

    resets = []

    def __init__(self):
        self.total = 0

    def reset(self, **row):
        Counter.resets.append(row)
        self.total = 0
        return " count"

    def add(self, a: int, b: int) -> int:
        """Add to the counter.

        Args:
            a: the first.
            b: the second.
        """
        self.total += a + b
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


class Echo:
    """No reward of its own: scored by the reward functions."""

    resets = []

    def reset(self, **row):
        Echo.resets.append(row)

    def shout(self, text: str) -> str:
        """Shout.

        Args:
            text: what to shout.
        """
        return text.upper()


class Riddle:
    """Owns the data: `reset()` returns the prompt."""

    resets = []

    def reset(self, **row):
        Riddle.resets.append(row)
        return "40+2="


def length(completions, **kwargs):
    return [len(c[-1]["content"]) / 10 for c in completions]


def grpo(tmp_path, tokenizer, dataset, factory, reward_funcs=length, **kw):
    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                   max_completion_length=100, max_steps=2, logging_steps=1, report_to="none", learning_rate=1e-2,
                   seed=0, disable_tqdm=True, save_strategy="no", max_tool_calling_iterations=1, shuffle_dataset=False)
    options.update(kw)
    return GRPOTrainer(build_toy_model(tokenizer), reward_funcs, args=GRPOConfig(**options), train_dataset=dataset,
                       processing_class=tokenizer, environment_factory=factory)


def test_a_dict_of_environments_routes_each_row_to_its_own_tools_and_reward(tmp_path, tool_tokenizer):
    Counter.resets, Echo.resets = [], []
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{40 + i}+2="}] for i in range(4)],
                                 "environment": ["counter", "echo"] * 2})
    trainer = grpo(tmp_path, tool_tokenizer, dataset, {"counter": Counter, "echo": Echo, "again": Counter},
                   reward_weights=[0.5])
    # each row's prompt lists only its environment's tools
    assert "tools: add" in tool_tokenizer.decode(trainer.train_dataset[0]["input_ids"])
    assert "shout" not in tool_tokenizer.decode(trainer.train_dataset[0]["input_ids"])
    assert "tools: shout" in tool_tokenizer.decode(trainer.train_dataset[1]["input_ids"])
    # TRL's reward attributes: Counter's get_reward once (two names build it), after the trainer's own, weight 1
    assert trainer.reward_func_names == ["length", "Counter"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert len(trainer.reward_funcs) == 2 and trainer.reward_funcs[-1](environments=[Counter(), Echo()]) == [0.0, None]
    assert sorted(tool.__name__ for tool in trainer.tools) == ["add", "shout"]

    trainer.rollout_maker.engine = FirstTurnScripted(tool_tokenizer, CALL)  # every row's first turn calls `add`
    rollouts = []
    make = trainer._make_experience
    trainer._make_experience = lambda *a, **k: rollouts.append(make(*a, **k)) or rollouts[-1]
    trainer.train()
    scores = rollouts[-1][0].scores  # the last rollout: counter, counter, echo, echo (2 completions a prompt)
    parts = trainer._reward_parts[0]  # (2, 4): length, Counter (None -> NaN on echo rows)
    assert torch.isnan(parts[1, 2:]).all() and parts[1, :2].tolist() == [42.0, 42.0]  # `add` ran on counter rows
    assert torch.allclose(scores, 0.5 * parts[0] + torch.nan_to_num(parts[1])), (scores, parts)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["tools/failure_frequency"] == pytest.approx(0.5)  # echo rows have no `add`: a failed call
    assert Counter.resets and Echo.resets and all("environment" not in row for row in Counter.resets + Echo.resets)


def test_unknown_environment_is_named_when_its_row_is_drawn(tmp_path, tool_tokenizer):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1="}]] * 2,
                                 "environment": ["counter", "nowhere"]})
    trainer = grpo(tmp_path, tool_tokenizer, dataset, {"counter": Counter}, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=r"dataset row 1: its `environment` field is 'nowhere', which is not among "
                                         r"the environments .* expected one of \['counter'\]"):
        trainer.train()


def test_rows_with_only_an_environment_and_data_owned_by_the_environment(tmp_path, tool_tokenizer):
    # a routing dataset without prompts: each row's reset() writes into an empty user turn (TRL's default prompt)
    Counter.resets = []
    trainer = grpo(tmp_path, tool_tokenizer, Dataset.from_dict({"environment": ["counter", "echo"]}),
                   {"counter": Counter, "echo": Echo}, max_steps=1)
    trainer.train()
    assert Counter.resets and all("prompt" not in row for row in Counter.resets)  # the placeholder is not passed
    # no train_dataset at all: one environment returns the prompt, max_steps sets the length
    Riddle.resets = []
    trainer = grpo(tmp_path, tool_tokenizer, None, Riddle, max_steps=2)
    assert len(trainer.train_dataset) == 2  # one rollout's prompts (4 rows / 2 generations), cycled
    trainer.train()
    assert len(Riddle.resets) == 8 and Riddle.resets[0] == {}
    assert trainer.completions_log is not None and [h for h in trainer.state.log_history if "loss" in h]


def test_misuses_are_named_before_any_model_loads(tmp_path, tool_tokenizer):
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1, per_device_train_batch_size=4,
                      num_generations=2)
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1="}]] * 4})
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer("/no/such/model", args=args, train_dataset=rows, processing_class=tool_tokenizer)
    with pytest.raises(ValueError, match="No reward source provided"):  # an environment without get_reward
        GRPOTrainer("/no/such/model", args=args, train_dataset=rows, processing_class=tool_tokenizer,
                    environment_factory=Echo)
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        GRPOTrainer("/no/such/model", length, args=args, processing_class=tool_tokenizer,
                    environment_factory={"a": Echo, "b": Counter})
    no_steps = GRPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4, num_generations=2)
    with pytest.raises(ValueError, match="needs max_steps > 0"):
        GRPOTrainer("/no/such/model", length, args=no_steps, processing_class=tool_tokenizer,
                    environment_factory=Riddle)
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer("/no/such/model", length, args=args, processing_class=tool_tokenizer)
    with pytest.raises(ValueError, match="reward_weights has 2 weights for 1 reward functions"):
        GRPOTrainer("/no/such/model", length, args=GRPOConfig(output_dir=str(tmp_path), reward_weights=[1.0, 1.0]),
                    train_dataset=rows, processing_class=tool_tokenizer, environment_factory=Counter)
