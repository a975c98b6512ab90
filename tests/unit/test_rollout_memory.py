"""What a long PPO / GRPO run keeps alive between rollouts (issue 44, the soak): the experience of a rollout that is
all handed out is freed before the next rollout is generated, and many rollouts leave no more live tensors than one.
"""

import gc
import weakref

import torch
from datasets import Dataset

from hf_rlhf.rollout.experience import Experience
from hf_rlhf.rollout.loader import ExperienceLoader


def _experience(batch: int, width: int = 6) -> Experience:
    mask = torch.ones(batch, width, dtype=torch.long)
    zeros = torch.zeros(batch, width)
    return Experience(query_ids=mask.clone(), query_mask=mask, response_ids=mask.clone(), response_mask=mask,
                      old_logprobs=zeros, ref_logprobs=zeros.clone(), old_values=zeros.clone(),
                      scores=torch.zeros(batch), rewards=zeros.clone(), advantages=zeros.clone(),
                      returns=zeros.clone())


def _loader(make, rollouts: int) -> ExperienceLoader:
    dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(4 * rollouts)], "input_ids": [[0]] * 4 * rollouts})
    return ExperienceLoader(dataset, make, rollout_batch_size=4, micro_batch_size=2, num_ppo_epochs=1, seed=0,
                            get_global_step=lambda: 0)


def test_the_previous_rollout_is_freed_before_the_next_one_is_made():
    made, alive_while_making = [], []

    def make(rows, indices):
        gc.collect()
        alive_while_making.append([ref() is not None for ref in made])
        experience = _experience(len(rows))
        made.append(weakref.ref(experience))
        return experience, {"objective/kl_coef": 0.1}

    for _batch in _loader(make, rollouts=3):  # the trainer's loop: each micro-batch used, then dropped
        pass
    assert alive_while_making == [[], [False], [False, False]]


def test_many_rollouts_leave_no_more_live_tensors_than_one():
    def make(rows, indices):
        return _experience(len(rows)), {"objective/kl_coef": 0.1}

    def live_tensors_after(rollouts: int) -> int:
        loader = _loader(make, rollouts)
        iterator = iter(loader)
        for _ in range(2 * rollouts):  # two micro-batches per rollout; the iterator stays open, as mid-epoch
            batch = next(iterator)
        del batch
        gc.collect()
        count = sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
        iterator.close()
        return count

    one = live_tensors_after(1)
    assert live_tensors_after(20) <= one
