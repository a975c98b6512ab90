"""`PPOConfig.group_by_length`: each optimizer step's micro-batches re-cut by length (the step's rows unchanged), and
the option's rules (not with bnpo's per-micro-batch token mean; the Trainer's sampler refused)."""

import itertools

import pytest
import torch
from datasets import Dataset

from hf_rlhf.rollout.experience import Experience
from hf_rlhf.rollout.loader import ExperienceLoader, group_steps_by_length, length_keys
from hf_rlhf.trainers.ppo_config import PPOConfig


def test_group_steps_by_length_by_hand():
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    keys = [9, 1, 8, 2, 3, 4, 0, 0]
    # step 1 = rows 0-3 sorted by key: 1 (1), 3 (2), 2 (8), 0 (9); step 2 = rows 4-7: 6, 7 (0, in order), 4, 5
    assert group_steps_by_length(batches, keys, per_step=2) == [[1, 3], [2, 0], [6, 7], [4, 5]]
    # one micro-batch per step: nothing to re-cut, only the order inside a micro-batch changes
    assert group_steps_by_length(batches, keys, per_step=1) == [[1, 0], [3, 2], [4, 5], [6, 7]]


def _experience(prompt_lengths, response_lengths):
    """A rollout whose rows have these prompt (left-padded) and response (right-padded) lengths."""
    batch, q, r = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    columns_q, columns_r = torch.arange(q), torch.arange(r)
    query_mask = (columns_q >= q - torch.tensor(prompt_lengths).unsqueeze(1)).long()
    response_mask = (columns_r < torch.tensor(response_lengths).unsqueeze(1)).long()
    rows = torch.arange(batch).unsqueeze(1)
    zeros = torch.zeros(batch, r)
    return Experience(query_ids=(rows + 10) * query_mask, query_mask=query_mask,
                      response_ids=(rows + 10) * response_mask, response_mask=response_mask, old_logprobs=zeros,
                      ref_logprobs=zeros, old_values=zeros, scores=torch.zeros(batch), rewards=zeros,
                      advantages=zeros, returns=zeros)


def test_length_keys_keep_a_prompts_rows_together():
    experience = _experience([3, 3, 1, 1, 3, 3], [2, 1, 4, 3, 1, 2])
    assert length_keys(experience, 1) == [(3, 0, 2), (3, 0, 1), (1, 0, 4), (1, 0, 3), (3, 0, 1), (3, 0, 2)]
    # G = 2: rows (0, 1), (2, 3), (4, 5) are three prompts; two of one length stay apart from each other
    keys = length_keys(experience, 2)
    assert sorted(range(6), key=keys.__getitem__) == [3, 2, 1, 0, 4, 5]


# short rows (a 1-token prompt and response) and long ones (8 and 4)
PROMPTS = [1, 8] * 8
RESPONSES = [1, 4] * 8


def _loader(group_by_length: bool, global_step: int = 0):
    dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(16)], "input_ids": [[i] for i in range(16)]})

    def make(rows, indices):
        return _experience([PROMPTS[i] for i in indices], [RESPONSES[i] for i in indices]), {}

    return ExperienceLoader(dataset, make, rollout_batch_size=8, micro_batch_size=4, num_ppo_epochs=2, seed=0,
                            gradient_accumulation_steps=2, group_by_length=group_by_length,
                            get_global_step=lambda: global_step)


def _rows(batch) -> list[int]:
    return (batch["query_ids"].max(1).values - 10).tolist()  # the row ids written into the query ids


def test_grouped_steps_hold_the_same_rows_with_less_padding():
    plain, grouped = list(_loader(False)), list(_loader(True))
    assert len(plain) == len(grouped) == 8  # 2 rollouts x 2 epochs x 2 micro-batches
    padded = {False: 0, True: 0}
    for step in range(0, 8, 2):  # two micro-batches per optimizer step
        assert sorted(_rows(plain[step]) + _rows(plain[step + 1])) == sorted(
            _rows(grouped[step]) + _rows(grouped[step + 1])), f"step {step // 2} holds other rows"
        # cut by length: the short rows first, so at most one micro-batch of the step mixes short and long rows
        kinds = [{int(n) for n in batch["query_mask"].sum(1)} for batch in grouped[step:step + 2]]
        assert max(kinds[0]) <= min(kinds[1]) and sum(len(k) > 1 for k in kinds) <= 1, kinds
        for flag, batches in ((False, plain), (True, grouped)):
            for batch in batches[step:step + 2]:  # trimmed: the widths are the micro-batch's longest rows
                padded[flag] += batch["query_mask"].numel() + batch["response_mask"].numel() - int(
                    batch["query_mask"].sum() + batch["response_mask"].sum())
    assert padded[True] < padded[False], padded


def test_a_resumed_run_reads_the_same_grouped_micro_batches(tmp_path):
    full = [_rows(batch) for batch in _loader(True)]
    loader = _loader(True)
    iterator = iter(loader)
    for _ in range(2):  # a checkpoint after the first step, inside the first rollout: its experience and cut saved
        next(iterator)
    loader.save_state(str(tmp_path))
    resumed = _loader(True, global_step=1)
    resumed.get_resume_dir = lambda: str(tmp_path)
    resumed.make_experience = None  # the rollout is read back, never made again
    assert [_rows(batch) for batch in itertools.islice(resumed, 2)] == full[2:4]  # the rest of the first rollout


def _config(tmp_path, **kw):
    return PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     report_to="none", **kw)


def test_group_by_length_is_on_by_default_but_not_for_bnpo(tmp_path):
    assert _config(tmp_path).group_by_length is None and _config(tmp_path).micro_batches_by_length
    for loss_type in ("grpo", "dr_grpo"):
        assert _config(tmp_path, loss_type=loss_type).micro_batches_by_length
    assert not _config(tmp_path, loss_type="bnpo").micro_batches_by_length
    assert not _config(tmp_path, group_by_length=False).micro_batches_by_length
    with pytest.raises(ValueError, match="group_by_length=True .* loss_type='bnpo'"):
        _config(tmp_path, group_by_length=True, loss_type="bnpo")


def test_the_trainers_sampler_is_refused(tmp_path):
    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length' is the Trainer's sampler"):
        _config(tmp_path, train_sampling_strategy="group_by_length")
