"""Checks every config runs when it is built: option names users still type from older TRL, and value types.

- `RENAMED`: old option names (TRL's, transformers') and the option that replaced them. A dataclass rejects an
  unknown keyword with a bare "unexpected keyword argument"; `renamed_options(*names)` wraps a config class's
  `__init__` so that those names are errors that name the new option instead, and `check_renamed(names, owner)`
  does the same for any list of names (trainer keywords, command-line options, YAML keys).
- `check_field_types(config)`: every field's value against its annotation (bool, int, float, str, None, Literal,
  `list[...]`, `dict`, unions of them, and `metadata["choices"]`), so `packing="false"` is an error instead of a
  truthy string that turns packing on. Called first in each config's `__post_init__`, i.e. on the values the user
  gave, before any conversion. Stricter than TRL on purpose.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import types
import typing

# old name -> (new name, what to do)
RENAMED: dict[str, tuple[str, str]] = {
    "max_seq_length": ("max_length", "TRL renamed SFTConfig.max_seq_length to max_length"),
    "init_kl_coef": ("kl_coef", "the initial KL coefficient β (TRL's PPOConfig renamed it kl_coef)"),
    "adap_kl_ctrl": ("kl_target", "set kl_target to a target KL for the adaptive controller, or leave it None for "
                                  "a fixed kl_coef"),
    "target": ("kl_target", "the adaptive KL controller's target KL; None for a fixed kl_coef"),
    "horizon": ("kl_horizon", "the adaptive KL controller's horizon"),
    "epsilon": ("cliprange", "TRL GRPOConfig's epsilon, the ratio's lower clip (and upper one unless epsilon_high "
                             "is set), is PPOConfig's cliprange"),
    "tokenizer": ("processing_class", "transformers and TRL renamed the trainer argument tokenizer to "
                                      "processing_class"),
}

# TrainingArguments converts some of its own fields in __post_init__ (fsdp, debug, report_to, ...): of its fields
# only these kinds are checked, which no conversion touches
_SAFE_TRAINING_ARGS_TYPES = (bool, int, float)


class RenamedOptionError(TypeError):
    """An option under an old (or another library's) name; the message names the option to use instead."""


def renamed_error(name: str, owner: str) -> TypeError:
    """The error for the old option `name` of `owner` (a class or function name)."""
    new, note = RENAMED[name]
    return RenamedOptionError(f"{owner}: {name!r} is no longer an option: use {new!r} ({note}).")


def check_renamed(names, owner: str, known=RENAMED) -> None:
    """Raise `renamed_error` for the first of `names` that is an old option name in `known`.

    Args:
        names: option or keyword names (e.g. a kwargs dict, or `--name` stripped of its dashes).
        owner: the class or function they were given to, for the message.
        known: the old names to look for (default: all of `RENAMED`).
    """
    for name in names:
        if name in known:
            raise renamed_error(name, owner)


def renamed_options(*names: str):
    """Class decorator: `cls(**kwargs)` with one of the old option `names` raises `renamed_error`.

    Apply it above `@dataclass` (it wraps the generated `__init__`); `HfArgumentParser` and `dataclasses.replace`
    keep working, as they call `cls(**fields)`.
    """
    unknown = [n for n in names if n not in RENAMED]
    if unknown:
        raise KeyError(f"no renamed option {unknown}; add it to RENAMED")

    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            check_renamed([n for n in kwargs if n in names], cls.__name__)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls

    return decorate


# ---------------------------------------------------------------------------------------------------
# Types


@functools.cache
def _type_hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be resolved here: such fields are not checked
        return {}


def _describe(tp) -> str:
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is not None:  # list[str], dict[str, Any]
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _alternatives(tp) -> tuple | None:
    """The members of a union annotation, or (tp,); None when some member is not a kind this module checks."""
    origin = typing.get_origin(tp)
    members = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
    for member in members:
        base = typing.get_origin(member) or member
        if base not in (bool, int, float, str, type(None), list, dict, typing.Literal):
            return None
    return members


def _matches(value, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin is list or tp is list:
        args = typing.get_args(tp)
        if isinstance(value, str):  # "all-linear", a single module name: TRL and peft take a string too
            return not args or args[0] is str
        return isinstance(value, (list, tuple)) and (not args or all(_matches(v, args[0]) for v in value))
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, (str, os.PathLike))
    return True


def field_type_error(config, name: str, value, tp) -> str | None:
    """Why `value` does not fit field `name` of `config` (annotation `tp`), or None when it fits.

    Args:
        config: the config instance or class (for its name and the field's choices).
        name: the field's name.
        value: the value to check.
        tp: the field's resolved annotation.
    """
    alternatives = _alternatives(tp)
    if alternatives is None:
        return None
    owner = config.__name__ if isinstance(config, type) else type(config).__name__
    if not any(_matches(value, alt) for alt in alternatives):
        expected = " or ".join(_describe(alt) for alt in alternatives)
        hint = " (pass True or False: any non-empty string is truthy)" if bool in alternatives and isinstance(
            value, str) else ""
        return f"{owner}.{name} must be {expected}, got {value!r} ({type(value).__name__}){hint}"
    choices = next((f.metadata.get("choices") for f in dataclasses.fields(config) if f.name == name), None)
    if choices is not None and isinstance(value, str) and value not in list(choices):
        return f"{owner}.{name}={value!r}; expected one of {list(choices)}"
    return None


def check_field_types(config) -> None:
    """Raise a TypeError (ValueError for a value outside the field's choices) naming the first field whose value
    does not fit its annotation.

    Fields of `transformers.TrainingArguments` itself are checked only where they are bool, int or float (optionally
    None); its own `__post_init__` converts the others (strategies, fsdp, report_to, ...).

    Args:
        config: a dataclass instance (a config), before its `__post_init__` converts anything.
    """
    from transformers import TrainingArguments

    hints = _type_hints(type(config))
    training_args = {f.name for f in dataclasses.fields(TrainingArguments)} if isinstance(
        config, TrainingArguments) else set()
    for f in dataclasses.fields(config):
        if f.name not in hints or not f.init:
            continue
        tp = hints[f.name]
        if f.name in training_args:
            alternatives = _alternatives(tp)
            if alternatives is None or not all(a in _SAFE_TRAINING_ARGS_TYPES or a is type(None)
                                               for a in alternatives):
                continue
        message = field_type_error(config, f.name, getattr(config, f.name), tp)
        if message is not None:
            raise (ValueError if "; expected one of" in message else TypeError)(message + ".")
