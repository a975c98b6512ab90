"""Left-padded batches give every row what it gives alone, on every architecture (absolute position embeddings
included: GPT-2 placed a row's first token at the position = its padding before `position_ids` were passed)."""

import pytest
import torch
from torch.testing import assert_close
from zoo_models import MODEL_TYPES, PAD_ID, TOKENIZER, build, random_sequences

from hf_rlhf.collators import LeftPaddingCollator
from hf_rlhf.models.value_head import ValueHeadModel, get_rewards
from hf_rlhf.rewards import ModelReward

LENGTHS = [9, 3, 6]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_left_padding_collator_batch_equals_each_row_alone(model_type):
    model = build(model_type)
    sequences = random_sequences(LENGTHS)
    batch = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": s} for s in sequences])
    with torch.no_grad():
        batched = model(**batch, use_cache=False).logits
        for row, seq in enumerate(sequences):
            alone = model(torch.tensor([seq]), use_cache=False).logits[0]
            assert_close(batched[row, -len(seq):], alone, atol=1e-5, rtol=1e-4, msg=f"row {row}")


@pytest.mark.parametrize("kind", ["seq_cls", "value_head"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_get_rewards_of_a_left_padded_batch_equal_each_row_alone(model_type, kind):
    model = build(model_type, "seq_cls") if kind == "seq_cls" else ValueHeadModel(build(model_type)).eval()
    sequences = random_sequences(LENGTHS, seed=1)
    batch = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": s} for s in sequences])
    batched = get_rewards(model, batch["input_ids"], batch["attention_mask"])  # positions derived from the mask
    alone = torch.cat([get_rewards(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))
                       for s in sequences])
    assert_close(batched, alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["seq_cls", "value_head"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_ppo_reward_scores_of_a_batch_equal_each_completion_alone(model_type, kind):
    model = build(model_type, "seq_cls") if kind == "seq_cls" else ValueHeadModel(build(model_type)).eval()
    source = ModelReward(model, TOKENIZER, batch_size=8)
    prompts = ["max 29 0 35 75=", "add 3 4=", "rev abcdefgh="]
    completions = ["75", "7 is the sum of them", "hgfedcba"]
    batched = source(prompts, completions)
    alone = torch.cat([source([p], [c]) for p, c in zip(prompts, completions)])
    assert_close(batched, alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_generate_from_a_left_padded_batch_equals_each_prompt_alone(model_type):
    model = build(model_type)
    sequences = random_sequences([7, 3], seed=2)
    batch = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": s} for s in sequences])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD_ID, eos_token_id=None, output_scores=True,
                  return_dict_in_generate=True)
    # generate builds its own positions from the mask (`position_ids` is not one of its inputs)
    out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    for row, seq in enumerate(sequences):
        alone = model.generate(input_ids=torch.tensor([seq]), **kwargs)
        assert_close(torch.stack(out.scores)[:, row], torch.stack(alone.scores)[:, 0], atol=1e-5, rtol=1e-4)
        assert out.sequences[row, -5:].tolist() == alone.sequences[0, -5:].tolist()
