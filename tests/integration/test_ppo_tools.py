"""PPOTrainer with tools (issue 21): multi-turn rollouts for PPO with a critic and GRPO, on two architectures; the
environment's tokens are in the context and out of every loss term; tool failures are messages, not crashes.

The tiny random policies never write a tool call by themselves, so the first turn of every row comes from a
scripted engine (a `GenerationEngine` whose first turn is a fixed call) and every later turn is sampled by the
model: the rollout, the tools, the forwards and the losses are the real ones."""

import math

import pytest
import torch
from datasets import Dataset

from hf_rlhf.generation.engines import GenerateEngine, GenerationEngine
from hf_rlhf.tools import tool_suffix_ids
from hf_rlhf.toy import build_toy_model, build_toy_tool_tokenizer
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

CALL = '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call><|eos|>'
BROKEN = '<tool_call>{"name": "flaky", "arguments": {"x": 1}}</tool_call><|eos|>'


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_toy_tool_tokenizer()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def flaky(x: int) -> int:
    """Fails.

    Args:
        x: anything.
    """
    raise RuntimeError("flaky tool failed")


class FirstTurnScripted(GenerationEngine):
    """The first turn of a row (no tool result in its context yet) is `first` (cut to the budget); later turns are
    sampled by the model through the `inner` engine (default `generate`). Records every turn it returned."""

    def __init__(self, tokenizer, first=CALL, inner=None):
        super().__init__()
        self.tokenizer, self.first, self.turns = tokenizer, first, []
        self.inner = inner or GenerateEngine()
        self.first_ids = tokenizer(first, add_special_tokens=False)["input_ids"]
        self.marker = tokenizer("result:", add_special_tokens=False)["input_ids"]

    def _generate(self, model, query_ids, query_mask, kwargs):
        rows, sampled = [], []
        for ids, mask in zip(query_ids, query_mask):
            context = ids[mask.bool()].tolist()
            seen = any(context[i:i + len(self.marker)] == self.marker for i in range(len(context)))
            rows.append(seen)
        later = [i for i, seen in enumerate(rows) if seen]
        if later:
            sampled = self.inner._generate(model, query_ids[later], query_mask[later], kwargs).tolist()
        out = []
        for seen in rows:
            out.append(sampled.pop(0) if seen else self.first_ids[:kwargs["max_new_tokens"]])
        width = max(len(r) for r in out)
        self.turns.append(out)
        return torch.tensor([r + [kwargs["pad_token_id"]] * (width - len(r)) for r in out])


def prompts_dataset(n=8):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"{40 + i}+2="}]} for i in range(n)])


def seen_rewards(store):
    def reward(prompts, completions, **kwargs):
        store.append(completions)
        return [len(c[-1]["content"]) / 10 + 0.1 * i for i, c in enumerate(completions)]
    return reward


def qwen2_policy(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


POLICIES = {"llama": lambda tok: build_toy_model(tok, seed=0), "qwen2": qwen2_policy}
ESTIMATORS = {"gae": dict(num_generations=1), "grpo": dict(num_generations=4, kl_in_loss=True)}


def make_trainer(tmp_path, tokenizer, estimator="grpo", arch="llama", tools=(add, flaky), first=CALL, store=None,
                 **kw):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    rollout_batch_size=8, num_ppo_epochs=1, response_length=100, max_steps=2, logging_steps=1,
                    save_strategy="no", report_to="none", learning_rate=3e-3, seed=0, disable_tqdm=True,
                    temperature=1.0, advantage_estimator=estimator, max_tool_calling_iterations=2,
                    tool_call_timeout=5.0, **ESTIMATORS[estimator])
    defaults.update(kw)
    trainer = PPOTrainer(POLICIES[arch](tokenizer), seen_rewards(store if store is not None else []),
                         args=PPOConfig(**defaults), train_dataset=prompts_dataset(), processing_class=tokenizer,
                         tools=list(tools))
    trainer.rollout_maker.engine = FirstTurnScripted(tokenizer, first, inner=trainer.rollout_maker.engine)
    return trainer


