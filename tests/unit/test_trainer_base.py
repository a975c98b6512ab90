"""The pieces the three trainers share: the metric accumulator, the last-token helper, the one value-head builder."""

import math

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.reward_models import ValueHeadModel, last_token_columns, new_value_head
from hf_rlhf.tensors import last_true_indices
from hf_rlhf.trainers.metrics import MetricAccumulator


def test_accumulator_weighted_means_sums_and_reset():
    metrics = MetricAccumulator()
    metrics.add("token_mean", torch.tensor(6.0), torch.tensor(3.0))  # three tokens of value 2
    metrics.add("token_mean", torch.tensor(1.0), torch.tensor(1.0))  # one token of value 1
    metrics.add("calls", 5.0)
    metrics.add("calls", 7.0)
    metrics.add("count_only", torch.tensor(4.0), 0)
    assert metrics.totals() == {"calls": (12.0, 2.0), "count_only": (4.0, 0.0), "token_mean": (7.0, 4.0)}
    assert not metrics  # read once, then empty
    metrics.add("token_mean", torch.tensor(6.0), torch.tensor(3.0))
    metrics.add("count_only", torch.tensor(4.0), 0)
    assert metrics.means() == {"token_mean": 2.0}  # a zero weight is a total, not a mean


class _TwoRanks:
    """An accelerator stand-in whose `reduce` adds a second rank holding the same sums."""

    device = torch.device("cpu")
    num_processes = 2

    def reduce(self, tensor, reduction="sum"):
        assert reduction == "sum"
        return tensor * 2


def test_accumulator_reduces_over_ranks_in_one_collective():
    metrics = MetricAccumulator()
    metrics.add("a", torch.tensor(3.0), torch.tensor(2.0))
    metrics.add("b", torch.tensor(1.0))
    assert metrics.totals(_TwoRanks()) == {"a": (6.0, 4.0), "b": (2.0, 2.0)}


def test_last_true_indices_left_right_none_and_empty_rows():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert last_true_indices(mask).tolist() == [2, 4, 4, 0]
    assert last_true_indices(mask.bool()).tolist() == [2, 4, 4, 0]
    with pytest.raises(ValueError, match="no real token"):
        last_token_columns(mask)  # the reward reader refuses the empty row the plain helper maps to 0


def test_value_head_builder_init_and_both_users_share_it():
    torch.manual_seed(0)
    head = new_value_head(4095)
    assert head.weight.shape == (1, 4095) and head.bias.item() == 0.0
    assert abs(head.weight.std().item() - 1 / math.sqrt(4096)) < 0.1 / math.sqrt(4096)
    assert new_value_head(8, init_std=0.0).weight.abs().sum() == 0

    from transformers import LlamaConfig, LlamaForCausalLM

    causal = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2))
    torch.manual_seed(1)
    model = ValueHeadModel(causal)
    torch.manual_seed(1)
    assert_close(model.v_head.weight, new_value_head(16).weight)
