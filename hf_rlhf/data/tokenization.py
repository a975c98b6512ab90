"""Tokenizer set-up and tokenization shared by every dataset format.

Set-up: the chat template (`resolve_chat_template`, `check_chat_template`), the pad token (`ensure_pad_token`),
token ids from option strings (`token_id`) and the special tokens a tokenizer puts before any text
(`special_prefix`). Tokenization: prompt + completion with a completion mask (`tokenize_prompt_completion`),
and the over-long policy applied to a tokenized dataset (`apply_length_policy`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from pathlib import Path

from datasets import Dataset

from .validation import DataValidationError, Verbatim, column_values

logger = logging.getLogger("hf_rlhf")

OVERLONG_POLICIES = ("truncate", "drop", "error")
LENGTH_COLUMNS = ("_length", "_trainable")  # written per row by a format's tokenizer, read by apply_length_policy
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ---------------------------------------------------------------------------------------------------
# Tokenizer set-up


def _template_from_dir(path: Path) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    for name in ("tokenizer_config.json", "chat_template.json"):
        if (path / name).is_file():
            template = json.loads((path / name).read_text()).get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                named = {t["name"]: t["template"] for t in template}
                template = named.get("default", next(iter(named.values()), None))
            if template:
                return template
    return None


def resolve_chat_template(tokenizer, chat_template_path: str | None) -> None:
    """Set `tokenizer.chat_template` from a Jinja file or a local tokenizer directory.

    Args:
        tokenizer: the tokenizer, changed in place.
        chat_template_path: a Jinja file, or a directory with `chat_template.jinja` or a `chat_template` in
            `tokenizer_config.json` / `chat_template.json`; None keeps the tokenizer's template.

    Raises:
        FileNotFoundError: the path is neither, or the directory holds no template.
    """
    if chat_template_path is None:
        return
    path = Path(chat_template_path)
    if path.is_file():
        template = path.read_text()
    elif path.is_dir():
        template = _template_from_dir(path)
        if template is None:
            raise FileNotFoundError(
                f"chat_template_path={chat_template_path!r}: the directory has no chat_template.jinja and no "
                "'chat_template' in tokenizer_config.json")
    else:
        raise FileNotFoundError(
            f"chat_template_path={chat_template_path!r} is neither a Jinja file nor a tokenizer directory")
    tokenizer.chat_template = template


def token_id(tokenizer, token: str, option: str) -> int:
    """The id of `token`, which must be in the vocabulary (an unknown token is an error, not `unk`).

    Args:
        tokenizer: the tokenizer.
        token: the token string (e.g. "<|im_end|>").
        option: the option that named it, for the error (e.g. "SFTConfig.eos_token").

    Returns:
        The token id.
    """
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or (found == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"{option}={token!r} is not in the tokenizer's vocabulary")
    return found


def ensure_pad_token(tokenizer, pad_token: str | None) -> None:
    """Set `tokenizer.pad_token` from the `pad_token` option; without one, fall back to eos (as TRL), with a warning.

    The fallback is safe here: every collator builds labels from `input_ids` and the completion / assistant masks
    and pads them with -100 (never by comparing with the pad id), and scores are read at the last position of the
    attention mask, so a real eos stays trained on and scored even when it is also the pad token.

    Args:
        tokenizer: the tokenizer, changed in place.
        pad_token: a token of its vocabulary, or None to keep the tokenizer's pad token (eos when it has none).

    Raises:
        ValueError: `pad_token` is not in the vocabulary, or the tokenizer has neither a pad nor an eos token.
    """
    if pad_token is not None:
        token_id(tokenizer, pad_token, "pad_token")
        tokenizer.pad_token = pad_token
        return
    if tokenizer.pad_token is not None:
        return
    if tokenizer.eos_token is None:
        raise ValueError(
            "tokenizer has neither a pad token nor an eos token: set the config's pad_token to a token of its "
            "vocabulary, or add one with tokenizer.add_special_tokens({'pad_token': '<pad>'}) and "
            "model.resize_token_embeddings(len(tokenizer)).")
    logger.warning("tokenizer has no pad token: padding with its eos token %r (as TRL does; labels and scores come "
                   "from masks, so eos is still trained on). Set pad_token to choose another.", tokenizer.eos_token)
    tokenizer.pad_token = tokenizer.eos_token


def eos_token_id(tokenizer, eos_token: str | None, option: str) -> int:
    """The id of the eos token appended to plain text: `eos_token` if given, else the tokenizer's.

    Args:
        tokenizer: the tokenizer.
        eos_token: the option's value, or None.
        option: the option's name, for the error (e.g. "RewardConfig.eos_token").

    Returns:
        The token id.
    """
    eos_token = eos_token or tokenizer.eos_token
    if eos_token is None:
        raise ValueError(f"tokenizer has no eos token: set {option}")
    return token_id(tokenizer, eos_token, option)


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default.

    Args:
        tokenizer: the tokenizer.

    Returns:
        Usually `[bos_id]` or `[]`.
    """
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return with_special[:start]
    return []


