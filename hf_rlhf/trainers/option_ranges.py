"""Range checks of numeric options, run by every trainer config's `__post_init__` before any work.

One rule table over field names, so a new option named like the others is checked without a line of its own: a
negative learning rate, a zero batch size or a NaN weight decay fails when the config is built (on the command
line: while parsing), not inside `train()` after the data and the model were prepared.
"""

from __future__ import annotations

import math
from dataclasses import fields

# (name suffix, lower bound, bound included): the first matching rule applies; names in EXACT win over suffixes
EXACT = {
    "num_train_epochs": (0, True),
    "max_steps": None,  # -1 (use num_train_epochs) or a positive count: checked on its own
    "seed": None,
    "local_rank": None,
}
SUFFIX_RULES = (
    ("batch_size", 1, True),
    ("accumulation_steps", 1, True),
    ("logging_steps", 0, False),
    ("save_steps", 0, False),
    ("eval_steps", 0, False),
    ("_epochs", 1, True),
    ("num_mini_batches", 1, True),
    ("_length", 1, True),
    ("num_proc", 1, True),
    ("adam_epsilon", 0, False),
    ("learning_rate", 0, True),
    ("weight_decay", 0, True),
    ("warmup_steps", 0, True),
    ("max_grad_norm", 0, True),
    ("smoothing_factor", 0, True),
    ("num_workers", 0, True),
    ("_coef", 0, True),
    ("share", 0, True),
)


def _bound(name: str):
    if name in EXACT:
        return EXACT[name]
    for suffix, low, inclusive in SUFFIX_RULES:
        if name.endswith(suffix):
            return low, inclusive
    return None


def check_option_ranges(config) -> None:
    """Raise ValueError naming the first numeric option of `config` out of its range (see `SUFFIX_RULES`).

    Args:
        config: a dataclass instance (a trainer config); None values and booleans are not checked.

    Raises:
        ValueError: "SFTConfig.learning_rate must be >= 0, got -0.1."
    """
    owner = type(config).__name__
    for f in fields(config):
        value = getattr(config, f.name, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if f.name == "max_steps":
            if value != -1 and value <= 0:
                raise ValueError(f"{owner}.max_steps must be -1 (use num_train_epochs) or > 0, got {value}.")
            continue
        bound = _bound(f.name)
        if bound is None:
            continue
        low, inclusive = bound
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise ValueError(f"{owner}.{f.name} must be {'>=' if inclusive else '>'} {low}, got {value}.")