@pytest.mark.parametrize("arch,backend", [("llama", "generate"), ("qwen2", "generate"), ("llama", "static"),
                                          ("qwen2", "lean")])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_tool_rollout_trains_and_keeps_the_ids_the_policy_saw(tmp_path, tool_tokenizer, estimator, arch, backend):
    store = []
    trainer = make_trainer(tmp_path, tool_tokenizer, estimator, arch, store=store, generation_backend=backend)
    assert trainer.rollout_maker.engine.inner.name == backend
    if backend == "static":  # the later turns through the static-cache engine, eager (compiling costs ~20 s)
        trainer.rollout_maker.engine.inner.compile = False
    rows = [trainer.train_dataset[i] for i in range(8)]
    experience, stats = trainer._make_experience(rows, list(range(8)))
    engine = trainer.rollout_maker.engine
    first = engine.first_ids
    suffix = tool_suffix_ids(tool_tokenizer, [{"role": "tool", "name": "add", "content": "42"}])
    second = iter(engine.turns[1])  # the rows' sampled second turns, in row order
    for i in range(8):
        turn = next(second)
        eos = tool_tokenizer.eos_token_id
        turn = turn[:turn.index(eos) + 1] if eos in turn else turn[:100 - len(first) - len(suffix)]
        expected = first + suffix + turn
        context = experience.context_mask[i].bool()
        # (a) the trained sequence is the generated ids with the tool tokens appended, no re-tokenization
        assert experience.response_ids[i][context].tolist() == expected
        assert experience.response_mask[i][context].tolist() == [1] * len(first) + [0] * len(suffix) + [1] * len(turn)
        assert store[0][i][1] == {"role": "tool", "name": "add", "content": "42"}
    assert stats["tools/call_frequency"] >= 1.0 and stats["tools/failure_frequency"] == 0.0
    env = experience.context_mask.bool() & ~experience.response_mask.bool()
    for name in ("old_logprobs", "ref_logprobs", "advantages", "returns", "rewards", "old_values"):
        assert getattr(experience, name)[env].abs().sum() == 0, name  # nothing of the environment in the targets

    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["tools/call_frequency"] >= 1.0 for h in logs)


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_environment_tokens_do_not_reach_the_loss(tmp_path, tool_tokenizer, estimator):
    trainer = make_trainer(tmp_path, tool_tokenizer, estimator, entropy_coef=0.01)
    trainer.current_gradient_accumulation_steps = 1
    rows = [trainer.train_dataset[i] for i in range(8)]
    experience, stats = trainer._make_experience(rows, list(range(8)))
    env = experience.context_mask.bool() & ~experience.response_mask.bool()
    assert env.sum() > 0

    def loss_of(exp):
        trainer.model.train()
        torch.manual_seed(0)
        return trainer.compute_loss(trainer.model, {**exp.to_dict(), "rollout_stats": stats})

    clean = loss_of(experience)
    for garbage in (1e4, float("nan")):  # (b) garbage at every environment position: the same loss, bit for bit
        dirty = experience.select(list(range(8)))
        for name in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns", "rewards"):
            getattr(dirty, name)[env] = garbage
        assert torch.equal(loss_of(dirty), clean)
    # the same garbage on one policy token changes it (the check can fail)
    dirty = experience.select(list(range(8)))
    dirty.old_logprobs[experience.response_mask.bool().nonzero()[0].tolist()[0], 0] = 5.0
    assert not torch.equal(loss_of(dirty), clean)