def _chat_template(tokenizer) -> str | None:
    try:
        return tokenizer.get_chat_template()
    except ValueError:  # no template set
        return None


def check_chat_template(tokenizer, fmt: str, assistant_only_loss: bool,
                        option: str = "chat_template_path") -> str | None:
    """Raise a ValueError that says how to fix it if conversational data cannot be tokenized; else the template to
    tokenize with.

    With `assistant_only_loss` and a template without `{% generation %}` markers, the training version of a known
    model's stock template that TRL ships is used for tokenization, as TRL swaps it in
    (`trl.chat_template_utils.get_training_chat_template`); the tokenizer keeps its own template (inference).

    Args:
        tokenizer: the tokenizer.
        fmt: the dataset's format, for the error ("conversational" names the `messages` column).
        assistant_only_loss: the template must also mark assistant content with `{% generation %}`.
        option: the option that sets a template, for the error (e.g. "SFTConfig.chat_template_path").

    Returns:
        None to tokenize with the tokenizer's template, or TRL's training template (a Jinja string).
    """
    template = _chat_template(tokenizer)
    if template is None:
        column = "messages" if fmt == "conversational" else "prompt/completion messages"
        raise ValueError(f"dataset is conversational ({column!r}) but the tokenizer has no chat template; "
                         f"set {option} to a Jinja file or a tokenizer directory")
    if not assistant_only_loss or _GENERATION_TAG.search(template):
        return None
    from trl.chat_template_utils import get_training_chat_template

    try:
        training = get_training_chat_template(tokenizer)
    except ValueError:  # not one of the stock templates TRL ships a training version of
        training = None
    if training is None or not _GENERATION_TAG.search(training):
        raise ValueError(
            "assistant_only_loss=True needs a chat template that wraps assistant content in "
            "{% generation %} ... {% endgeneration %}; the tokenizer's template has no such markers and is not one of "
            "the stock templates TRL ships a training version of (every assistant mask would be all zeros). Add the "
            f"markers and pass the template with {option}, or set assistant_only_loss=False.")
    logger.info("assistant_only_loss: tokenizing with TRL's training version of the tokenizer's chat template "
                "(it marks the assistant turns with {%% generation %%}); the tokenizer keeps its own template.")
    return training


# ---------------------------------------------------------------------------------------------------
# Tokenization


def main_process_first_if_cached(args, dataset, desc: str):
    """`args.main_process_first(desc=desc)` for a dataset backed by cache files, else a context that does nothing.

    With cache files (`load_dataset`, `load_from_disk`) the local main process tokenizes first and writes the
    `Dataset.map` cache, which the other ranks then load instead of tokenizing again. In-memory data (a list of
    dicts, `Dataset.from_list`) writes no cache, so waiting would only serialize the ranks. A single process never
    waits either way.

    Args:
        args: the trainer's `TrainingArguments`.
        dataset: the raw dataset about to be prepared.
        desc: what is prepared, for transformers' debug log.

    Returns:
        A context manager.
    """
    if isinstance(dataset, Dataset) and dataset.cache_files:
        return args.main_process_first(desc=desc)
    return contextlib.nullcontext()


def with_eos(ids: list[int], eos_id: int) -> list[int]:
    """`ids` ending in `eos_id`: appended unless it is already the last id.

    Args:
        ids: token ids.
        eos_id: the eos id.

    Returns:
        A list (a new one when eos was appended).
    """
    return ids if ids and ids[-1] == eos_id else ids + [eos_id]


