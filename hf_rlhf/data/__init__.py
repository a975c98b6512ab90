"""Dataset formats, row validation and tokenization for every trainer.

    validation.py    DataValidationError (row, field, expected, got), row access, field checks
    tokenization.py  tokenizer set-up (chat template, pad / eos tokens, leading special ids), prompt+completion
                     tokenization, the over-long policy
    options.py       the data options every trainer config inherits (`DataOptions`, `SFTDataOptions`, ...)
    chatml.py        ShareGPT rows to ChatML; per-row `tools` / `chat_template_kwargs`
    sft.py           SFT formats and `prepare_sft_dataset`
    preference.py    preference-pair formats and `prepare_preference_dataset`
    dpo.py           DPO pairs tokenized as TRL's `DPOTrainer` does (`prepare_dpo_dataset`)
    kto.py           KTO's unpaired rows (or pairs split), tokenized with their mismatched completions
    streaming.py     streamed (`IterableDataset`) data: first-row look-ahead, lazy validation and over-long policy
    raw_files.py     .json / .jsonl files read as written before `datasets` loads them (file errors with the line)

Both entry points take a `DataOptions` (`hf_rlhf.data.options`): a trainer config, which is one, or a plain
`DataOptions(...)`. Every row is validated before anything is tokenized, so a bad row fails in seconds with
its index and field instead of hours into training; a streamed dataset's rows are validated as they stream,
just before each is tokenized, with the same checks and errors.
"""

from .preference import (
    PREFERENCE_FORMATS,
    check_margin,
    check_preference_rows,
    check_shared_prompt,
    check_token_ids,
    detect_preference_format,
    prepare_preference_dataset,
    validate_preference_dataset,
)
from .raw_files import DataFileError, check_raw_file, read_json_rows
from .sft import (
    CONVERSATIONAL_FORMATS,
    apply_formatting_func,
    check_sft_rows,
    detect_format,
    prepare_sft_dataset,
    validate_sft_dataset,
)
from .tokenization import (
    OVERLONG_POLICIES,
    apply_length_policy,
    check_chat_template,
    check_overlong_policy,
    check_unknown_tokens,
    encode_plain_batch,
    ensure_pad_token,
    eos_token_id,
    main_process_first_if_cached,
    resolve_chat_template,
    special_prefix,
    token_id,
    tokenize_prompt_completion,
    with_eos,
)
from .validation import (
    ABSENT,
    MISSING,
    ROLES,
    DataValidationError,
    Verbatim,
    as_dataset,
    check_messages,
    check_not_empty,
    check_text,
    column_names,
    column_values,
    is_conversational_column,
    iter_rows,
    validate_rows,
)

__all__ = [
    "ABSENT",
    "CONVERSATIONAL_FORMATS",
    "MISSING",
    "OVERLONG_POLICIES",
    "PREFERENCE_FORMATS",
    "ROLES",
    "DataFileError",
    "DataValidationError",
    "Verbatim",
    "apply_formatting_func",
    "check_preference_rows",
    "check_sft_rows",
    "apply_length_policy",
    "as_dataset",
    "check_chat_template",
    "check_margin",
    "check_messages",
    "check_not_empty",
    "check_overlong_policy",
    "check_raw_file",
    "check_shared_prompt",
    "check_text",
    "check_token_ids",
    "check_unknown_tokens",
    "column_names",
    "column_values",
    "detect_format",
    "detect_preference_format",
    "encode_plain_batch",
    "ensure_pad_token",
    "eos_token_id",
    "is_conversational_column",
    "iter_rows",
    "main_process_first_if_cached",
    "prepare_preference_dataset",
    "prepare_sft_dataset",
    "read_json_rows",
    "resolve_chat_template",
    "special_prefix",
    "tokenize_prompt_completion",
    "token_id",
    "validate_preference_dataset",
    "validate_rows",
    "validate_sft_dataset",
    "with_eos",
]