def test_a_failing_tool_is_a_message_and_the_run_goes_on(tmp_path, tool_tokenizer):
    store = []
    trainer = make_trainer(tmp_path, tool_tokenizer, "grpo", first=BROKEN, store=store, max_steps=1,
                           response_length=150)
    trainer.train()
    tool_messages = [c[1] for c in store[0]]
    assert all(m["role"] == "tool" and "flaky tool failed" in m["content"] for m in tool_messages)
    log = [h for h in trainer.state.log_history if "loss" in h][0]
    assert log["tools/failure_frequency"] == 1.0 and math.isfinite(log["loss"])


def test_tool_options_are_checked_before_the_model_loads(tmp_path, tool_tokenizer, tokenizer):
    args = PPOConfig(output_dir=str(tmp_path), report_to="none", response_length=8)
    text_prompts = Dataset.from_list([{"prompt": "1+1="}] * 4)
    with pytest.raises(ValueError, match="conversational prompts"):
        PPOTrainer("no/such/model", lambda p, c, **k: [0.0] * len(c), args=args, train_dataset=text_prompts,
                   processing_class=tool_tokenizer, tools=[add])
    with pytest.raises(ValueError, match="drops the tool call"):
        PPOTrainer("no/such/model", lambda p, c, **k: [0.0] * len(c), args=args, train_dataset=prompts_dataset(),
                   processing_class=tokenizer, tools=[add])


class Counter:
    """An environment: a counter per rollout row, its `add` the row's tool, its value the reward."""

    created = []

    def __init__(self):
        self.total, self.resets = 0, 0
        Counter.created.append(self)

    def reset(self, prompt=None, **row):
        self.total, self.resets = 0, self.resets + 1
        return " go"

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


def test_environment_factory_isolates_rows_and_rewards_them(tmp_path, tool_tokenizer):
    Counter.created = []
    store = []

    def reward(prompts, completions, environments, **kwargs):
        store.append((prompts, completions, environments))
        return [0.5] * len(completions)

    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, rollout_batch_size=8,
                     num_ppo_epochs=1, response_length=100, max_steps=2, logging_steps=1, save_strategy="no",
                     report_to="none", seed=0, disable_tqdm=True, advantage_estimator="grpo", num_generations=4,
                     max_tool_calling_iterations=1)
    trainer = PPOTrainer(build_toy_model(tool_tokenizer), reward, args=args, train_dataset=prompts_dataset(),
                         processing_class=tool_tokenizer, environment_factory=Counter)
    assert "tools: add" in tool_tokenizer.decode(trainer.train_dataset[0]["input_ids"])  # the env's tools rendered
    trainer.rollout_maker.engine = FirstTurnScripted(tool_tokenizer)
    rows = [trainer.train_dataset[i] for i in range(8)]
    trainer.environment_pool.new_rollout()
    experience, stats = trainer.rollout_maker.make(trainer.model, rows, 0.0)
    prompts, completions, environments = store[-1]
    assert len({id(env) for env in environments}) == 8  # one instance per row
    assert all(env.total == 42 and env.resets == 1 for env in environments)  # each row's call on its own state
    assert all(p[-1]["content"].endswith("go") for p in prompts)  # reset's observation ends the user message
    assert all(c[1]["content"] == "42" for c in completions)
    assert torch.allclose(experience.scores, torch.full((8,), 42.5))  # get_reward + the reward function
    assert tool_tokenizer.decode(experience.query_ids[0][experience.query_mask[0].bool()]).endswith("= go<|assistant|>")

    trainer.train()  # one more rollout (2 optimizer steps) reuses the pool: no new instance, each reset once more
    assert len(Counter.created) == 8 and all(env.resets == 2 for env in Counter.created)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)


