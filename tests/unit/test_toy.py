"""The toy world: tasks, evaluator, tokenizer and tiny models."""

import contextlib
import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

from hf_rlhf.toy import (
    answer_for_prompt,
    build_toy_model,
    build_toy_reward_model,
    build_toy_tokenizer,
    exact_match,
    is_correct,
    make_tasks,
    preference_dataset,
    prompt_dataset,
    reward_fn,
    sft_dataset,
    toy_model_config,
)
from hf_rlhf.toy.chain import (
    ToyChainArguments,
    build_environment,
    build_with_recipe,
    check_answers,
    is_toy_run,
    toy_chain,
)
from hf_rlhf.toy.tasks import FAMILIES, slip_answer, task_of, wrong_answer

# ---- tasks -------------------------------------------------------------------------------------


def test_make_tasks_is_deterministic_by_seed():
    assert make_tasks(50, seed=3) == make_tasks(50, seed=3)
    assert make_tasks(50, seed=3) != make_tasks(50, seed=4)
    assert make_tasks(20, seed=3) == make_tasks(50, seed=3)[:20]


def test_splits_are_disjoint_and_cover_all_families():
    train = {r["prompt"] for r in make_tasks(3000, split="train")}
    test_rows = make_tasks(600, split="test")
    assert not train & {r["prompt"] for r in test_rows}
    assert {r["task"] for r in test_rows} == set(FAMILIES)
    with pytest.raises(ValueError):
        make_tasks(1, split="valid")


def test_answer_for_prompt_agrees_with_make_tasks(tokenizer):
    for r in make_tasks(300, seed=1) + make_tasks(100, seed=1, split="test"):
        assert answer_for_prompt(r["prompt"]) == r["answer"]
        assert task_of(r["prompt"]) == r["task"]
        conv = [{"role": "user", "content": r["prompt"]}]
        assert answer_for_prompt(conv) == r["answer"]
        # a prompt decoded from a rendered chat still yields its answer
        rendered = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert answer_for_prompt(rendered) == r["answer"]


