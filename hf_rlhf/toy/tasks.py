"""Seeded toy instruction tasks with checkable answers, their evaluator and dataset builders.

Every prompt is one short line that ends with ``=``; the answer follows it directly, with no
separator, and never contains the eos text (the SFT trainer appends eos itself)::

    family    prompt               answer
    add       "37+45="             "82"      two numbers in 0..99
    sub       "83-45="             "38"      a >= b, both in 0..99
    reverse   "reverse kqbd="      "dbqk"    3..5 letters
    sort      "sort kqbd="         "bdkq"    3..5 letters
    max       "max 37 82 15="      "82"      3..4 numbers in 0..99
    count     "count a in abca="   "2"       how often a letter occurs in 4..8 letters

The toy tokenizer is character level, so tokenizing ``prompt + answer`` always splits cleanly at
the boundary. The prompt alone determines the answer (`answer_for_prompt`), which lets a reward
function score completions without a stored answer. A prompt belongs to the train or the test split
by a hash of its text, so the splits never share a prompt whatever the seed.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable

from ..generation import generate_completions

EOS_TEXT = "<|eos|>"
PAD_TEXT = "<|pad|>"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEST_FRACTION = 0.1
SPLITS = ("train", "test")


def _letters(rng: random.Random, lo: int, hi: int, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _add(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


def _sub(rng):
    a, b = sorted((rng.randint(0, 99), rng.randint(0, 99)), reverse=True)
    return f"{a}-{b}=", str(a - b)


def _reverse(rng):
    s = _letters(rng, 3, 5)
    return f"reverse {s}=", s[::-1]


def _sort(rng):
    s = _letters(rng, 3, 5)
    return f"sort {s}=", "".join(sorted(s))


def _max(rng):
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 4))]
    return f"max {' '.join(map(str, xs))}=", str(max(xs))


def _count(rng):
    # a small alphabet makes counts above 1 common, so the answer is not almost always "1"
    s = _letters(rng, 4, 8, alphabet="abcde")
    c = rng.choice(s) if rng.random() < 0.8 else rng.choice("abcde")
    return f"count {c} in {s}=", str(s.count(c))


FAMILIES: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "sub": _sub,
    "reverse": _reverse,
    "sort": _sort,
    "max": _max,
    "count": _count,
}


def split_of(prompt: str) -> str:
    """The split a prompt belongs to, from a stable hash of its text (not Python's `hash`)."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return "test" if h % 1000 < TEST_FRACTION * 1000 else "train"


def make_tasks(
    n: int, seed: int = 0, split: str = "train", families: list[str] | None = None
) -> list[dict]:
    """Sample `n` tasks of the given split, deterministically for a seed.

    Families are drawn uniformly; prompts may repeat within a split (small families like `count`
    have few distinct prompts) but never across splits.

    Returns:
        list of dicts with "prompt" (str), "answer" (str) and "task" (the family name).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    names = list(families or FAMILIES)
    # a str seed is hashed with sha512 by `random`, so this is stable across processes
    rng = random.Random(f"hf_rlhf.toy:{seed}:{split}")
    rows = []
    while len(rows) < n:
        task = rng.choice(names)
        prompt, answer = FAMILIES[task](rng)
        if split_of(prompt) == split:
            rows.append({"prompt": prompt, "answer": answer, "task": task})
    return rows


_PATTERNS: list[tuple[re.Pattern, Callable[[re.Match], str]]] = [
    (re.compile(r"(\d+)\+(\d+)="), lambda m: str(int(m[1]) + int(m[2]))),
    (re.compile(r"(\d+)-(\d+)="), lambda m: str(int(m[1]) - int(m[2]))),
    (re.compile(r"reverse ([a-z]+)="), lambda m: m[1][::-1]),
    (re.compile(r"sort ([a-z]+)="), lambda m: "".join(sorted(m[1]))),
    (re.compile(r"max ([\d ]+)="), lambda m: str(max(int(x) for x in m[1].split()))),
    (re.compile(r"count ([a-z]) in ([a-z]+)="), lambda m: str(m[2].count(m[1]))),
]


def task_of(prompt: str) -> str:
    """The family name of a toy prompt (plain or conversational)."""
    text = _prompt_text(prompt)
    for name, (pattern, _) in zip(FAMILIES, _PATTERNS):
        if pattern.fullmatch(text):
            return name
    raise ValueError(f"not a toy task prompt: {text!r}")


def answer_for_prompt(prompt: str | list[dict]) -> str:
    """Compute the answer from the prompt text alone.

    Args:
        prompt: a plain prompt, or a conversation whose last user message is the prompt. Text a
            chat template or a tokenizer added around it (bos, role markers) is ignored.
    """
    text = _prompt_text(prompt)
    for pattern, solve in _PATTERNS:
        m = pattern.search(text)
        if m and text.endswith(m[0]):
            return solve(m)
    raise ValueError(f"not a toy task prompt: {text!r}")


def _prompt_text(prompt: str | list[dict]) -> str:
    if isinstance(prompt, list):
        prompt = [m["content"] for m in prompt if m["role"] == "user"][-1]
    # a decoded query may carry a generation prompt after the task line; the task ends at "="
    return prompt[: prompt.rindex("=") + 1] if "=" in prompt else prompt


def is_correct(completion: str, answer: str) -> bool:
    """Strict check: the completion, without surrounding whitespace and trailing eos/pad text,
    equals the answer."""
    text = completion.strip()
    # decoding without skip_special_tokens leaves eos, and pads after it in a batch
    while text.endswith((EOS_TEXT, PAD_TEXT)):
        text = text.removesuffix(EOS_TEXT).removesuffix(PAD_TEXT).rstrip()
    return text == answer.strip()


def _completion_text(completion: str | list[dict]) -> str:
    # TRL passes conversational completions as a list of assistant messages
    if isinstance(completion, list):
        return "".join(m["content"] for m in completion)
    return completion


def reward_fn(
    prompts: list, completions: list, answers: list[str] | None = None, **kwargs
) -> list[float]:
    """1.0 for an exactly correct completion, else 0.0.

    Usable as a TRL reward function: a dataset column "answer" arrives as the `answer` keyword.

    Args:
        prompts: plain or conversational prompts, length B.
        completions: plain or conversational completions, length B.
        answers: the expected answers; recomputed from the prompts when None.

    Returns:
        list of B floats.
    """
    answers = answers if answers is not None else kwargs.get("answer")
    if answers is None:
        answers = [answer_for_prompt(p) for p in prompts]
    return [float(is_correct(_completion_text(c), a)) for c, a in zip(completions, answers)]


def wrong_answer(prompt: str, answer: str, rng: random.Random) -> str:
    """A plausible but wrong answer: off by one or ten, a changed digit, a swap, a copy of the input."""
    task = task_of(prompt)
    args = prompt.rstrip("=").split()[-1]
    candidates: list[str] = []
    if task in ("add", "sub", "max", "count"):
        v = int(answer)
        candidates += [str(v + 1), str(v - 1)]
        if task != "count":
            candidates += [str(v + 10), str(v - 10)]
            i = rng.randrange(len(answer))
            candidates.append(answer[:i] + str(rng.randrange(10)) + answer[i + 1 :])
        if task == "max":
            candidates += prompt.rstrip("=").split()[1:]  # another list element
    else:
        i = rng.randrange(len(answer) - 1)
        candidates += [
            answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :],  # adjacent swap
            args,  # the input copied unchanged
            answer[:-1],  # a letter dropped
            answer + answer[-1],  # a letter repeated
            answer[:i] + rng.choice(LETTERS) + answer[i + 1 :],  # a letter changed
        ]
    valid = [c for c in candidates if c != answer and c and not c.startswith("-")]
    valid = [c for c in valid if c == "0" or not c.startswith("0")]
    return rng.choice(valid)


def slip_answer(prompt: str, answer: str) -> str | None:
    """The toy demonstrator's systematic slip: an answer copied from the prompt instead of worked out.

    add / sub: the first operand; max: the first number listed; reverse / sort: the input letters unchanged;
    count: the length of the string (every letter counted). None where the slip happens to be the right answer.
    It stands for the systematic mistakes of human demonstrations that imitation learns and preferences expose:
    SFT on slipped demonstrations (`sft_dataset(slip_rate=...)`) makes the slip a mode of the policy, a reward
    model learns to reject it from pairs (`preference_dataset(rejected_slip_rate=...)`), and PPO has to move the
    policy off it, which the verifiable exact match measures.
    """
    task = task_of(prompt)
    body = prompt.rstrip("=")
    if task in ("add", "sub"):
        slip = re.split(r"[+-]", body)[0]
    elif task == "max":
        slip = body.split()[1]
    elif task in ("reverse", "sort"):
        slip = body.split()[-1]
    else:  # count c in s
        slip = str(len(body.split()[-1]))
    return None if slip == answer else slip


# ---------------------------------------------------------------------------------------------
# dataset builders
# ---------------------------------------------------------------------------------------------

SFT_FORMATS = ("prompt_completion", "text", "messages", "conversational_prompt_completion")


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def sft_dataset(n: int, seed: int = 0, split: str = "train", format: str = "prompt_completion",
                slip_rate: float = 0.0):
    """Supervised examples in one of the TRL dataset formats.

    Args:
        format: "prompt_completion" (prompt, completion: str), "text" (prompt + completion),
            "messages" (a user and an assistant message) or "conversational_prompt_completion"
            (prompt: [user message], completion: [assistant message]). No format contains eos.
        slip_rate: the share of rows (seeded) whose completion is the demonstrator's `slip_answer`
            instead of the right one (rows where the slip is right keep the answer).
    """
    from datasets import Dataset

    if not 0.0 <= slip_rate <= 1.0:
        raise ValueError(f"slip_rate must be in [0, 1], got {slip_rate}")
    rows = make_tasks(n, seed, split)
    if slip_rate > 0:
        rng = random.Random(f"hf_rlhf.toy.slip:{seed}:{split}")
        for r in rows:
            slip = slip_answer(r["prompt"], r["answer"])
            if rng.random() < slip_rate and slip is not None:
                r["answer"] = slip
    if format == "prompt_completion":
        cols = {"prompt": [r["prompt"] for r in rows], "completion": [r["answer"] for r in rows]}
    elif format == "text":
        cols = {"text": [r["prompt"] + r["answer"] for r in rows]}
    elif format == "messages":
        cols = {"messages": [_user(r["prompt"]) + _assistant(r["answer"]) for r in rows]}
    elif format == "conversational_prompt_completion":
        cols = {
            "prompt": [_user(r["prompt"]) for r in rows],
            "completion": [_assistant(r["answer"]) for r in rows],
        }
    else:
        raise ValueError(f"format must be one of {SFT_FORMATS}, got {format!r}")
    return Dataset.from_dict(cols)


def preference_dataset(n: int, seed: int = 0, split: str = "train", conversational: bool = False,
                       rejected_slip_rate: float = 0.0):
    """Pairs whose chosen completion is the correct answer and rejected a wrong one.

    Args:
        rejected_slip_rate: the share of pairs (seeded) whose rejected answer is the demonstrator's
            `slip_answer`; the others (and pairs where the slip is right) get a plausible `wrong_answer`.

    Returns:
        a `datasets.Dataset` with "prompt", "chosen", "rejected" (strings, or message lists when
        `conversational`).
    """
    from datasets import Dataset

    if not 0.0 <= rejected_slip_rate <= 1.0:
        raise ValueError(f"rejected_slip_rate must be in [0, 1], got {rejected_slip_rate}")
    rows = make_tasks(n, seed, split)
    rng = random.Random(f"hf_rlhf.toy.rejected:{seed}:{split}")
    rejected = []
    for r in rows:
        slip = slip_answer(r["prompt"], r["answer"])
        # the rng draws only when the rate is set, so rate 0 keeps the wrong answers of slip-free pairs
        use_slip = rejected_slip_rate > 0 and rng.random() < rejected_slip_rate and slip is not None
        rejected.append(slip if use_slip else wrong_answer(r["prompt"], r["answer"], rng))
    wrap_p, wrap_c = (_user, _assistant) if conversational else (str, str)
    return Dataset.from_dict(
        {
            "prompt": [wrap_p(r["prompt"]) for r in rows],
            "chosen": [wrap_c(r["answer"]) for r in rows],
            "rejected": [wrap_c(x) for x in rejected],
        }
    )


def unpaired_dataset(n: int, seed: int = 0, split: str = "train", conversational: bool = False,
                     rejected_slip_rate: float = 0.0):
    """KTO's unpaired rows: the `preference_dataset` pairs split as trl's `unpair_preference_dataset` does (each
    pair's chosen completion with label True, its rejected one with label False), shuffled (seeded) so that a batch
    mixes both labels.

    Returns:
        a `datasets.Dataset` of 2n rows with "prompt", "completion", "label".
    """
    from trl.data_utils import unpair_preference_dataset

    pairs = preference_dataset(n, seed, split, conversational, rejected_slip_rate)
    return unpair_preference_dataset(pairs).shuffle(seed=seed).flatten_indices()


def prompt_dataset(n: int, seed: int = 0, split: str = "train", conversational: bool = False):
    """Prompts for RL, with their answers for the reward function.

    Returns:
        a `datasets.Dataset` with "prompt" (str, or [user message] when `conversational`) and
        "answer" (str).
    """
    from datasets import Dataset

    rows = make_tasks(n, seed, split)
    wrap = _user if conversational else str
    return Dataset.from_dict(
        {"prompt": [wrap(r["prompt"]) for r in rows], "answer": [r["answer"] for r in rows]}
    )


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------


def exact_match(
    model, tokenizer, dataset_or_rows, max_new_tokens: int | None = None, batch_size: int = 64
) -> float:
    """Fraction of prompts whose greedy completion is exactly the answer.

    Args:
        dataset_or_rows: a `datasets.Dataset` or list of dicts with "prompt" and optionally
            "answer" (recomputed from the prompt when missing).
        max_new_tokens: default: the longest answer in tokens, plus 2 (room for eos).

    Returns:
        a float in [0, 1].
    """
    rows = list(dataset_or_rows)
    if not rows:
        return 0.0
    prompts = [r["prompt"] for r in rows]
    answers = [r.get("answer") or answer_for_prompt(r["prompt"]) for r in rows]
    if max_new_tokens is None:
        lengths = tokenizer(answers, add_special_tokens=False)["input_ids"]
        max_new_tokens = max(len(x) for x in lengths) + 2
    completions = generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size)
    return sum(reward_fn(prompts, completions, answers)) / len(rows)
