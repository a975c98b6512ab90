"""A turn of the policy read with its chat template's tool format, and the tokens a tool result adds to the context.

Nothing is hand-parsed here: tool calls are read by `tokenizer.parse_response` (transformers' response parsing,
driven by the tokenizer's `response_template`) through TRL 1.16's `trl.chat_template_utils.parse_response` wrapper
(malformed calls fall back to plain text, a stray eos is removed, the call's fields are validated); a tokenizer
without a `response_template` gets TRL's for the chat templates TRL knows (`add_response_schema`). The tool-result
tokens are what the chat template renders for the tool messages plus the next generation prompt, cut from a dummy
conversation exactly as TRL's GRPOTrainer `_get_tool_suffix_ids` does, so the ids the policy saw are the ids trained
on (no re-tokenization of earlier turns).
"""

from __future__ import annotations

import copy

from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)


def rollout_tokenizer(tokenizer):
    """The tokenizer a multi-turn rollout renders with: `tokenizer`, or, when its chat template is not prefix-preserving
    (Qwen3's drops earlier thinking once a tool message follows), a shallow copy carrying TRL's prefix-preserving
    training version of it, as TRL 1.16's GRPOTrainer swaps it in for tools; `tokenizer` itself keeps its own template
    (the one saved with the model). A template TRL has no training version of is left to `check_tool_tokenizer`."""
    if tokenizer.chat_template is None or not supports_tool_calling(tokenizer) or \
            is_chat_template_prefix_preserving(tokenizer):
        return tokenizer
    try:
        training = get_training_chat_template(tokenizer)
    except ValueError:  # not one of the stock templates TRL ships a training version of
        return tokenizer
    if training is None:
        return tokenizer
    swapped = copy.copy(tokenizer)
    if getattr(swapped, "response_template", None) is None and getattr(swapped, "response_schema", None) is None:
        try:  # TRL's response template is known by the stock template: set it before the swap
            add_response_schema(swapped)
        except ValueError:
            pass
    swapped.chat_template = training
    return swapped


def check_tool_tokenizer(tokenizer) -> None:
    """Make sure `tokenizer` can render and parse tool calls; set TRL's response template for known chat templates.

    Raises:
        ValueError: one line naming what is missing: no chat template, a chat template that cannot render a
            user -> assistant(tool_calls) -> tool conversation, one that is not prefix-preserving (a tool result
            appended would change earlier tokens), or no `response_template` to parse the policy's turns with.
    """
    if tokenizer.chat_template is None:
        raise ValueError("tools need a tokenizer with a chat template; this tokenizer has none (set "
                         "tokenizer.chat_template to one that renders tool_calls and tool messages)")
    if not supports_tool_calling(tokenizer):
        raise ValueError("tools need a chat template that renders a tool-calling conversation (user -> assistant with "
                         "tool_calls -> tool): this tokenizer's template drops the tool call's name/arguments or the "
                         "tool message")
    if not is_chat_template_prefix_preserving(tokenizer):
        raise ValueError("tools need a prefix-preserving chat template (appending a tool message must not change the "
                         "tokens rendered before it); this tokenizer's template is not")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError as err:
            raise ValueError("tools need tokenizer.response_template (transformers' response parsing) to read tool "
                             "calls; TRL knows none for this chat template: set one on the tokenizer") from err


def tool_call_marker(tokenizer) -> str | None:
    """The text that opens a tool call in this tokenizer's response template (e.g. "<tool_call>"), or None."""
    template = getattr(tokenizer, "response_template", None) or {}
    field = (template.get("fields") or {}).get("tool_calls") or {}
    marker = field.get("open")
    return marker if isinstance(marker, str) and marker else None


def parse_turn(tokenizer, ids: list[int], prefix: list[int] | None = None, tools=None) -> dict:
    """One assistant turn as a message: {"role": "assistant", "content": str, "tool_calls"?: [...], "malformed"?: True}.

    Args:
        ids: the turn's generated ids (its stop token included).
        prefix: the ids of the context before the turn (needed by some response templates).
        tools: the tools the prompt was rendered with (types the call's arguments from their JSON schema).

    Returns:
        the parsed message; `"malformed": True` (not a chat field: removed before rendering) when the text opens a
        tool call that the parser could not read, so the rollout can answer it with an error message.
    """
    message = parse_response(tokenizer, ids, prefix=prefix, tools=tools)
    marker = tool_call_marker(tokenizer)
    if not message.get("tool_calls") and marker is not None and marker in (message.get("content") or ""):
        message["malformed"] = True
    return message


def tool_suffix_ids(tokenizer, tool_messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """The ids that follow an assistant turn's stop token when `tool_messages` answer it, up to the next generation
    prompt (as TRL 1.16 GRPOTrainer `_get_tool_suffix_ids`: rendered after a dummy tool-calling conversation, the
    prefix cut at its last eos).

    Args:
        tool_messages: [{"role": "tool", "name": str, "content": str}, ...] answering one turn.

    Raises:
        ValueError: the template renders the dummy conversation differently with the tool messages appended.
    """
    kwargs = chat_template_kwargs or {}
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False,
                                           **kwargs)
    full = tokenizer.apply_chat_template(dummy + list(tool_messages), add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **kwargs)
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if eos:  # templates that write "<eos>\n" after a turn: the policy's turn ended at the eos
        prefix = prefix[: eos[-1] + 1]
    if list(full[: len(prefix)]) != list(prefix):
        raise ValueError("the chat template renders the turns before a tool message differently once it is appended "
                         "(not prefix-preserving)")
    return list(full[len(prefix):])
