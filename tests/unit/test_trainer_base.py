"""The pieces the three trainers share: the metric accumulator, the last-token helper, the one value-head builder."""

import math

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.models.value_head import ValueHeadModel, last_token_columns, new_value_head
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


class _GatherRanks:
    """An accelerator stand-in whose `gather` concatenates this rank's tensor with another rank's."""

    device = torch.device("cpu")
    num_processes = 2

    def __init__(self, other):
        self.other = other

    def reduce(self, tensor, reduction="sum"):
        return tensor + self.other.pop("sums")

    def gather(self, tensor):
        return torch.cat([tensor, self.other.pop("extremes")])


def test_accumulator_min_max_over_micro_batches():
    metrics = MetricAccumulator()
    metrics.add_min("min_reward", torch.tensor([0.5, -1.0, 2.0]))
    metrics.add_max("max_reward", torch.tensor([0.5, -1.0, 2.0]))
    metrics.add_min("min_reward", torch.tensor(-0.25))
    metrics.add_max("max_reward", torch.tensor([[3.0], [1.0]]))
    metrics.add_min("min_reward", torch.tensor([]))  # an empty batch changes nothing
    assert metrics.means() == {"max_reward": 3.0, "min_reward": -1.0}
    assert not metrics
    metrics.add_max("max_reward", torch.tensor(-7.0))  # a fresh window after a log
    assert metrics.totals() == {"max_reward": (-7.0, 1.0)}
    with pytest.raises(ValueError, match="another kind"):
        metrics.add_min("max_reward", 1.0)


def test_accumulator_min_max_reduce_over_ranks_as_min_max_not_sum():
    metrics = MetricAccumulator()
    metrics.add("accuracy", torch.tensor(1.0), torch.tensor(2.0))
    metrics.add_min("min_reward", torch.tensor([0.5, 1.0]))
    metrics.add_max("max_reward", torch.tensor([0.5, 1.0]))
    # the other rank: accuracy 2 of 2; rewards in [-3, 4]; extremes are stored in name order, a max negated
    other = {"sums": torch.tensor([[2.0, 2.0]], dtype=torch.float64),
             "extremes": torch.tensor([-4.0, -3.0], dtype=torch.float64)}
    totals = metrics.totals(_GatherRanks(other))
    assert totals == {"accuracy": (3.0, 4.0), "max_reward": (4.0, 1.0), "min_reward": (-3.0, 1.0)}
    assert not other  # one collective of each kind


def test_accumulator_min_max_under_two_real_processes(tmp_path):
    """Two gloo processes: each rank's min / max and sums are reduced through a real `Accelerator`."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import json, sys, torch
        from accelerate import Accelerator
        from hf_rlhf.trainers.metrics import MetricAccumulator
        acc = Accelerator(cpu=True)
        rank = acc.process_index
        m = MetricAccumulator()
        rewards = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([-5.0, 9.0])
        m.add_min("min_reward", rewards); m.add_max("max_reward", rewards); m.add("mean_reward", rewards.sum(), 2)
        if rank == 0:
            json.dump(m.means(acc), open(sys.argv[1], "w"))
        else:
            m.means(acc)
    """))
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                    "--master_addr=127.0.0.1",
                    str(script), str(out)], capture_output=True, text=True, timeout=120, check=False)
    import json

    assert out.exists(), proc.stderr[-3000:]

    assert json.loads(out.read_text()) == {"max_reward": 9.0, "mean_reward": 1.75, "min_reward": -5.0}


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


def test_flops_estimate_is_the_trainers_with_the_parameter_count_taken_once():
    import types

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    from hf_rlhf.trainers.base_trainer import BaseTrainer

    def counted_model(layers: int) -> tuple[LlamaForCausalLM, list]:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=layers, num_attention_heads=2))
        calls, count = [], model.num_parameters
        model.num_parameters = lambda **kwargs: (calls.append(kwargs), count(**kwargs))[1]
        return model, calls

    model, calls = counted_model(2)
    trainer = types.SimpleNamespace(model=model)  # what the method reads of a trainer
    inputs = {"input_ids": torch.ones(4, 10, dtype=torch.long)}
    expected = Trainer.floating_point_ops(trainer, inputs)  # transformers' own estimate
    assert expected == 6 * 40 * model.num_parameters(exclude_embeddings=True) > 0
    calls.clear()
    assert [BaseTrainer.floating_point_ops(trainer, inputs) for _ in range(3)] == [expected] * 3
    assert calls == [{"exclude_embeddings": True}]  # counted once, not per step
    assert BaseTrainer.floating_point_ops(trainer, {"input_ids": torch.ones(1, 5, dtype=torch.long)}) == expected // 8
    trainer.model, calls = counted_model(3)  # another model: counted again
    assert BaseTrainer.floating_point_ops(trainer, inputs) == Trainer.floating_point_ops(trainer, inputs) > expected
    assert BaseTrainer.floating_point_ops(trainer, {"pixel_values": torch.ones(1)}) == 0
