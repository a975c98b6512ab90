"""A packed batch gives every token the loss it has when its example runs alone (tiny Llama, sdpa and eager)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import pack_dataset

from hf_rlhf import SFTConfig, SFTTrainer
from hf_rlhf.collators import PackingCollator

pytestmark = pytest.mark.integration

VOCAB = 128
# (length, prompt length): the prompt tokens are masked out of the loss through `completion_mask`.
SHAPES = [(5, 2), (9, 4), (3, 0), (7, 3)]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=request.param, dtype=torch.float32)
    assert model.config._attn_implementation == request.param
    return model.eval()


def make_examples(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(1, VOCAB, (length,), generator=generator).tolist(),
            "completion_mask": [0] * prompt + [1] * (length - prompt),
        }
        for length, prompt in shapes
    ]


def per_token_losses(model, batch, **forward_kwargs):
    """Cross-entropy of every token whose (shifted) label is not -100, in row order: (num_label_tokens,)."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        logits = model(**inputs, **forward_kwargs).logits
    logits, targets = logits[:, :-1], batch["labels"][:, 1:]
    keep = targets != -100
    return F.cross_entropy(logits[keep], targets[keep], reduction="none")


def separate_losses(model, examples):
    """Per-token losses of each example run alone, unpadded (the reference); a list of (num_label_tokens_i,)."""
    losses = []
    for example in examples:
        labels = [tok if keep else -100 for tok, keep in zip(example["input_ids"], example["completion_mask"])]
        batch = {"input_ids": torch.tensor([example["input_ids"]]), "labels": torch.tensor([labels])}
        losses.append(per_token_losses(model, batch, use_cache=False))
    return losses


@pytest.mark.parametrize(
    "collator_kwargs",
    [{}, {"pad_to_multiple_of": 16, "return_flash_attention_kwargs": True}],
    ids=["plain", "padded+flash_kwargs"],
)
def test_packed_losses_equal_separate_losses(model, collator_kwargs):
    examples = make_examples(SHAPES)
    batch = PackingCollator(**collator_kwargs)(examples)
    expected = torch.cat(separate_losses(model, examples))

    packed = per_token_losses(model, batch, use_cache=False)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)

    # The model's own loss (labels shifted inside) is the token-weighted mean of the separate runs.
    with torch.no_grad():
        loss = model(**batch, use_cache=False).loss
    torch.testing.assert_close(loss, expected.mean(), atol=1e-5, rtol=0)


def test_kv_cache_breaks_packing(model):
    # The hazard: transformers detects packed sequences from position_ids only when there is no KV cache, and
    # LlamaConfig.use_cache defaults to True. With a cache the mask is causal over the whole row.
    examples = make_examples(SHAPES)
    batch = PackingCollator()(examples)
    expected = separate_losses(model, examples)

    packed = per_token_losses(model, batch, use_cache=True)
    first, rest = packed.split([len(expected[0]), len(packed) - len(expected[0])])
    # The first example precedes every boundary, so only the later ones see tokens of other examples.
    torch.testing.assert_close(first, expected[0], atol=1e-5, rtol=0)
    assert not torch.allclose(rest, torch.cat(expected[1:]), atol=1e-3, rtol=0)


def packed_rows(shapes, seq_length, seed=1):
    """Rows packed by `trl.pack_dataset` (bfd), and the examples they hold, in row order."""
    examples = make_examples(shapes, seed=seed)
    dataset = Dataset.from_dict({key: [example[key] for example in examples] for key in examples[0]})
    rows = list(pack_dataset(dataset, seq_length=seq_length, strategy="bfd"))
    unpacked = []
    for row in rows:
        start = 0
        for length in row["seq_lengths"]:
            unpacked.append({key: row[key][start : start + length] for key in ("input_ids", "completion_mask")})
            start += length
    assert sorted(map(str, unpacked)) == sorted(map(str, examples))  # no example truncated or lost
    return rows, unpacked


PREPACKED_SHAPES = [(5, 2), (9, 4), (3, 0), (7, 3), (4, 1), (6, 6)]


def test_prepacked_rows_equal_separate_losses(model):
    rows, unpacked = packed_rows(PREPACKED_SHAPES, seq_length=12)
    assert any(len(row["seq_lengths"]) > 1 for row in rows), "nothing was packed together"

    batch = PackingCollator()(rows)
    expected = torch.cat(separate_losses(model, unpacked))
    torch.testing.assert_close(per_token_losses(model, batch, use_cache=False), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
def test_unflattened_prepacked_rows_equal_separate_losses(model, pad_to_multiple_of):
    # flatten=False: one (B, T) row per packed row, shorter rows ended by a dummy sequence; transformers finds the
    # restarts row by row and builds one block-diagonal mask per row.
    rows, unpacked = packed_rows(PREPACKED_SHAPES + [(2, 1), (11, 5)], seq_length=12)
    assert any(len(row["seq_lengths"]) > 1 for row in rows), "nothing was packed together"
    assert len({len(row["input_ids"]) for row in rows}) > 1, "no row needs a dummy sequence"

    batch = PackingCollator(flatten=False, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=0)(rows)
    assert batch["input_ids"].shape == (len(rows), 16 if pad_to_multiple_of else 12)
    expected = torch.cat(separate_losses(model, unpacked))
    torch.testing.assert_close(per_token_losses(model, batch, use_cache=False), expected, atol=1e-5, rtol=0)
    with torch.no_grad():
        loss = model(**batch, use_cache=False).loss
    torch.testing.assert_close(loss, expected.mean(), atol=1e-5, rtol=0)


def test_unflattened_rows_of_one_sequence_each(model):
    # Rows that hold one example each and need no padding have no restart at all: transformers falls back to the
    # plain causal mask, which is still exact.
    rows, unpacked = packed_rows([(6, 2), (6, 0), (6, 3)], seq_length=6)
    assert all(len(row["seq_lengths"]) == 1 for row in rows)
    batch = PackingCollator(flatten=False)(rows)
    expected = torch.cat(separate_losses(model, unpacked))
    torch.testing.assert_close(per_token_losses(model, batch, use_cache=False), expected, atol=1e-5, rtol=0)



@pytest.mark.parametrize(
    ("attn", "mode", "flatten"),
    [("sdpa", "packing", False), ("eager", "packing", False), ("sdpa", "padding_free", True),
     ("flash_attention_2", "packing", True)],
)
def test_sft_trainer_keeps_prepacked_rows_unless_flash(tmp_path, attn, mode, flatten):
    # Rows of max_length from pack_dataset stay (B, T) on sdpa/eager; flash attention (varlen kernels) and
    # padding-free batches of plain examples get one flattened row.
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn))
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", **{mode: True})
    collator = SFTTrainer._default_collator(model, SimpleNamespace(pad_token_id=0), args)
    assert isinstance(collator, PackingCollator)
    assert collator.flatten is flatten
    assert collator.return_flash_attention_kwargs is attn.startswith("flash_attention")