PROMPT_TOKENIZATIONS = ("apart", "joint")
BOUNDARY_COLUMN = "_boundary"  # written per row by a format's tokenizer: prompt and completion merged across it


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share.

    Args:
        a, b: token ids, (Ta,) and (Tb,).

    Returns:
        n <= min(Ta, Tb) with a[:n] == b[:n].
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_completion_texts(prompt, completion) -> list[str]:
    """The texts `tokenize_prompt_completion` may encode: the prompt, prompt + completion, and the completion (alone
    where tokens merge across the boundary); none for values that are not strings."""
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return []
    return [prompt, prompt + completion, completion]


def backend_encodes_plainly(tokenizer) -> bool:
    """True when `tokenizer(texts, add_special_tokens=False)["input_ids"]` is exactly the ids of its Rust backend's
    `encode_batch_fast(texts, add_special_tokens=False)`: a transformers fast tokenizer whose class keeps the stock
    `__call__` / `_encode_plus` and no input mode (some model tokenizers override or add them), and whose backend has no
    truncation or padding set and splits special tokens as the tokenizer says (the three settings the stock call
    would change for the call)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return False
    from transformers import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    stock = (cls.__call__ is PreTrainedTokenizerBase.__call__ and cls._encode_plus is TokenizersBackend._encode_plus
             and not hasattr(cls, "_switch_to_input_mode"))
    return (stock and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))


def encode_plain_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts, add_special_tokens=False)["input_ids"]`, computed faster.

    Where `backend_encodes_plainly(tokenizer)`, straight from the Rust backend's `encode_batch_fast` (no offsets, no
    per-text Python dict: 44k toy texts in 0.28 s against 1.30 s); else the tokenizer's own call without the
    attention masks and token type ids it would build and drop (0.88 s).
    """
    if not texts:
        return []
    if backend_encodes_plainly(tokenizer):
        return [encoding.ids for encoding in tokenizer.backend_tokenizer.encode_batch_fast(
            texts, add_special_tokens=False)]  # in tokenizers since 0.20 (pyproject: >= 0.21)
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"]


class PreEncodedTokenizer:
    """`tokenizer`, with the ids of `texts` encoded ahead in one batched call: `tok(text, add_special_tokens=False)`
    of one of them reads the table (a fast tokenizer gives a text the same ids alone or in a batch); every other call
    and attribute goes to `tokenizer`.

    What a batched `Dataset.map` hands a per-row tokenization function: one call into the tokenizer's Rust batch
    encoder per batch instead of one Python-wrapped call per text (~0.1 ms each; 60,000 prompt / completion rows
    took 15 s one at a time), through `encode_plain_batch`.

    Args:
        tokenizer: the tokenizer (a `PreTrainedTokenizerBase`).
        texts: strings to encode without special tokens (repeats are encoded once).
    """

    def __init__(self, tokenizer, texts: list[str]):
        unique = list(dict.fromkeys(texts))
        encoded = encode_plain_batch(tokenizer, unique)
        self.tokenizer = tokenizer
        self.ids = dict(zip(unique, encoded))

    def __call__(self, text=None, *args, add_special_tokens: bool = True, **kwargs):
        if not args and not kwargs and add_special_tokens is False and isinstance(text, str) and text in self.ids:
            return {"input_ids": list(self.ids[text])}
        return self.tokenizer(text, *args, add_special_tokens=add_special_tokens, **kwargs)

    def __getattr__(self, name: str):
        if name in ("tokenizer", "ids"):  # not set yet (copy / unpickling): no recursion into __getattr__
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def map_rows(batch: dict, indices: list[int], row_fn, fn_kwargs: dict | None = None, spec=None, texts_fn=None) -> dict:
    """A batched `Dataset.map` function that applies the per-row `row_fn` to each row of `batch`: the rows and
    their errors are the per-row map's, without its per-row overhead in `datasets` (tens of microseconds a row).

    Args:
        batch: {column: [value per row]}; indices: the rows' indices in the dataset.
        row_fn: `row_fn(row, index, spec)` with `spec`, else `row_fn(row, **fn_kwargs)`; returns a dict (the same
            keys for every row).
        spec: a tokenization spec (a dataclass with a `tokenizer` field).
        texts_fn: `texts_fn(row, spec)`, the texts the row will encode with `add_special_tokens=False`: encoded
            ahead for the whole batch (`PreEncodedTokenizer`).

    Returns:
        {column: [value per row]}.
    """
    columns = list(batch)
    rows = [dict(zip(columns, values)) for values in zip(*(batch[c] for c in columns))]
    if spec is None:
        outs = [row_fn(row, **(fn_kwargs or {})) for row in rows]
    else:
        if texts_fn is not None:
            texts = [text for row in rows for text in texts_fn(row, spec)]
            spec = dataclasses.replace(spec, tokenizer=PreEncodedTokenizer(spec.tokenizer, texts))
        outs = [row_fn(row, index, spec) for row, index in zip(rows, indices)]
    return {key: [out[key] for out in outs] for key in (outs[0] if outs else {})}