def test_environment_reward_alone(tmp_path, tool_tokenizer):
    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, rollout_batch_size=8,
                     num_ppo_epochs=1, response_length=100, max_steps=1, report_to="none", save_strategy="no",
                     disable_tqdm=True, advantage_estimator="grpo", num_generations=4)
    with pytest.raises(ValueError, match="No reward source provided"):
        PPOTrainer(build_toy_model(tool_tokenizer), None, args=args, train_dataset=prompts_dataset(),
                   processing_class=tool_tokenizer, tools=[add])
    trainer = PPOTrainer(build_toy_model(tool_tokenizer), None, args=args, train_dataset=prompts_dataset(),
                         processing_class=tool_tokenizer, environment_factory=Counter)
    trainer.rollout_maker.engine = FirstTurnScripted(tool_tokenizer)
    trainer.environment_pool.new_rollout()
    experience, _ = trainer.rollout_maker.make(trainer.model, [trainer.train_dataset[i] for i in range(8)], 0.0)
    assert torch.equal(experience.scores, torch.full((8,), 42.0))


# ---------------------------------------------------------------------------------------------------
# exact resume of a multi-turn run: a checkpoint at a rollout boundary and one mid-rollout


class RandomCall(FirstTurnScripted):
    """The first turn calls `record_add` with a number drawn from torch's RNG (restored on resume like sampling)."""

    def _generate(self, model, query_ids, query_mask, kwargs):
        a = int(torch.randint(0, 1000, (1,)).item())
        self.first_ids = self.tokenizer(
            f'<tool_call>{{"name": "record_add", "arguments": {{"a": {a}, "b": 2}}}}</tool_call><|eos|>',
            add_special_tokens=False)["input_ids"]
        return super()._generate(model, query_ids, query_mask, kwargs)


def resume_trainer(output_dir, tokenizer, estimator, calls):
    def record_add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        calls.append((a, b))
        return a + b

    # 8 prompts x G / rollouts of 4 rows; a rollout = 2 mini-batches x 2 ppo epochs = 4 steps; 8 steps = 2 rollouts
    options = dict(ESTIMATORS[estimator], num_generations=2) if estimator == "grpo" else ESTIMATORS[estimator]
    args = PPOConfig(output_dir=str(output_dir), per_device_train_batch_size=2, num_mini_batches=2, num_ppo_epochs=2,
                     rollout_batch_size=4, response_length=100, max_steps=8, logging_steps=1, save_strategy="steps",
                     save_steps=2, report_to="none", learning_rate=3e-3, seed=0, disable_tqdm=True, temperature=1.0,
                     kl_target=0.5, kl_horizon=40, max_tool_calling_iterations=2, advantage_estimator=estimator,
                     **options)
    trainer = PPOTrainer(build_toy_model(tokenizer), seen_rewards([]), args=args, train_dataset=prompts_dataset(),
                         processing_class=tokenizer, tools=[record_add])
    trainer.rollout_maker.engine = RandomCall(tokenizer)
    return trainer


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_multi_turn_run_resumes_exactly(tmp_path, tool_tokenizer, estimator):
    import shutil

    calls = []
    full = resume_trainer(tmp_path / "full", tool_tokenizer, estimator, calls)
    full.train()
    reference = {h["step"]: h for h in full.state.log_history if "loss" in h}
    assert sorted(reference) == list(range(1, 9)) and len(calls) == 8  # 2 rollouts x 4 rows, one call each
    per_rollout = [sorted(calls[:4]), sorted(calls[4:])]
    final = {k: v.clone() for k, v in full.model.state_dict().items()}
    for step, replayed in {4: per_rollout[1], 6: []}.items():  # rollout boundary; mid-rollout (from its file)
        run_dir = tmp_path / f"resume-{step}"
        shutil.copytree(tmp_path / "full" / f"checkpoint-{step}", run_dir / f"checkpoint-{step}")
        calls.clear()
        resumed = resume_trainer(run_dir, tool_tokenizer, estimator, calls)
        resumed.train(resume_from_checkpoint=True)
        logs = {h["step"]: h for h in resumed.state.log_history if "loss" in h and h["step"] > step}
        assert sorted(logs) == list(range(step + 1, 9))
        for s, log in logs.items():
            assert log == reference[s], f"resumed from checkpoint-{step}, step {s}"
        # tool calls: none replayed for a rollout restored from the checkpoint; a regenerated rollout makes exactly
        # the calls the uninterrupted run made (the same sampled ids: deterministic replay)
        assert sorted(calls) == replayed
        assert max((v - final[k]).abs().max().item() for k, v in resumed.model.state_dict().items()) == 0.0


