"""Where hf_rlhf now goes through trl/peft instead of its own code: the same config objects as before."""

import dataclasses

import pytest
import torch
import trl
from transformers import HfArgumentParser

from hf_rlhf import ModelConfig
from hf_rlhf.collators.padding import pad_sequences
from hf_rlhf.models.loading import lora_config, quantization_config


def _parse(*argv):
    (config,) = HfArgumentParser(ModelConfig).parse_args_into_dataclasses(list(argv))
    return config


def test_model_config_is_trls_with_our_defaults():
    ours = ModelConfig()
    assert isinstance(ours, trl.ModelConfig)
    assert {f.name for f in dataclasses.fields(trl.ModelConfig)} <= {f.name for f in dataclasses.fields(ModelConfig)}
    assert ours.dtype == "float32" == trl.ModelConfig().dtype
    assert ours.attn_implementation == "sdpa" and trl.ModelConfig().attn_implementation is None


def test_model_config_parses_the_same_options_as_before():
    for flag in ("--use_bnb_nested_quant", "--bnb_4bit_use_double_quant"):
        config = _parse("--use_peft", "--load_in_4bit", flag)
        assert config.use_bnb_nested_quant is True and config.bnb_4bit_use_double_quant is True
    assert _parse("--lora_target_modules", "q_proj").lora_target_modules == "q_proj"
    assert _parse("--lora_target_modules", "all-linear").lora_target_modules == "all-linear"
    assert _parse("--lora_target_modules", "q_proj", "v_proj").lora_target_modules == ["q_proj", "v_proj"]
    config = _parse("--dtype", "bfloat16", "--trust_remote_code", "--bnb_4bit_compute_dtype", "float16")
    assert (config.dtype, config.trust_remote_code, config.bnb_4bit_compute_dtype) == ("bfloat16", True, "float16")
    with pytest.raises(ValueError, match="not used"):
        _parse("--lora_rank", "8")  # unknown options stay errors
    with pytest.raises(TypeError):
        ModelConfig(lora_rank=8)
    with pytest.raises(ValueError, match="cannot both"):
        _parse("--use_peft", "--load_in_4bit", "--load_in_8bit")


def _hand_built_lora(mc, task_type=None):
    """What `lora_config` built by hand before it went through trl.get_peft_config."""
    from peft import LoraConfig

    return LoraConfig(r=mc.lora_r, lora_alpha=mc.lora_alpha, lora_dropout=mc.lora_dropout,
                      target_modules=mc.lora_target_modules or "all-linear", modules_to_save=mc.lora_modules_to_save,
                      task_type=task_type or mc.lora_task_type, use_rslora=mc.use_rslora, use_dora=mc.use_dora,
                      bias="none")


@pytest.mark.parametrize("kwargs", [
    {},
    {"lora_target_modules": ["q_proj"], "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
    {"lora_target_modules": ["q_proj", "v_proj"], "lora_modules_to_save": ["score"], "use_rslora": True,
     "use_dora": True, "lora_task_type": "SEQ_CLS"},
])
def test_lora_config_is_the_same_object_as_before(kwargs):
    mc = ModelConfig(use_peft=True, **kwargs)
    assert lora_config(mc).to_dict() == _hand_built_lora(mc).to_dict()
    assert lora_config(mc, task_type="CAUSAL_LM").to_dict() == _hand_built_lora(mc, "CAUSAL_LM").to_dict()
    if mc.lora_target_modules is not None:  # the only difference from TRL is the None -> "all-linear" default
        assert lora_config(mc).to_dict() == trl.get_peft_config(mc).to_dict()
    assert lora_config(ModelConfig(**kwargs)) is None


def test_lora_config_passes_trls_target_parameters():
    mc = ModelConfig(use_peft=True, lora_target_modules=["q_proj"], lora_target_parameters=["experts.down_proj"])
    assert lora_config(mc).target_parameters == ["experts.down_proj"]


def _hand_built_bnb(mc):
    """What `quantization_config` built by hand before it went through trl.get_quantization_config."""
    from transformers import BitsAndBytesConfig

    from hf_rlhf.models.loading import resolve_dtype

    if mc.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = resolve_dtype(mc.bnb_4bit_compute_dtype) if mc.bnb_4bit_compute_dtype else (
        torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    storage = resolve_dtype(mc.bnb_4bit_quant_storage) if mc.bnb_4bit_quant_storage else None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mc.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=mc.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=storage or torch.uint8)


@pytest.mark.parametrize("kwargs", [
    {"load_in_4bit": True},
    {"load_in_4bit": True, "bnb_4bit_use_double_quant": True, "bnb_4bit_quant_type": "fp4"},
    {"load_in_4bit": True, "use_bnb_nested_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
     "bnb_4bit_quant_storage": "bfloat16", "dtype": "bfloat16"},
    {"load_in_8bit": True},
])
def test_quantization_config_is_the_same_object_as_before(kwargs):
    pytest.importorskip("bitsandbytes")
    mc = ModelConfig(use_peft=True, **kwargs)
    assert quantization_config(mc).to_dict() == _hand_built_bnb(mc).to_dict()
    if mc.load_in_8bit or mc.dtype == mc.bnb_4bit_compute_dtype:  # where TRL's dtype-tied compute agrees
        assert quantization_config(mc).to_dict() == trl.get_quantization_config(mc).to_dict()


def test_quantization_config_keeps_fp32_compute_on_cpu_where_trl_fails_on_auto():
    pytest.importorskip("bitsandbytes")
    mc = ModelConfig(use_peft=True, load_in_4bit=True, dtype="auto")
    with pytest.raises(AttributeError):
        trl.get_quantization_config(mc)
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert quantization_config(mc).bnb_4bit_compute_dtype == expected
    assert mc.dtype == "auto"  # asking TRL did not change the caller's config
    with pytest.raises(ValueError, match="dtype must be one of"):
        quantization_config(ModelConfig(use_peft=True, load_in_4bit=True, bnb_4bit_compute_dtype="fp8"))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("multiple", [None, 8])
def test_pad_sequences_equals_trl_pad(side, multiple):
    # the collators keep pad_sequences: the same tensor as trl's pad, ~1.3x faster on a 256-pair batch
    from trl.trainer.utils import pad

    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(1, 100, (int(n),), generator=generator).tolist()
                 for n in torch.randint(1, 40, (16,), generator=generator)]
    expected = pad([torch.tensor(s) for s in sequences], padding_value=0, padding_side=side,
                   pad_to_multiple_of=multiple)
    assert torch.equal(pad_sequences(sequences, 0, padding_side=side, pad_to_multiple_of=multiple), expected)