def tokenize_prompt_completion(tokenizer, prompt: str, completion: str, prefix: list[int], eos_id: int,
                               prompt_tokenization: str = "apart") -> dict:
    """Tokenize `prefix + prompt + completion + eos`, marking the completion's tokens.

    The two settings differ only where tokens merge across the boundary, i.e. the prompt's own ids are not a
    prefix of the ids of prompt + completion (a prompt ending in a space: "3+4? " + "7" gives "?", " 7", not
    "?", " ", "7"):
    - `apart` (default): the prompt's own ids, then the completion tokenized on its own: the context the model
      sees when it generates after the prompt at inference;
    - `joint` (TRL's): prompt + completion tokenized as one text, the completion starting where those ids diverge
      from the prompt's own (the prompt's last tokens are then not what inference sees).
    Elsewhere both are the ids of prompt + completion tokenized as one text.

    Args:
        tokenizer: the tokenizer.
        prompt, completion: the texts.
        prefix: leading special ids (`special_prefix(tokenizer)`).
        eos_id: appended unless the completion already ends with it.
        prompt_tokenization: `apart` or `joint` (`PROMPT_TOKENIZATIONS`).

    Returns:
        {"input_ids": (T,), "completion_mask": (T,), "_boundary": bool}: ids and mask as lists, the mask 1 on
        completion tokens and eos; `_boundary` tells whether tokens merged across the boundary (the settings differ).
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
    merged = full_ids[: len(prompt_ids)] != prompt_ids
    n_prompt = len(prompt_ids)
    if merged and prompt_tokenization == "joint":
        n_prompt = common_prefix_length(prompt_ids, full_ids)
    elif merged:
        full_ids = prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"]
    input_ids = with_eos(prefix + full_ids, eos_id)
    n_prompt += len(prefix)
    return {"input_ids": input_ids, "completion_mask": [0] * n_prompt + [1] * (len(input_ids) - n_prompt),
            BOUNDARY_COLUMN: merged}


def log_boundary_rows(n_merged: int, n_rows: int, prompt_tokenization: str, option: str) -> None:
    """Say once per dataset how many rows the `prompt_tokenization` setting changes (tokens merged across the
    prompt / completion boundary), and what each setting does with them.

    Args:
        n_merged: rows whose prompt ids are not a prefix of their prompt + completion ids.
        n_rows: rows tokenized.
        prompt_tokenization: the setting used.
        option: the option's qualified name, e.g. "SFTConfig.prompt_tokenization".
    """
    if not n_merged:
        return
    if prompt_tokenization == "joint":
        logger.warning(
            "%d of %d rows: tokens merge across the prompt / completion boundary (e.g. a prompt ending in a space); "
            "%s='joint' tokenizes them jointly as TRL does, so the model is trained on a prompt whose last tokens "
            "differ from the ones it sees at inference. 'apart' (the default) keeps the inference context.",
            n_merged, n_rows, option)
    else:
        logger.warning(
            "%d of %d rows: tokens merge across the prompt / completion boundary (e.g. a prompt ending in a space); "
            "the prompt is tokenized apart from its completion, as the model sees it at inference. TRL tokenizes "
            "them jointly, so its losses differ on these rows; %s='joint' reproduces TRL's.",
            n_merged, n_rows, option)


def check_overlong_policy(policy: str) -> None:
    """Raise a ValueError unless `policy` is one of `OVERLONG_POLICIES`.

    Args:
        policy: the `overlong_policy` option.
    """
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong_policy={policy!r}; expected one of {OVERLONG_POLICIES}")


def apply_length_policy(dataset: Dataset, max_length: int | None, policy: str, field: str) -> tuple[Dataset, dict]:
    """Apply `overlong_policy` using the `_length` / `_trainable` columns the tokenizer wrote, then drop them.

    Rows longer than `max_length`: `error` raises on the first; `drop` removes them; `truncate` keeps
    them (already cut) unless no trainable token is left, in which case they are dropped too.

    Args:
        dataset: tokenized rows with `_length` (untruncated length) and `_trainable` (a loss token is left).
        max_length: the longest row allowed; None: no limit.
        policy: one of `OVERLONG_POLICIES`.
        field: the field named in an `error` (e.g. "prompt+completion").

    Returns:
        (dataset, {"n_rows": rows in, "n_truncated": kept truncated, "n_dropped": removed}).
    """
    n_rows = len(dataset)
    stats = {"n_rows": n_rows, "n_truncated": 0, "n_dropped": 0}
    lengths = [] if max_length is None else column_values(dataset, "_length")
    overlong = [i for i, n in enumerate(lengths) if n > max_length]
    if overlong and policy == "error":
        i = overlong[0]
        raise DataValidationError(
            i, field, f"at most max_length={max_length} tokens (overlong_policy='error'; use 'truncate' or 'drop' "
            f"to keep going; {len(overlong)} of {n_rows} rows are longer)", Verbatim(f"{dataset[i]['_length']} tokens"))
    drop = set(overlong)
    if policy == "truncate" and overlong:
        trainable = column_values(dataset, "_trainable")
        drop = {i for i in overlong if not trainable[i]}
        stats["n_truncated"] = len(overlong) - len(drop)
        logger.warning("%d of %d examples longer than max_length=%d were truncated",
                       stats["n_truncated"], n_rows, max_length)
        if drop:
            logger.warning("%d of %d examples longer than max_length=%d were dropped: truncation left no "
                           "completion token to train on", len(drop), n_rows, max_length)
    elif drop:
        logger.warning("%d of %d examples longer than max_length=%d were dropped", len(drop), n_rows, max_length)
    stats["n_dropped"] = len(drop)
    if drop:
        if len(drop) == n_rows:
            raise ValueError(f"all {n_rows} examples were dropped as longer than max_length={max_length}; "
                             "raise max_length or use overlong_policy='truncate'")
        dataset = dataset.select([i for i in range(n_rows) if i not in drop])
    return dataset.remove_columns(list(LENGTH_COLUMNS)), stats


DEFAULT_MAX_UNK_SHARE = 0.1


def check_unknown_tokens(dataset: Dataset, columns, tokenizer, max_share: float | None, strict: bool,
                         field: str) -> int:
    """Count rows the tokenizer cannot represent: more than `max_share` of their tokens are its unknown token.

    Such text (another script, another alphabet) would be trained on as a run of `<unk>`, silently. The count is
    logged with the first such row; with `strict` the first one is an error. A tokenizer without an unknown token
    (byte-level BPE represents every text) has nothing to check.

    Args:
        dataset: tokenized rows, in the order of the raw rows (row indices name the raw rows).
        columns: the token-id columns to check (e.g. ("input_ids",) or ("chosen_ids", "rejected_ids")).
        tokenizer: the tokenizer (`unk_token_id`).
        max_share: the largest share of unknown tokens a row may have; None: `DEFAULT_MAX_UNK_SHARE`.
        strict: raise instead of warning.
        field: the field named in the message.

    Returns:
        The number of rows above the share.

    Raises:
        DataValidationError: with `strict`, the first row above the share.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return 0
    max_share = DEFAULT_MAX_UNK_SHARE if max_share is None else max_share
    bad, first = 0, None
    index = 0
    for batch in dataset.select_columns(list(columns)).iter(batch_size=1000):
        for j in range(len(batch[columns[0]])):
            for column in columns:
                ids = batch[column][j]
                n_unk = sum(1 for t in ids if t == unk)
                if ids and n_unk / len(ids) > max_share:
                    bad += 1
                    if first is None:
                        first = (index, n_unk, len(ids))
                    break
            index += 1
    if not bad:
        return 0
    row, n_unk, n = first
    expected = (f"text the tokenizer can represent (at most {max_share:.0%} of its tokens "
                f"{tokenizer.unk_token!r}, max_unk_share)")
    got = Verbatim(f"{n_unk} of {n} tokens unknown; {bad} of {index} rows are above the share")
    if strict:
        raise DataValidationError(row, field, expected, got)
    logger.warning("%d of %d rows have more than %.0f%% unknown tokens (%r), first row %d (%d of %d tokens): they "
                   "are trained on as unknown tokens; set strict=True to make this an error, or max_unk_share",
                   bad, index, 100 * max_share, tokenizer.unk_token, row, n_unk, n)
    return bad