# ---------------------------------------------------------------------------------------------------
# rollout_func (TRL's signature): the user's own rollout, its environment tokens out of the loss


def test_rollout_func_trains_on_its_ids_with_env_mask(tmp_path, tool_tokenizer):
    seen, fields = [], []

    def rollout_func(prompts, trainer):
        assert isinstance(trainer, PPOTrainer)
        seen.append(prompts)
        tok = trainer.processing_class
        prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in prompts]
        policy, env = tok("12", add_special_tokens=False)["input_ids"], tok("<|user|>ok<|assistant|>",
                                                                            add_special_tokens=False)["input_ids"]
        last = tok("3<|eos|>", add_special_tokens=False)["input_ids"]
        completion = policy + env + last
        mask = [1] * len(policy) + [0] * len(env) + [1] * len(last)
        return {"prompt_ids": prompt_ids, "completion_ids": [completion] * len(prompts),
                "logprobs": [[0.0] * len(completion)] * len(prompts), "env_mask": [mask] * len(prompts),
                "turns": [2] * len(prompts)}

    def reward(prompts, completions, turns, **kwargs):
        fields.append(turns)
        return [float(i % 2) for i in range(len(completions))]

    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, rollout_batch_size=8,
                     num_ppo_epochs=1, response_length=16, max_steps=2, logging_steps=1, save_strategy="no",
                     report_to="none", seed=0, disable_tqdm=True, advantage_estimator="grpo", num_generations=4)
    with pytest.raises(ValueError, match="not combined with tools"):
        PPOTrainer("no/such/model", reward, args=args, train_dataset=prompts_dataset(), tools=[add],
                   rollout_func=rollout_func)
    trainer = PPOTrainer(build_toy_model(tool_tokenizer), reward, args=args, train_dataset=prompts_dataset(),
                         processing_class=tool_tokenizer, rollout_func=rollout_func)
    experience, _ = trainer.rollout_maker.make(trainer.model, [trainer.train_dataset[i] for i in range(8)], 0.0)
    assert len(seen[0]) == 8 and fields[0] == [2] * 8
    assert experience.response_mask[0].tolist() == [1, 1] + [0] * 4 + [1, 1]  # "<|user|>ok<|assistant|>": 4 ids
    assert experience.context_mask[0].sum() == 8 and experience.old_logprobs[0, 2:6].abs().sum() == 0
    assert experience.scores.tolist() == [0.0, 1.0] * 4
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 2


def test_tools_with_dynamic_sampling_refill(tmp_path, tool_tokenizer):
    """filter_groups: every group has equal rewards, so a second generation round runs; its rows call tools too."""
    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, rollout_batch_size=8,
                     num_ppo_epochs=1, response_length=100, max_steps=1, logging_steps=1, save_strategy="no",
                     report_to="none", seed=0, disable_tqdm=True, advantage_estimator="grpo", num_generations=4,
                     filter_groups=True, max_num_gen_batches=2, max_tool_calling_iterations=1)
    trainer = PPOTrainer(build_toy_model(tool_tokenizer), lambda prompts, completions, **kw: [1.0] * len(completions),
                         args=args, train_dataset=prompts_dataset(), processing_class=tool_tokenizer, tools=[add])
    trainer.rollout_maker.engine = FirstTurnScripted(tool_tokenizer, inner=trainer.rollout_maker.engine)
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h][0]
    assert log["filter/gen_batches"] == 2 and log["tools/call_frequency"] == 1.0  # 16 calls / 16 completions
    assert sum(len(turns) for turns in trainer.rollout_maker.engine.turns) == 32  # 2 rounds x 8 rows x 2 turns
