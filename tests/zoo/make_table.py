"""Run the model zoo and write its architectures x guarantees table into docs/architectures.md (between its markers).

    python tests/zoo/make_table.py                      # run tests/zoo, write tests/zoo/results.json and the page
    python tests/zoo/make_table.py --from-results       # only rebuild the table from tests/zoo/results.json

Every cell comes from the suite's outcomes: ✅ (every variant passed), refused (hf_rlhf refuses the layout when
the trainer is built, and the test checked that the refusal is true; the message is in a footnote), ❌ (a test
failed), or — (not run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results.json")
PAGE = os.path.join(ROOT, "docs", "architectures.md")
BEGIN, END = "<!-- zoo-table -->", "<!-- /zoo-table -->"

# column title -> (test functions, {param: value} the test must have, params that name a variant in a refusal)
COLUMNS = {
    "SFT `packing`": (["test_sft_packed_equals_each_example_alone_or_refuses"], {"layout": "packing"}, ["attn"]),
    "SFT `padding_free`": (["test_sft_packed_equals_each_example_alone_or_refuses"], {"layout": "padding_free"},
                           ["attn"]),
    "reward layouts, seq-cls": (["test_reward_layout_equals_each_sequence_alone_or_refuses"], {"kind": "seq_cls"},
                                ["layout"]),
    "reward layouts, value head": (["test_reward_layout_equals_each_sequence_alone_or_refuses"],
                                   {"kind": "value_head"}, ["layout"]),
    "left-padded batch = alone": (["test_left_padding_collator_batch_equals_each_row_alone",
                                   "test_get_rewards_of_a_left_padded_batch_equal_each_row_alone",
                                   "test_ppo_reward_scores_of_a_batch_equal_each_completion_alone",
                                   "test_generate_from_a_left_padded_batch_equals_each_prompt_alone"], {}, []),
    "PPO log-probs / values / reference = alone": (
        ["test_rollout_scoring_of_a_left_padded_batch_equals_each_row_alone"], {}, []),
    "LoRA save / reload / merge": (["test_lora_save_reload_merge_gives_the_same_logits",
                                    "test_lora_reward_adapter_with_its_head_reloads_to_the_same_rewards"], {}, []),
    "PPO trains": (["test_a_few_ppo_steps_train"], {}, []),
}
LEGEND = (
    "SFT: every token's loss and logits in a packed batch equal its example run alone (sdpa and eager). Reward "
    "layouts: right / left padding, `padding_free` and `prefix_sharing` give each sequence its reward alone. "
    "Left-padded batch: a forward of `LeftPaddingCollator`'s batch, `get_rewards`, PPO's reward model scoring and "
    "`generate` equal each row alone. PPO: the log-probs, values and reference log-probs of a left-padded rollout "
    "equal an unpadded single-row forward. LoRA: adapter save -> reload -> merge, and reward adapters with their "
    "heads, give the same logits / rewards. PPO trains: 2 steps change the policy and log `objective/kl`. "
    "Refused: the trainer raises when it is built (the test also checks that the layout really is inexact there).")


def run_suite(extra: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", os.path.relpath(HERE, ROOT), "-q", "-p", "no:cacheprovider",
           f"--zoo-results={RESULTS}", *extra]
    return subprocess.call(cmd, cwd=ROOT)


def cell(entries: list[dict], variant_keys: list[str], footnotes: list[str]) -> str:
    if not entries:
        return "—"
    if any(e["outcome"] == "failed" for e in entries):
        return "❌ " + ", ".join(sorted({"-".join(e["params"][k] for k in variant_keys) or e["test"]
                                         for e in entries if e["outcome"] == "failed"}))
    refused = [e for e in entries if e["outcome"] == "refused"]
    passed = [e for e in entries if e["outcome"] == "passed"]
    if not refused:
        return "✅" if passed else "—"
    if refused[0]["message"] not in footnotes:
        footnotes.append(refused[0]["message"])
    variants = sorted({"-".join(e["params"][k] for k in variant_keys) for e in refused})
    number = footnotes.index(refused[0]["message"]) + 1
    label = f"refused{' ' + ', '.join(v for v in variants if v) if any(variants) else ''} [{number}]"
    return ("✅ / " + label) if passed else label


def table(results: dict) -> str:
    entries = list(results.values())
    model_types = list(dict.fromkeys(e["params"]["model_type"] for e in entries if "model_type" in e["params"]))
    footnotes: list[str] = []
    lines = ["| architecture | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for model_type in model_types:
        row = []
        for tests, required, variant_keys in COLUMNS.values():
            selected = [e for e in entries if e["test"] in tests and e["params"].get("model_type") == model_type
                        and all(e["params"].get(k) == v for k, v in required.items())]
            row.append(cell(selected, variant_keys, footnotes))
        lines.append(f"| {model_type} | " + " | ".join(row) + " |")
    lines += ["", _wrap(LEGEND)] + ["\n" + _wrap(f"[{i}] {message}") for i, message in enumerate(footnotes, 1)]
    total = {k: sum(e["outcome"] == k for e in entries) for k in ("passed", "refused", "failed", "skipped")}
    lines += ["", f"Generated by `python tests/zoo/make_table.py` from {len(entries)} tests: "
                  + ", ".join(f"{n} {k}" for k, n in total.items() if n) + "."]
    return "\n".join(lines)


def _wrap(paragraph: str) -> str:
    """A paragraph in lines of at most 119 characters (markdown joins them again)."""
    return textwrap.fill(paragraph, width=119, break_long_words=False, break_on_hyphens=False)


def write_page(text: str, path: str = PAGE) -> None:
    """Replace what lies between the zoo-table markers of `path` with `text`."""
    with open(path, encoding="utf-8") as f:
        page = f.read()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers to write the table between")
    head, rest = page.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-results", action="store_true", help="do not run the suite; use results.json")
    args, extra = parser.parse_known_args(argv)
    status = 0 if args.from_results else run_suite(extra)
    with open(RESULTS) as f:
        write_page(table(json.load(f)))
    print(f"wrote the zoo table into {PAGE}")
    return status


if __name__ == "__main__":
    sys.exit(main())
