"""The data options every trainer config inherits: input checks, over-long rows, prompt tokenization.

Dataset preparation reads a `DataOptions` (`SFTDataOptions` for SFT data, `PreferenceDataOptions` for
pairs); `SFTConfig` and `RewardConfig` inherit those, so a trainer config is passed to `hf_rlhf.data` as
is, and code without a trainer config (PPO's ptx data, tests) builds a plain `DataOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers import TrainingArguments

from ..trainers.config_checks import check_field_types, renamed_options

OVERLONG_CHOICES = ["truncate", "drop", "error"]


PROMPT_TOKENIZATION_CHOICES = ["apart", "joint"]  # as `hf_rlhf.data.tokenization.PROMPT_TOKENIZATIONS`


@dataclass
class InputCheckOptions:
    """How strict the up-front input checks are (`hf_rlhf.data.check_unknown_tokens`); in every trainer config.

    Args:
        max_unk_share: a row with more than this share of the tokenizer's unknown token cannot be represented by it.
        strict: such rows are an error (naming the first); else their count is logged as a warning.
    """

    max_unk_share: float = field(
        default=0.1, metadata={"help": "Largest share of unknown tokens a row may have before it is reported."})
    strict: bool = field(default=False, metadata={"help": "Rows above max_unk_share are an error, not a warning."})


@renamed_options("max_seq_length")
@dataclass
class DataOptions(InputCheckOptions):
    """Dataset preparation options shared by SFT and reward data (mixed into `SFTConfig` and `RewardConfig`).

    Usable alone where no trainer config exists, e.g. `DataOptions(max_length=None)` for PPO's ptx data.

    Args:
        dataset_num_proc: processes for `Dataset.map` while tokenizing; None: this process only.
        max_length: longest tokenized sequence; None: no limit.
        overlong_policy: a sequence longer than `max_length`: `truncate` (keep the start), `drop`, or `error`.
        chat_template_path: a tokenizer directory or a Jinja file whose template replaces the tokenizer's one.
        eos_token: the token appended to plain text; None: the tokenizer's eos token.
        pad_token: the padding token; None: the tokenizer's (read by the trainers, `ensure_pad_token`).
        prompt_tokenization: the prompt / completion boundary of plain-text prompt data where tokens merge across
            it (a prompt ending in a space: "3+4? " + "7"). `apart` (default): the prompt's own tokens, then the
            completion's, as the model sees them at inference. `joint`: prompt + completion tokenized as one text,
            the completion starting where its tokens diverge from the prompt's own: TRL's, to reproduce TRL's losses
            exactly. The number of rows it changes is logged once per dataset (in memory; a stream is not counted
            ahead). Conversations go through the chat template either way; for SFT's conversational prompt /
            completion rows whose template renders the prompt differently when a completion follows, `apart` is an
            error naming the row, `joint` starts the completion where they diverge (TRL's).
    """

    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset preparation."})
    max_length: int | None = field(default=1024, metadata={"help": "Longest tokenized sequence."})
    overlong_policy: str = field(
        default="truncate",
        metadata={"help": "Sequences longer than max_length: truncate (keep the start), drop, or error.",
                  "choices": OVERLONG_CHOICES},
    )
    chat_template_path: str | None = field(default=None, metadata={"help": "Tokenizer dir or Jinja file."})
    eos_token: str | None = field(default=None, metadata={"help": "End-of-sequence token. None: the tokenizer's."})
    pad_token: str | None = field(default=None, metadata={"help": "Padding token. None: the tokenizer's."})
    prompt_tokenization: str = field(
        default="apart",
        metadata={"help": "Where tokens merge across the prompt/completion boundary: apart (as at inference) or "
                          "joint (TRL's tokenization, its losses exactly).", "choices": PROMPT_TOKENIZATION_CHOICES},
    )

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self, TrainingArguments):  # a trainer config checked every field already
            check_field_types(self)
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"{name}.max_length must be >= 2, got {self.max_length}.")
        if not 0 <= self.max_unk_share <= 1:
            raise ValueError(f"{name}.max_unk_share must be in [0, 1], got {self.max_unk_share}.")
        if self.overlong_policy not in OVERLONG_CHOICES:
            raise ValueError(f"{name}.overlong_policy={self.overlong_policy!r}; expected one of {OVERLONG_CHOICES}.")
        if self.prompt_tokenization not in PROMPT_TOKENIZATION_CHOICES:
            raise ValueError(f"{name}.prompt_tokenization={self.prompt_tokenization!r}; expected one of "
                             f"{PROMPT_TOKENIZATION_CHOICES}.")
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:  # mixed into a TrainingArguments: its own __post_init__ runs next
            parent()

    @classmethod
    def from_options(cls, options: DataOptions):
        """`options` as a `cls` (e.g. `SFTDataOptions`): itself when it is one (a trainer config), else its
        `DataOptions` fields with `cls`'s defaults for the rest.

        Raises:
            TypeError: `options` is not a `DataOptions` (duck-typed args are not accepted).
        """
        if isinstance(options, cls):
            return options
        if not isinstance(options, DataOptions):
            raise TypeError(f"options must be a DataOptions (a trainer config, {cls.__name__}(...) or "
                            f"DataOptions(...)), got {type(options).__name__}")
        return cls(**{f.name: getattr(options, f.name) for f in fields(DataOptions)})


@renamed_options("max_seq_length")
@dataclass
class SFTDataOptions(DataOptions):
    """`DataOptions` plus what only SFT data reads; `SFTConfig` is one. Defaults and help texts are SFT's.

    Args:
        dataset_text_field: column of plain-text datasets.
        completion_only_loss: loss on the completion only (None: yes for prompt/completion data); truncation
            must leave a completion token, or the example is dropped.
        assistant_only_loss: loss on assistant turns only (conversational data; the chat template must mark them).
    """

    max_length: int | None = field(default=1024, metadata={"help": "Longest tokenized example / packed row length."})
    overlong_policy: str = field(
        default="truncate",
        metadata={"help": "Examples longer than max_length: truncate (keep the start), drop, or error.",
                  "choices": OVERLONG_CHOICES},
    )
    eos_token: str | None = field(default=None, metadata={"help": "End-of-turn token. None: the tokenizer's."})
    dataset_text_field: str = field(default="text", metadata={"help": "Column of plain-text datasets."})
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "Loss on completions only. None: yes for prompt/completion datasets."}
    )
    assistant_only_loss: bool = field(default=False, metadata={"help": "Loss on assistant turns only."})


@renamed_options("max_seq_length")
@dataclass
class PreferenceDataOptions(DataOptions):
    """`DataOptions` plus what only preference pairs read; `RewardConfig` is one. Defaults and help are its.

    Args:
        overlong_policy: defaults to `drop` (TRL filters over-long pairs); see `RewardConfig`.
        use_margin: use the dataset's `margin` column. None: when the column is there.
    """

    max_length: int | None = field(default=1024, metadata={"help": "Longest tokenized chosen or rejected sequence."})
    overlong_policy: str = field(
        default="drop",
        metadata={"help": "Pairs with a side longer than max_length: drop, truncate (keep the start; pairs left "
                          "identical are dropped), or error.", "choices": OVERLONG_CHOICES},
    )
    use_margin: bool | None = field(
        default=None, metadata={"help": "Use the 'margin' column in the loss. None: when the dataset has one."}
    )
