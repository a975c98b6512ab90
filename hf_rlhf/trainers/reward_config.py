"""`RewardConfig`: pairwise reward-model options, a `transformers.TrainingArguments` (TRL's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..data.options import PreferenceDataOptions
from .base_config import (
    PAD_TO_MULTIPLE_OF_HELP,
    DeviceDefaultsMixin,
    NonFiniteOptions,
    TrainerModelOptions,
    resolve_pad_to_multiple_of,
)
from .config_checks import check_field_types, renamed_options


@renamed_options("max_seq_length")
@dataclass
class RewardConfig(PreferenceDataOptions, TrainerModelOptions, NonFiniteOptions, DeviceDefaultsMixin,
                   TrainingArguments):
    """Pairwise reward-model training options (a `TrainingArguments`).

    Data (`PreferenceDataOptions`, read by `hf_rlhf.data.prepare_preference_dataset`):
        max_length: longest tokenized chosen or rejected sequence.
        overlong_policy: a pair with a side longer than `max_length`: `drop` (the default, as TRL filters such
            pairs), `truncate` (keep the start of both; a pair whose truncated sides are identical is dropped, as
            the cut removed every token where they differ), or `error`. The number affected is logged.
        use_margin: use the dataset's `margin` column in the loss. None: when the column is there.
        dataset_num_proc, eos_token, pad_token, chat_template_path, prompt_tokenization: see `DataOptions`
            (`prompt_tokenization='joint'` tokenizes prompt + chosen / rejected as TRL does, where tokens merge
            across the boundary).
    Batches:
        padding_side: `right` or `left` padding of padded batches (rewards are read at each sequence's last real
            token either way).
        padding_free: flatten each batch of pairs into one row (restarted `position_ids`, no padding); rewards are
            gathered at each sequence's own last token. Pays off with flash attention.
        prefix_sharing: run each pair as one row [shared prefix | chosen tail | rejected tail] whose rejected
            tail cannot see the chosen tail (a 4D mask), so the prompt is computed once per pair instead of twice.
            Same rewards as the padded path; needs `sdpa` or `eager` attention.
        packing_check: with `padding_free` or `prefix_sharing`, check before training that two short sequences
            get the same outputs laid out so and apart, and refuse the architecture otherwise (OPT with
            padding_free; sliding-window models with prefix_sharing beyond their window);
            `hf_rlhf.models.packing_check`. A few milliseconds; False skips it.
        pad_to_multiple_of: round padded lengths (or the packed row) up to a multiple of this.
    Loss:
        center_rewards_coefficient: weight of mean((r_chosen + r_rejected)^2), which pulls rewards towards zero
            mean (Eisenstein et al. 2023, https://huggingface.co/papers/2312.09244, Eq. 2). TRL recommends 0.01.
        disable_dropout: turn dropout off in the model (as TRL does).
    Model (`TrainerModelOptions`): model_init_kwargs, trust_remote_code, activation_offloading.
    For PPO:
        store_reward_stats: after `train()`, compute the mean and std of the rewards of the train set's chosen and
            rejected sequences and store them as `config.reward_mean` / `config.reward_std` (written with the
            model, and to `reward_stats.json`), so that a PPO run can normalise scores.
        reward_stats_num_samples: compute those statistics over this many training pairs drawn at random
            (seeded by `seed`); None: all of them.
    """

    learning_rate: float = field(default=1e-4, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X updates steps."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. None: on for CUDA with bf16, off on CPU."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model."})
    padding_side: str = field(
        default="right", metadata={"help": "Padding side of padded batches.", "choices": ["right", "left"]}
    )
    padding_free: bool = field(default=False, metadata={"help": "Flatten each batch of pairs into one row."})
    prefix_sharing: bool = field(
        default=False, metadata={"help": "Compute the prefix chosen and rejected share once per pair (sdpa/eager)."}
    )
    packing_check: bool = field(
        default=True, metadata={"help": "Check that padding_free / prefix_sharing is exact on the model (a few ms)."}
    )
    pad_to_multiple_of: int | str | None = field(default=None, metadata={"help": PAD_TO_MULTIPLE_OF_HELP})
    center_rewards_coefficient: float | None = field(
        default=None, metadata={"help": "Weight of mean((r_chosen + r_rejected)^2). Recommended: 0.01."}
    )
    store_reward_stats: bool = field(
        default=False, metadata={"help": "After training, store the train set's reward mean/std in the model config."}
    )
    reward_stats_num_samples: int | None = field(
        default=None, metadata={"help": "Training pairs (a seeded random sample) the reward stats use. None: all."}
    )

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]

    def __post_init__(self):
        check_field_types(self)
        self._resolve_device_defaults()
        self._check_model_options()
        super().__post_init__()  # PreferenceDataOptions' checks, then TrainingArguments' (JSON dict fields parsed)
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, "RewardConfig")
        if self.padding_free and self.prefix_sharing:
            raise ValueError("RewardConfig: padding_free and prefix_sharing are two different batch layouts; "
                             "choose one.")
        if self.reward_stats_num_samples is not None and self.reward_stats_num_samples < 1:
            raise ValueError(
                f"RewardConfig.reward_stats_num_samples must be >= 1, got {self.reward_stats_num_samples}.")
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ValueError(f"RewardConfig.center_rewards_coefficient must be >= 0, got "
                             f"{self.center_rewards_coefficient}.")
