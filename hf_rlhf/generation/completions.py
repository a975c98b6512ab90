"""Greedy completions of a batch of prompts (left padded), for evaluation and logged samples (decoded text)."""

from __future__ import annotations

import torch


def generate_completions(
    model, tokenizer, prompts: list, max_new_tokens: int = 16, batch_size: int = 64
) -> list[str]:
    """Greedy completions, batched with left padding, without the prompt and special tokens.

    Args:
        prompts: plain strings (the tokenizer adds bos) or conversations (rendered with the chat
            template and a generation prompt).

    Returns:
        list of len(prompts) decoded completions.
    """
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # so every row's new tokens start at the same column
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            conversational = isinstance(chunk[0], list)
            if conversational:
                chunk = [
                    tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                    for p in chunk
                ]
            # a chat template writes bos itself; a plain prompt gets it from the tokenizer
            enc = tokenizer(
                chunk, return_tensors="pt", padding=True, add_special_tokens=not conversational
            ).to(model.device)
            with torch.no_grad():
                ids = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            new = ids[:, enc["input_ids"].shape[1] :]
            out += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out
