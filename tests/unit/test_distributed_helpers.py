"""Pieces of multi-process correctness that run in one process: whitening over all ranks, the accelerate configs."""

from pathlib import Path

import pytest
import torch
import yaml
from torch.testing import assert_close

from hf_rlhf.tensors import masked_sum, masked_whiten

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"


class TwoRanks:
    """`all_reduce_sum` as seen by one rank when the other holds (`x`, `mask`): adds the other rank's share of each of
    masked_whiten's two reductions, [count, sum] and then the squared deviations from the (global) mean."""

    def __init__(self, x, mask):
        self.x, self.mask, self.mean = x, mask, None

    def __call__(self, tensor):
        if self.mean is None:  # the first reduction: [count, sum]
            other = torch.stack([self.mask.sum().to(self.x.dtype), masked_sum(self.x, self.mask)])
            total = tensor + other
            self.mean = total[1] / total[0]
            return total
        return tensor + masked_sum((self.x - self.mean).square(), self.mask)


def test_masked_whiten_over_ranks_equals_one_process():
    torch.manual_seed(0)
    x, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).long()
    x[mask == 0] = float("nan")  # padding garbage never leaks in
    whole = masked_whiten(x, mask)
    for shift in (True, False):
        whole = masked_whiten(x, mask, shift_mean=shift)
        rank0 = masked_whiten(x[:3], mask[:3], shift_mean=shift, all_reduce_sum=TwoRanks(x[3:], mask[3:]))
        rank1 = masked_whiten(x[3:], mask[3:], shift_mean=shift, all_reduce_sum=TwoRanks(x[:3], mask[:3]))
        assert_close(torch.cat([rank0, rank1]), whole)
    # and the per-rank statistics alone would differ: the test sees a missing reduction
    assert not torch.allclose(masked_whiten(x[:3], mask[:3]), whole[:3])


def test_masked_whiten_over_ranks_needs_two_elements():
    x, mask = torch.ones(1, 3), torch.tensor([[1, 0, 0]])
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, mask, all_reduce_sum=lambda t: t)


@pytest.mark.parametrize("name", ["ddp", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload", "fsdp"])
def test_accelerate_config_loads_and_documents_cpu_use(name):
    from accelerate.commands.config.config_args import ClusterConfig

    path = CONFIGS / f"{name}.yaml"
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert text.startswith("# ") and len(header) >= 4, "each config starts with a comment saying when to use it"
    assert "--mixed_precision no" in text and "--num_processes 2" in text  # the CPU overrides
    config = ClusterConfig.from_yaml_file(str(path))
    expected = {"ddp": "MULTI_GPU", "fsdp": "FSDP"}.get(name, "DEEPSPEED")
    assert str(config.distributed_type).endswith(expected)
    assert config.mixed_precision == "bf16" and not config.use_cpu  # GPU settings; the CPU tests override them
    raw = yaml.safe_load(text)
    if expected == "DEEPSPEED":
        ds = raw["deepspeed_config"]
        assert ds["zero_stage"] == (2 if name == "deepspeed_zero2" else 3)
        if ds["zero_stage"] == 3:  # full weights in the saved model, created sharded
            assert ds["zero3_save_16bit_model"] and ds["zero3_init_flag"]
        assert (ds["offload_param_device"] == "cpu") == name.endswith("offload")
    if name == "fsdp":
        assert raw["fsdp_config"]["fsdp_state_dict_type"] == "FULL_STATE_DICT"