def test_prompts_and_answers_are_short(tokenizer):
    rows = make_tasks(500)
    assert max(len(tokenizer(r["prompt"])["input_ids"]) for r in rows) < 40
    assert max(len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"]) for r in rows) <= 5


@pytest.mark.parametrize(
    "completion, ok",
    [("82", True), (" 82 ", True), ("\n82\n", True), ("82<|eos|>", True), (" 82 <|eos|> ", True),
     ("82<|eos|><|pad|><|pad|>", True), ("8 2", False), ("820", False), ("", False), ("82 83", False)],
)
def test_is_correct(completion, ok):
    assert is_correct(completion, "82") is ok


def test_reward_fn_with_and_without_answers():
    prompts, completions = ["37+45=", "reverse abc=", "sort cab="], ["82", " cba<|eos|>", "acb"]
    assert reward_fn(prompts, completions) == [1.0, 1.0, 0.0]
    assert reward_fn(prompts, completions, ["81", "cba", "acb"]) == [0.0, 1.0, 1.0]
    assert reward_fn(prompts, completions, answer=["82", "x", "acb"]) == [1.0, 0.0, 1.0]  # TRL style
    conv_p = [[{"role": "user", "content": p}] for p in prompts]
    conv_c = [[{"role": "assistant", "content": c}] for c in completions]
    assert reward_fn(conv_p, conv_c) == [1.0, 1.0, 0.0]


def test_wrong_answers_are_wrong_and_plausible():
    rng = random.Random(0)
    for r in make_tasks(600, seed=2):
        wrong = wrong_answer(r["prompt"], r["answer"], rng)
        assert wrong and wrong != r["answer"] and not is_correct(wrong, r["answer"])
        if r["task"] in ("add", "sub", "max", "count"):
            assert wrong.isdigit()


@pytest.mark.parametrize("prompt, answer, slip", [
    ("37+45=", "82", "37"), ("83-45=", "38", "83"), ("7+0=", "7", None), ("max 37 82 15=", "82", "37"),
    ("max 82 37=", "82", None), ("reverse kqbd=", "dbqk", "kqbd"), ("reverse aba=", "aba", None),
    ("sort kqbd=", "bdkq", "kqbd"), ("count a in abca=", "2", "4"), ("count a in aaaa=", "4", None),
])
def test_slip_answer_copies_from_the_prompt(prompt, answer, slip):
    assert slip_answer(prompt, answer) == slip


def test_slipped_demonstrations_and_slip_rejected_pairs():
    clean = sft_dataset(2000, seed=3)
    slipped = sft_dataset(2000, seed=3, slip_rate=0.5)
    assert list(slipped["prompt"]) == list(clean["prompt"])
    assert list(slipped["completion"]) == list(sft_dataset(2000, seed=3, slip_rate=0.5)["completion"])  # seeded
    changed = [(p, c) for p, c, a in zip(slipped["prompt"], slipped["completion"], clean["completion"]) if c != a]
    assert all(c == slip_answer(p, answer_for_prompt(p)) for p, c in changed)
    assert 0.4 < len(changed) / 2000 < 0.5  # half the rows, less those whose slip is the right answer
    assert list(sft_dataset(300, seed=3, slip_rate=0.0)["completion"]) == list(clean["completion"][:300])

    pairs = preference_dataset(1000, seed=3, rejected_slip_rate=1.0)
    slips = [slip_answer(p, c) for p, c in zip(pairs["prompt"], pairs["chosen"])]
    assert all(r == s for r, s in zip(pairs["rejected"], slips) if s is not None)
    assert all(r != c and not is_correct(r, c) for r, c in zip(pairs["rejected"], pairs["chosen"]))
    assert sum(s is None for s in slips) < 100  # the fallback (a plausible wrong answer) is rare
    with pytest.raises(ValueError, match="slip_rate"):
        sft_dataset(10, slip_rate=1.5)
    with pytest.raises(ValueError, match="rejected_slip_rate"):
        preference_dataset(10, rejected_slip_rate=-0.1)


def test_dataset_formats():
    pc = sft_dataset(8, format="prompt_completion")
    assert pc.column_names == ["prompt", "completion"]
    assert all(answer_for_prompt(p) == c and "<|eos|>" not in c for p, c in zip(pc["prompt"], pc["completion"]))
    text = sft_dataset(8, format="text")
    assert text["text"] == [p + c for p, c in zip(pc["prompt"], pc["completion"])]
    msgs = sft_dataset(8, format="messages")[0]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[0]["content"] == pc[0]["prompt"]
    conv = sft_dataset(8, format="conversational_prompt_completion")[0]
    assert conv["prompt"][0]["role"] == "user" and conv["completion"][0]["content"] == pc[0]["completion"]
    with pytest.raises(ValueError):
        sft_dataset(2, format="chatml")

    pref = preference_dataset(50, seed=1)
    assert pref.column_names == ["prompt", "chosen", "rejected"]
    assert all(reward_fn(pref["prompt"], pref["chosen"]))
    assert not any(reward_fn(pref["prompt"], pref["rejected"]))
    assert preference_dataset(50, seed=1)["rejected"] == pref["rejected"]
    conv_pref = preference_dataset(4, seed=1, conversational=True)[0]
    assert conv_pref["chosen"] == [{"role": "assistant", "content": pref[0]["chosen"]}]

    prompts = prompt_dataset(6, split="test", conversational=True)
    assert prompts.column_names == ["prompt", "answer"] and prompts[0]["prompt"][0]["role"] == "user"


# ---- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_special_tokens_and_digits(tokenizer):
    ids = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
    assert len(set(ids)) == 4 and None not in ids
    assert tokenizer.padding_side == "right" and tokenizer.model_max_length == 256 and len(tokenizer) < 300
    for d in "0123456789":
        assert len(tokenizer(d, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer("12+34=")["input_ids"][0] == tokenizer.bos_token_id
    assert tokenizer.decode(tokenizer("max 7 12=")["input_ids"], skip_special_tokens=True) == "max 7 12="
    # prompt + completion tokenizes as prompt tokens followed by completion tokens
    for r in make_tasks(50):
        joint = tokenizer(r["prompt"] + r["answer"])["input_ids"]
        apart = tokenizer(r["prompt"])["input_ids"] + tokenizer(r["answer"], add_special_tokens=False)["input_ids"]
        assert joint == apart


def test_chat_template_assistant_mask(tokenizer):
    msgs = [{"role": "user", "content": "37+45="}, {"role": "assistant", "content": "82"}]
    out = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    masked = [i for i, m in zip(ids, mask) if m]
    assert masked == tokenizer("82", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert mask[-len(masked) :] == [1] * len(masked) and sum(mask) == len(masked)
    assert ids[0] == tokenizer.bos_token_id
    gen = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert gen == "<|bos|><|user|>37+45=<|assistant|>"
    assert tokenizer.apply_chat_template(msgs, tokenize=False) == gen + "82<|eos|>"


def test_tokenizer_save_and_reload(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    saved = build_toy_tokenizer(str(tmp_path))
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), build_toy_tokenizer(str(tmp_path))):
        assert loaded.chat_template == tokenizer.chat_template
        assert loaded.pad_token_id == tokenizer.pad_token_id and loaded.padding_side == "right"
        texts = ["reverse abc=cba", "7+8=15 é", "<|user|>x<|assistant|>"]
        assert loaded(texts)["input_ids"] == saved(texts)["input_ids"] == tokenizer(texts)["input_ids"]


# ---- models ------------------------------------------------------------------------------------


def test_config_matches_tokenizer(tokenizer):
    for size in ("tiny", "small"):
        cfg = toy_model_config(tokenizer, size)
        assert cfg.vocab_size == len(tokenizer) and cfg.max_position_embeddings >= 256
        assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
            tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    with pytest.raises(ValueError):
        toy_model_config(tokenizer, "huge")


def test_model_forward_backward_and_seed(tokenizer, tiny_model):
    batch = tokenizer(["12+34=46", "sort cab=abc"], return_tensors="pt", padding=True)
    out = tiny_model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    out.loss.backward()
    assert tiny_model.dtype == torch.float32
    same, other = build_toy_model(tokenizer, seed=0), build_toy_model(tokenizer, seed=1)
    sd, sd1 = tiny_model.state_dict(), other.state_dict()
    assert all(torch.equal(v, same.state_dict()[k]) for k, v in sd.items())
    assert not torch.equal(sd["model.embed_tokens.weight"], sd1["model.embed_tokens.weight"])
    tiny_model.zero_grad(set_to_none=True)


def test_reward_model(tokenizer):
    rm = build_toy_reward_model(tokenizer, seed=0)
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tokenizer.pad_token_id
    batch = tokenizer(["1+1=2", "12+34=46"], return_tensors="pt", padding=True)
    scores = rm(**batch).logits
    assert scores.shape == (2, 1)
    # right padding must not change the score of the shorter row
    alone = rm(**tokenizer(["1+1=2"], return_tensors="pt")).logits
    torch.testing.assert_close(scores[0], alone[0])


def test_exact_match_is_a_fraction(tokenizer, tiny_model):
    acc = exact_match(tiny_model, tokenizer, prompt_dataset(16, split="test"), batch_size=8)
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    rows = make_tasks(8, split="test", families=["add"])
    assert 0.0 <= exact_match(tiny_model, tokenizer, [{"prompt": r["prompt"]} for r in rows]) <= 1.0
    assert 0.0 <= exact_match(tiny_model, tokenizer, prompt_dataset(4, conversational=True)) <= 1.0


# ---- the toy chain (hf_rlhf.toy.chain) ----------------------------------------------------------


def test_is_toy_run_means_no_dataset():
    assert is_toy_run(SimpleNamespace(dataset_name=None)) and is_toy_run(SimpleNamespace())
    assert not is_toy_run(SimpleNamespace(dataset_name="my/prompts"))


def test_check_answers_per_task_family():
    rows = prompt_dataset(30, seed=4, split="test")
    prompts, answers = list(rows["prompt"]), list(rows["answer"])
    completions = [a if i % 3 else "wrong" for i, a in enumerate(answers)]  # every third one wrong
    out = check_answers(prompts, completions, rows)
    assert out["exact_match"] == pytest.approx(20 / 30)
    for task, share in out["exact_match_by_task"].items():
        mine = [i for i, p in enumerate(prompts) if task_of(p) == task]
        assert share == pytest.approx(sum(1 for i in mine if i % 3) / len(mine))


def test_a_builds_child_leaves_the_launchs_process_group_and_keeps_its_threads():
    launched = {"OMP_NUM_THREADS": "1", "PATH": "/bin", "ACCELERATE_MIXED_PRECISION": "no"}
    ranked = {**launched, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert build_environment(ranked) == launched


RECORDING_RECIPE = """import json, os, sys

def main(argv):
    import torch

    if argv[0] == "stop":
        raise SystemExit("[hf_rlhf] the loss went non-finite")
    if argv[0] == "bad":
        raise ValueError("a bad option")
    json.dump({"argv": argv, "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
               "rank": os.environ.get("RANK"), "pid": os.getpid()}, open(argv[1], "w"))

if __name__ == "__main__":
    main(sys.argv[1:])
"""


def test_a_single_process_run_builds_here_on_every_core_and_reports_failure(tmp_path, monkeypatch):
    script, seen = tmp_path / "recipe.py", tmp_path / "seen.json"
    script.write_text(RECORDING_RECIPE)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    threads = torch.get_num_threads()
    for load in (0.3, 5.0):  # every core, whatever this process runs on; never the machine's load
        monkeypatch.setattr("os.getloadavg", lambda load=load: (load, load, load))
        build_with_recipe(str(script), ["ok", str(seen)])
    assert json.loads(seen.read_text()) == {"argv": ["ok", str(seen)], "threads": 3, "pid": os.getpid(),
                                            "omp": os.environ.get("OMP_NUM_THREADS"), "rank": None}
    assert torch.get_num_threads() == threads  # restored
    build_with_recipe(str(script), ["ok", str(seen)], threads=2)  # pinned
    assert json.loads(seen.read_text())["threads"] == 2
    with pytest.raises(RuntimeError, match="the loss went non-finite"):  # the recipe's own exit
        build_with_recipe(str(script), ["stop", str(seen)])
    with pytest.raises(ValueError, match="a bad option"):  # reaches the recipe's one-line error as it is
        build_with_recipe(str(script), ["bad", str(seen)])
    assert torch.get_num_threads() == threads


class TwoProcessState:
    """accelerate's `PartialState` on the main process of a 2-process launch."""
    num_processes, is_main_process = 2, True

    def main_process_first(self):
        return contextlib.nullcontext()


def test_under_a_multi_process_launch_the_main_process_builds_in_a_child(tmp_path, monkeypatch):
    script, seen = tmp_path / "recipe.py", tmp_path / "seen.json"
    script.write_text(RECORDING_RECIPE)
    monkeypatch.setattr("accelerate.PartialState", TwoProcessState)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)
    build_with_recipe(str(script), ["ok", str(seen)], threads=2)
    child = json.loads(seen.read_text())
    # a run of its own (no RANK), on the launcher's threads (the other rank holds the other cores)
    assert child["pid"] != os.getpid() and child["rank"] is None and child["omp"] == "1" and child["threads"] == 1
    with pytest.raises(RuntimeError, match="exit 1"):
        build_with_recipe(str(script), ["stop", str(seen)])


def test_toy_chain_uses_models_it_finds(tmp_path, tiny_model_dir, capsys):
    script_args = SimpleNamespace(reward_source="function", reward_model_path=None)
    toy_args = ToyChainArguments(sft_model_path=str(tiny_model_dir), toy_train_size=12, toy_test_size=5, toy_seed=1)
    model_config = SimpleNamespace(model_name_or_path=None)
    data = toy_chain(script_args, toy_args, model_config, str(tmp_path / "no-recipes-needed"))
    assert model_config.model_name_or_path == str(tiny_model_dir) and data.timings == {}
    assert len(data.train) == 12 and len(data.held_out) == 5 and data.held_out["prompt"] == list(
        prompt_dataset(5, seed=1, split="test")["prompt"])
    assert data.check is check_answers and data.score_fn is reward_fn
    assert script_args.reward_function == "hf_rlhf.toy:reward_fn"  # no function named: the toy task's own reward
    assert f"sft model: {tiny_model_dir} (found)" in capsys.readouterr().out
    # the reward model is a prerequisite only for reward_source=model, and is not built when building is off
    with pytest.raises(FileNotFoundError, match="no reward model at .*none; run recipes/reward.py first"):
        toy_chain(SimpleNamespace(reward_source="model", reward_model_path=str(tmp_path / "none")),
                  ToyChainArguments(sft_model_path=str(tiny_model_dir), build_missing=False), model_config, "")
