"""A character-level tokenizer trained locally with `tokenizers`, and its chat template.

One token per character keeps every digit and letter its own token (so arithmetic, reversal and
sorting are learnable by a tiny model) and makes ``tokenize(prompt + completion)`` always start
with ``tokenize(prompt)``. The vocabulary is printable ASCII, newline and the special tokens
(about 105 tokens). Plain text gets ``<|bos|>`` prepended; the chat template writes it itself::

    <|bos|><|user|>37+45=<|assistant|>82<|eos|>

The assistant content and its eos sit inside ``{% generation %}``, so
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly the tokens to learn.
"""

from __future__ import annotations

import os
import string

from .tasks import EOS_TEXT, PAD_TEXT, make_tasks

BOS_TEXT = "<|bos|>"
UNK_TEXT = "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = [PAD_TEXT, BOS_TEXT, EOS_TEXT, UNK_TEXT, *ROLE_TOKENS]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _training_text() -> list[str]:
    # every printable character appears, so nothing in a user's text maps to unk
    return [string.printable] + [r["prompt"] + r["answer"] for r in make_tasks(500)]


def build_toy_tokenizer(save_dir: str | None = None):
    """Train (in well under a second) or load the toy tokenizer.

    Args:
        save_dir: when it already holds a tokenizer, load that; otherwise save the new one there.

    Returns:
        a `transformers.PreTrainedTokenizerFast` with bos/eos/pad/unk set, right padding and
        `model_max_length` 256.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if save_dir and os.path.exists(os.path.join(save_dir, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(save_dir)

    tok = Tokenizer(models.WordLevel(unk_token=UNK_TEXT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TEXT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TEXT} $A", pair=f"{BOS_TEXT} $A $B", special_tokens=[(BOS_TEXT, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TEXT,
        eos_token=EOS_TEXT,
        pad_token=PAD_TEXT,
        unk_token=UNK_TEXT,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="right",
        model_max_length=256,
        chat_template=CHAT_TEMPLATE,
    )
    if save_dir:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


# Tool calling in the toy world (issue 21): the same characters, a template that renders tools, tool calls and
# tool results, and the response template transformers' `parse_response` reads the calls with. A tool result comes
# back as a user-side turn "<|user|>result: ..." (the tokenizer has no tool role token; adding one would change the
# vocabulary of every toy model).
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools:{% for tool in tools %}"
    " {{ tool['function']['name'] if tool['function'] is defined else tool['name'] }}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{{ eos_token }}{% endgeneration %}"
    "{% elif message['role'] == 'tool' %}<|user|>result: {{ message['content'] }}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|eos\|>\s*", "content": "text"},
    },
}


def build_toy_tool_tokenizer(save_dir: str | None = None):
    """The toy tokenizer with `TOOL_CHAT_TEMPLATE` and `TOOL_RESPONSE_TEMPLATE` (same vocabulary and ids)::

        <|bos|><|system|>tools: add<|user|>12+30=<|assistant|><tool_call>{"name": "add", "arguments": {"a": 12,
        "b": 30}}</tool_call><|eos|><|user|>result: 42<|assistant|>42<|eos|>
    """
    tokenizer = build_toy_tokenizer(save_dir)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    return tokenizer
