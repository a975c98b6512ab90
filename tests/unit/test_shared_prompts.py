"""`hf_rlhf.rollout.shared_prompts.shared_prompt_layout`: hand-computed layouts, masks and gathers."""

import torch

from hf_rlhf.rollout.shared_prompts import shared_prompt_layout


def test_distinct_prompts_have_nothing_to_share():
    query = torch.tensor([[0, 5], [6, 7]])
    assert shared_prompt_layout(query, (query > 0).long(), torch.tensor([[1], [2]]), torch.ones(2, 1)) is None


def test_layout_of_two_groups_hand_computed():
    # rows 0 and 2 share prompt [_, 5] (left-padded), row 1 has prompt [6, 7]; responses are 2 wide
    query_ids = torch.tensor([[0, 5], [6, 7], [0, 5]])
    query_mask = torch.tensor([[0, 1], [1, 1], [0, 1]])
    response_ids = torch.tensor([[1, 2], [4, 0], [3, 0]])
    response_mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    layout = shared_prompt_layout(query_ids, query_mask, response_ids, response_mask, pad_token_id=9)
    # unique() orders the groups by their prompt: [0, 5] first
    assert layout.group.tolist() == [0, 1, 0]
    # the responses as given (their own padding too); the unused slot: pad_token_id
    assert layout.inputs["input_ids"].tolist() == [[0, 5, 1, 2, 3, 0], [6, 7, 4, 0, 9, 9]]
    # positions continue from each prompt's real tokens, as the padded layout's (cumsum of the mask - 1)
    assert layout.inputs["position_ids"].tolist() == [[0, 0, 1, 2, 1, 1], [0, 1, 2, 2, 0, 0]]
    allowed = layout.inputs["attention_mask"][:, 0].int()
    assert allowed.shape == (2, 6, 6)
    assert allowed[0].tolist() == [
        [1, 0, 0, 0, 0, 0],  # prompt padding: itself only (no all-False row: sdpa would give NaN)
        [0, 1, 0, 0, 0, 0],  # the prompt's token
        [0, 1, 1, 0, 0, 0],  # completion 1, token 1: prompt + itself
        [0, 1, 1, 1, 0, 0],  # completion 1, token 2
        [0, 1, 0, 0, 1, 0],  # completion 2, token 1: the prompt, not completion 1
        [0, 1, 0, 0, 0, 1],  # completion 2's padding: the prompt and itself (never read)
    ]
    assert allowed[1].tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],  # padding columns: the prompt and themselves
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]
    # kept logits start at the prompt's last column: row 0 reads 0 (predicts token 1) and 1; row 2 (slot 1) 0 and 3
    assert layout.keep == 5
    assert layout.index.tolist() == [[0, 1], [0, 1], [0, 3]]
    kept = torch.arange(2 * 5).reshape(2, 5) * 10
    assert layout.gather(kept).tolist() == [[0, 10], [50, 60], [0, 30]]
