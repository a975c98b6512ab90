"""SFT `packing=True` / `padding_free=True` give every token the loss and logits it has when its example runs
alone, on every architecture and attention; or the trainer refuses when it is built (and the refusal is true:
with the check off, the packed losses do differ)."""

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from zoo_models import MODEL_TYPES, TOKENIZER, attentions, build, random_sequences

from hf_rlhf import SFTConfig, SFTTrainer
from hf_rlhf.models.packing_check import PackingCheckError

# (length, prompt length): prompts are masked out of the loss through `completion_mask`
SHAPES = [(9, 3), (5, 2), (12, 4), (7, 0)]
CELLS = [(m, a, layout) for m in MODEL_TYPES for a in attentions(m) for layout in ("packing", "padding_free")]


def examples():
    sequences = random_sequences([n for n, _ in SHAPES], seed=5)
    return [{"input_ids": s, "completion_mask": [0] * p + [1] * (len(s) - p)} for s, (_, p) in zip(sequences, SHAPES)]


def make_trainer(tmp_path, model, layout, check=True):
    # an MoE's router load-balancing loss is a statistic of the whole batch, not of each token: the comparison is
    # of the language-modelling loss, so it is switched off (router_aux_loss_coef=0) where the model has one
    moe = {"router_aux_loss_coef": 0.0} if hasattr(model.config, "router_aux_loss_coef") else {}
    # the full logits (chunked_lm_head=False): the test compares them; tests/zoo/test_lm_head.py the chunked loss
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=24, per_device_train_batch_size=4,
                     save_strategy="no", disable_tqdm=True, packing_check=check, chunked_lm_head=False,
                     **{layout: True}, **moe)
    return SFTTrainer(model, args=args, train_dataset=Dataset.from_list(examples()), processing_class=TOKENIZER)


def alone(model, example):
    """(logits (T, V), per-token losses of the trained tokens) of one example run alone."""
    ids = torch.tensor([example["input_ids"]])
    logits = model(ids, use_cache=False).logits[0]
    labels = torch.tensor(example["input_ids"]).masked_fill(torch.tensor(example["completion_mask"]) == 0, -100)
    return logits, F.cross_entropy(logits[:-1], labels[1:], reduction="none", ignore_index=-100)[labels[1:] != -100]


def packed_sequences(batch, logits):
    """[(input_ids, logits (n, V))] of every sequence of a packed batch, split where position_ids restart."""
    out = []
    for row in range(batch["input_ids"].shape[0]):
        starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
        for start, end in zip(starts, starts[1:]):
            out.append((batch["input_ids"][row, start:end].tolist(), logits[row, start:end]))
    return out


def compare(model, trainer):
    """(max logit difference, packed loss, separate loss) over the trainer's collated train set."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(model, batch, return_outputs=True)
        by_ids = {tuple(e["input_ids"]): e for e in examples()}
        seen, difference, losses = 0, 0.0, []
        for ids, logits in packed_sequences(batch, outputs.logits):
            if tuple(ids) not in by_ids:  # the dummy sequence that pads a row
                continue
            expected_logits, token_losses = alone(model, by_ids[tuple(ids)])
            difference = max(difference, (logits - expected_logits).abs().max().item())
            losses.append(token_losses)
            seen += 1
    assert seen == len(SHAPES)
    return difference, loss.item(), torch.cat(losses).mean().item()


@pytest.mark.parametrize("model_type,attn,layout", CELLS, ids=["-".join(c) for c in CELLS])
def test_sft_packed_equals_each_example_alone_or_refuses(tmp_path, record_property, model_type, attn, layout):
    model = build(model_type, attn=attn)
    try:
        trainer = make_trainer(tmp_path, model, layout)
    except PackingCheckError as err:
        message = str(err)
        assert model_type in message and f"{layout}=True" in message and "packing_check=False" in message
        record_property("refusal", message)
        # the refusal is true: built anyway, the packed batch gives other logits and another loss
        difference, packed, separate = compare(model, make_trainer(tmp_path, model, layout, check=False))
        assert difference > 1e-3 and abs(packed - separate) > 1e-4, (difference, packed, separate)
        return
    difference, packed, separate = compare(model, trainer)
    assert difference < 1e-4, difference
    assert packed == pytest.approx(separate, abs=1e-5)


def test_opt_refuses_packing(tmp_path):
    with pytest.raises(PackingCheckError, match=r"padding_free=True is not exact on this model \(opt"):
        make_trainer(tmp_path, build("opt"), "padding_free")


def test_packing_check_in_bfloat16_keeps_the_training_mode():
    from hf_rlhf.models.packing_check import check_packing_exact

    llama = build("llama").to(torch.bfloat16).train()
    assert check_packing_exact(llama, "padding_free") < 3e-2 and llama.training
    with pytest.raises(PackingCheckError, match=r"\(opt, sdpa attention, torch.bfloat16\)"):
        check_packing_exact(build("opt").to(torch.bfloat16), "packing")
    with pytest.raises(ValueError, match="layout must be one of"):
        check_packing_exact(llama, "packed")
