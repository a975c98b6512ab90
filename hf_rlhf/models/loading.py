"""Model loading: dtype, attention implementation, bitsandbytes 4/8-bit and LoRA through peft.

Everything here is a thin layer over `from_pretrained`, `trl.get_quantization_config`, `trl.get_peft_config`,
`peft.prepare_model_for_kbit_training` and `peft.get_peft_model`: the same calls a user would write,
driven by one `ModelConfig`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from trl import get_peft_config, get_quantization_config

from ..imports import require
from ..trainers.model_config import ModelConfig

logger = logging.getLogger("hf_rlhf")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | None) -> torch.dtype | str | None:
    """'auto' / None stay as they are (transformers decides); names map to torch dtypes."""
    if name in (None, "auto"):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}.")
    return _DTYPES[name]


def quantization_config(model_config: ModelConfig):
    """A `BitsAndBytesConfig` for 4/8-bit loading, or None: `trl.get_quantization_config`. Needs the `qlora` extra.

    TRL takes the 4-bit compute dtype from `dtype`, which fails for "auto", and bf16 compute is slow on CPU while fp32
    is slow on CUDA; so TRL is asked with `dtype` set to `bnb_4bit_compute_dtype` (None: bfloat16 on CUDA, float32 on
    CPU).
    """
    if not (model_config.load_in_4bit or model_config.load_in_8bit):
        return None
    require("bitsandbytes", "4/8-bit loading (QLoRA)")
    compute = model_config.bnb_4bit_compute_dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    for name in (compute, model_config.bnb_4bit_quant_storage):
        resolve_dtype(name)  # a clear error for a bad dtype name before transformers' getattr(torch, name)
    return get_quantization_config(dataclasses.replace(model_config, dtype=compute))


def lora_config(model_config: ModelConfig, task_type: str | None = None):
    """A `peft.LoraConfig` from `ModelConfig` (`trl.get_peft_config`), or None when `use_peft` is off.

    `lora_target_modules=None` adapts every linear layer except the output head (peft's "all-linear"), where
    TRL would leave None to peft's per-model default (q_proj, v_proj on Llama). `task_type` overrides
    `model_config.lora_task_type`.
    """
    config = get_peft_config(model_config)
    if config is None:
        return None
    return dataclasses.replace(config, target_modules=model_config.lora_target_modules or "all-linear",
                               task_type=task_type or model_config.lora_task_type)


def _device_map(quantized: bool):
    if not quantized:
        return None
    if torch.cuda.is_available():
        from accelerate import PartialState

        return {"": PartialState().local_process_index}
    return {"": "cpu"}


class ModelUnavailableError(FileNotFoundError):
    """A model, tokenizer or reward model that cannot be loaded from where it was asked for: no such local directory,
    not a valid hub id, not in the local hub cache while offline, or a Hub that cannot be reached or has no such repo.

    Its message is one line naming the path, what was tried and what to do (`check_model_path`, `hub_errors`); a
    recipe or an `hf-rlhf` command prints it as its `[hf_rlhf] error: ...` line and exits 1 (`run_recipe`).

    Attributes:
        kind: "local" (no such local directory, or not a valid hub id), or a hub failure's kind (`hub_failure`):
            "offline", "unreachable", "no_repo", "gated", "revision".
    """

    def __init__(self, message: str, kind: str = "local"):
        super().__init__(message)
        self.kind = kind


LOGIN = "`hf auth login` (or HF_TOKEN)"


def _exception_chain(error: BaseException | None):
    """`error`, then the exceptions it was raised from (or while handling), outermost first."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection errors and timeouts of the socket layer and of the HTTP clients under huggingface_hub and
    transformers (httpx / httpx2, requests): those already imported, since a module not imported raised nothing."""
    import socket
    import sys

    classes = [ConnectionError, TimeoutError, socket.gaierror]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests.exceptions", ("ConnectionError", "Timeout"))):
        loaded = sys.modules.get(module)
        classes += [c for c in (getattr(loaded, name, None) for name in names) if isinstance(c, type)]
    return tuple(classes)


def hub_failure(error: BaseException) -> tuple[str, BaseException] | None:
    """Why a hub look-up failed, read from `error` and the exceptions it was raised from (transformers wraps
    huggingface_hub's errors in an OSError, and those wrap the HTTP client's); None when it is no hub failure.

    Returns:
        (kind, the exception that tells): kind is "gated", "no_repo" or "revision" (the Hub answered no),
        "offline" (HF_HUB_OFFLINE or local_files_only: the Hub was not asked, and the cache has no copy) or
        "unreachable" (a connection error or a timeout, and the cache has no copy).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # GatedRepoError before its base RepositoryNotFoundError; OfflineModeIsEnabled before its base ConnectionError
    kinds = ((GatedRepoError, "gated"), (RepositoryNotFoundError, "no_repo"), (RevisionNotFoundError, "revision"),
             (OfflineModeIsEnabled, "offline"), (_network_errors(), "unreachable"))
    cache_miss = None
    for e in _exception_chain(error):
        for classes, kind in kinds:
            if isinstance(e, classes):
                return kind, e
        if isinstance(e, LocalEntryNotFoundError) and cache_miss is None:
            cache_miss = e
    if cache_miss is not None:  # no cause kept: offline, or the Hub failed in a way not listed above
        return ("offline" if constants.HF_HUB_OFFLINE else "unreachable"), cache_miss
    return None


def _hub_message(path: str, what: str, kind: str, error: BaseException | None = None) -> str:
    """The one line of a `ModelUnavailableError` for a hub failure of `kind` (`hub_failure`)."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    detail = ""
    if error is not None:
        text = " ".join(str(error).split())
        detail = f" ({type(error).__name__}: {text[:150] + '...' if len(text) > 150 else text})"
    local = "no such local directory" if not os.path.isdir(path) else "a local directory that needs files from the Hub"
    if kind == "offline":
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "local_files_only is set"
        return (f"{what} {path!r} not found: {local}, and not in the local hub cache ({why}, so the Hub is not "
                f"asked). Pass a local directory, or download it where the Hub is reachable (`hf download {path}`) "
                "and load the cached copy with HF_HUB_OFFLINE=1")
    if kind == "unreachable":
        return (f"{what} {path!r} not found: {local}, not in the local hub cache, and the Hub at {endpoint} cannot "
                f"be reached{detail}. Pass a local directory, or download it where the Hub is reachable "
                f"(`hf download {path}`) and load the cached copy with HF_HUB_OFFLINE=1; a gated or private repo "
                f"also needs {LOGIN}")
    if kind == "gated":
        return (f"{what} {path!r} is a gated repo on the Hub at {endpoint}{detail}: ask for access on its page and "
                f"log in with {LOGIN}, or pass a local directory")
    if kind == "revision":
        return f"{what} {path!r}: the Hub at {endpoint} has no such revision{detail}; check model_revision"
    return (f"{what} {path!r} not found: {local}, not in the local hub cache, and the Hub at {endpoint} has no such "
            f"repo, or it is private or gated{detail}. Check the id, or log in with {LOGIN}")


def check_model_path(path: str, what: str = "model", *, revision: str | None = None, filename: str = "config.json",
                     cache_dir: str | None = None, token: str | bool | None = None) -> None:
    """Raise a `ModelUnavailableError` (a FileNotFoundError) unless `path` is a local directory or a hub id that can
    be loaded.

    Checked before anything is loaded, so a typo or an unreachable Hub fails at once, in one line naming `path`:
    not with huggingface_hub's "Repo id must be in the form ...", nor with a connection error chain from inside
    `from_pretrained` after its retries (~25 s per file). A hub id with `filename` in the local hub cache passes
    (transformers falls back to the cache when the Hub cannot be reached); offline (`HF_HUB_OFFLINE=1`) one that
    is not in the cache fails; online, one HEAD request for `filename` (no retries) tells whether the Hub can be
    reached and has the repo.

    Args:
        what: how the message names `path` ("model", "reward model", "tokenizer", ...).
        revision, cache_dir, token: as `from_pretrained` takes them.
        filename: the file looked for in the cache and on the Hub (a tokenizer: tokenizer_config.json).
    """
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if isinstance(path, str) and os.path.isdir(path):
        return
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise ModelUnavailableError(f"{what} {path!r} not found: no such local directory, and not a valid hub id "
                                    "('name' or 'org/name')") from None
    if path.startswith((".", "/", "~")) or os.path.isfile(path):
        raise ModelUnavailableError(f"{what} {path!r} not found: no such local directory")
    if try_to_load_from_cache(path, filename, cache_dir=cache_dir, revision=revision) is not None:
        return  # cached, or cached as a file the repo does not have: the repo was loaded before
    if constants.HF_HUB_OFFLINE:
        raise ModelUnavailableError(_hub_message(path, what, "offline"), "offline")
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    try:
        get_hf_file_metadata(hf_hub_url(path, filename, revision=revision), token=token)
    except Exception as error:  # anything but a hub failure (a file the repo lacks) is left to from_pretrained
        failure = hub_failure(error)
        if failure is not None:
            raise ModelUnavailableError(_hub_message(path, what, *failure), failure[0]) from error


@contextlib.contextmanager
def hub_errors(path: str, what: str = "model", *, check: bool = True, **where):
    """Load `path` inside this block: a hub failure of what runs there (`hub_failure`: a connection error or
    timeout, offline mode, a cache miss, a repo that is missing or gated) becomes one `ModelUnavailableError` line
    naming `path`, what was tried and what to do. The one place every `from_pretrained` of a path goes through.

    Args:
        what: how the message names `path` ("model", "reward model", "tokenizer", ...).
        check: first `check_model_path(path, what, **where)` (`where`: revision, filename, cache_dir, token), which
            fails at once where `from_pretrained` would retry for a while.
    """
    if check:
        check_model_path(path, what, **where)
    try:
        yield
    except ModelUnavailableError:
        raise
    except Exception as error:
        failure = hub_failure(error)
        if failure is None:
            raise
        raise ModelUnavailableError(_hub_message(os.fspath(path), what, *failure), failure[0]) from error


def load_model(model_config: ModelConfig, model_class=AutoModelForCausalLM, **kwargs) -> PreTrainedModel:
    """`model_class.from_pretrained` with the dtype, attention and quantization of `model_config`.

    Extra keyword arguments go to `from_pretrained` and win over `model_config`'s (e.g. `num_labels=1` for a reward
    model, or a trainer config's `model_init_kwargs`); a `quantization_config` among them is loaded as `model_config`'s
    own would be (on this process's device).

    Raises:
        ModelUnavailableError: (a FileNotFoundError) the path is neither a local directory nor a hub id that can be
            loaded: not in the local hub cache while offline, or the Hub cannot be reached or has no such repo (one
            line, `hub_errors`).
    """
    if model_config.model_name_or_path is None:
        raise ValueError("ModelConfig.model_name_or_path is None: pass a hub id or a local path.")
    path = model_config.model_name_or_path
    with hub_errors(path, revision=kwargs.get("revision", model_config.model_revision),
                    cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token")):
        quant = quantization_config(model_config)
        init = dict(
            revision=model_config.model_revision,
            trust_remote_code=model_config.trust_remote_code,
            attn_implementation=model_config.attn_implementation,
            dtype=resolve_dtype(model_config.dtype),
        )
        if quant is not None:
            init.update(quantization_config=quant, device_map=_device_map(True))
        if kwargs.get("quantization_config") is not None and "device_map" not in kwargs:
            init["device_map"] = _device_map(True)
        if isinstance(kwargs.get("dtype"), str):
            kwargs = {**kwargs, "dtype": resolve_dtype(kwargs["dtype"])}
        init.update(kwargs)
        model = model_class.from_pretrained(path, **init)
    keep_4bit_differentiable(model)  # training, rollouts and evaluation then compute alike (see its docstring)
    return model


def resolve_model(model, model_config: ModelConfig | None, model_class=AutoModelForCausalLM, **kwargs):
    """A trainer's `model` argument as a module: a path is loaded with `load_model` (and `model_config`).

    Returns:
        (model, model_config): `model_config` is created from the path when None, and gets the path as its
        `model_name_or_path` when it has none.

    Raises:
        TypeError: `model` is neither a path nor an `nn.Module`.
        ValueError: `model_config` asks for 4/8-bit loading of a model that is already built in full precision (a
            model loaded quantized, e.g. by `load_model` with the same `model_config`, is taken as it is).
    """
    if isinstance(model, str):
        if model_config is None:
            model_config = ModelConfig(model_name_or_path=model)
        elif model_config.model_name_or_path is None:
            model_config.model_name_or_path = model
        return load_model(model_config, model_class, **kwargs), model_config
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a path, a PreTrainedModel or a PeftModel, got {type(model).__name__}.")
    quantized = getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_loaded_in_4bit", False) \
        or getattr(model, "is_loaded_in_8bit", False)
    if model_config is not None and (model_config.load_in_4bit or model_config.load_in_8bit) and not quantized:
        raise ValueError("model_config asks for 4/8-bit loading, but the model is already built; "
                         "load it quantized yourself or pass the model as a path.")
    return model, model_config


def load_tokenizer(model_config: ModelConfig, padding_side: str = "right"):
    """`AutoTokenizer.from_pretrained` of `model_config`'s path; a path that cannot be loaded is one line
    (`hub_errors`)."""
    path = model_config.model_name_or_path
    with hub_errors(path, revision=model_config.model_revision, filename="tokenizer_config.json"):
        return AutoTokenizer.from_pretrained(
            path,
            revision=model_config.model_revision,
            trust_remote_code=model_config.trust_remote_code,
            padding_side=padding_side,
        )


def is_quantized(model) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def keep_4bit_differentiable(model) -> int:
    """Keep every bitsandbytes 4-bit layer of `model` on its differentiable path; returns how many were switched.

    bitsandbytes >= 0.49 repacks a `Linear4bit` weight for a CPU inference kernel at its first eval-mode, no-grad
    forward (a PPO rollout, an evaluation); from then on the layer runs `gemv_4bit`, which has no backward, so the
    gradients that flow through the frozen base to earlier LoRA adapters silently become zero. A base that is
    trained through (QLoRA) keeps the plain dequantize-and-matmul path.
    """
    switched = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            switched += 1
    return switched
def check_trainable(model) -> None:
    """Raise a ValueError for a 4/8-bit model without a peft adapter: its weights cannot be trained in full."""
    from accelerate.utils import is_peft_model

    if is_quantized(model) and not is_peft_model(model):
        raise ValueError("the model is loaded in 4/8 bit (quantization_config) and has no adapter: a quantized base "
                         "can only be trained through one. Pass peft_config (e.g. a LoraConfig) or "
                         "ModelConfig(use_peft=True).")


def set_router_aux_loss(model, coef: float | None) -> bool:
    """Switch a Mixture-of-Experts model's load-balancing loss on or off, as `trl.SFTTrainer` does.

    The model adds `router_aux_loss_coef * aux_loss` to its own loss when `output_router_logits` is on; TRL turns it
    on for every MoE model whose coefficient is not 0.

    Args:
        model: a causal LM, or a `PeftModel` of one.
        coef: the coefficient; None: the model config's own.

    Returns:
        whether the load-balancing loss is on (TRL's `aux_loss_enabled`).

    Raises:
        ValueError: `coef` is given for a model that is not MoE.
    """
    from accelerate.utils import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if not hasattr(config, "router_aux_loss_coef"):
        if coef is not None:
            raise ValueError(f"router_aux_loss_coef={coef} but {type(base).__name__} is not a Mixture-of-Experts "
                             "model (its config has no router_aux_loss_coef); leave it None.")
        return False
    coef = config.router_aux_loss_coef if coef is None else coef
    config.router_aux_loss_coef = coef
    if hasattr(base, "router_aux_loss_coef"):  # copied from the config when the model was built
        base.router_aux_loss_coef = coef
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = coef != 0
    return bool(getattr(config, "output_router_logits", False)) and coef != 0


def router_aux_loss_coef(model) -> float:
    """The load-balancing loss coefficient of a Mixture-of-Experts model (or a `PeftModel` of one); 0.0 for others."""
    from accelerate.utils import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def logits_to_keep_unsupported(model) -> str | None:
    """Why `model` cannot compute only some positions' logits through `logits_to_keep` as a 2D tensor of positions per
    row (None: it can). That needs a forward taking `logits_to_keep` and slicing with transformers' own
    `slice_logits_to_keep` (transformers >= 5.24: every architecture of `tests/zoo`); a remote-code model slicing
    `hidden_states[:, logits_to_keep]` itself would mis-shape it, and prompt-learning peft adapters shift the positions.

    Args:
        model: a causal LM, or a `PeftModel` of one.
    """
    import inspect
    import sys

    from accelerate.utils import is_peft_model

    if is_peft_model(model):
        if any(getattr(c, "is_prompt_learning", False) for c in model.peft_config.values()):
            return "a prompt-learning peft adapter prepends virtual tokens"
        model = model.get_base_model()
    name = type(model).__name__
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        return f"{name}.forward takes no logits_to_keep"
    if not hasattr(sys.modules.get(type(model).__module__), "slice_logits_to_keep"):
        return f"{name} does not slice with transformers' slice_logits_to_keep (positions per row)"
    return None


def apply_lora(model: PreTrainedModel, peft_config, gradient_checkpointing: bool = False):
    """Wrap `model` with LoRA adapters (preparing a 4/8-bit base for k-bit training first).

    `peft_config` is a `peft.LoraConfig` (or any peft config). A model that is already a
    `PeftModel` is returned unchanged (but for its 4-bit layers, kept differentiable: `keep_4bit_differentiable`).
    """
    from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training

    keep_4bit_differentiable(model)
    if isinstance(model, PeftModel):
        return model
    if is_quantized(model):
        # casts norms to fp32 and enables input grads so LoRA on a frozen 4-bit base gets gradients
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()
    return get_peft_model(model, peft_config)


def load_weights(model: torch.nn.Module, directory: str, adapter_name: str | None = None) -> None:
    """Load a `save_pretrained` directory (full model, sharded, or LoRA adapter) into an existing model.

    Args:
        adapter_name: for a `PeftModel`, the adapter to load into (default: the active one).

    Raises:
        FileNotFoundError: no weights in `directory`.
        ValueError: keys that do not match the model (tied copies of loaded weights excepted).
    """
    from accelerate.utils import is_peft_model
    from safetensors.torch import load_file

    if is_peft_model(model):
        from peft import load_peft_weights, set_peft_model_state_dict

        # checked here: load_peft_weights would go looking for `directory` on the Hub
        if not any(os.path.isfile(os.path.join(directory, name))
                   for name in ("adapter_model.safetensors", "adapter_model.bin")):
            raise FileNotFoundError(f"no adapter_model.safetensors in {directory}: the policy is a PeftModel but "
                                    f"{directory} has no adapter")
        adapter_name = adapter_name or model.active_adapter
        weights = load_peft_weights(directory, device="cpu")  # on CPU as before; loading copies them into place
        result = set_peft_model_state_dict(model, weights, adapter_name=adapter_name)
        unexpected = list(getattr(result, "unexpected_keys", []))
        if unexpected:
            raise ValueError(f"adapter weights in {directory} do not match the model: unexpected {unexpected[:5]}")
        return
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        from transformers.modeling_utils import load_sharded_checkpoint

        result = load_sharded_checkpoint(model, directory, strict=False)
    else:
        path = os.path.join(directory, "model.safetensors")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: no model weights in {directory}")
        result = model.load_state_dict(load_file(path), strict=False)
    # a key left out of the file because it is tied to a loaded one (tied embeddings) is not missing
    state, absent = model.state_dict(), set(result.missing_keys)
    loaded = {tensor.data_ptr() for name, tensor in state.items() if name not in absent}
    missing = [name for name in result.missing_keys if state[name].data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        raise ValueError(f"weights in {directory} do not match the model: missing {missing[:5]}, "
                         f"unexpected {list(result.unexpected_keys)[:5]}")


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of `model` to 0 (`nn.Dropout` modules and `attention_dropout` floats)."""
    # kept, not trl's disable_dropout_in_model: that one misses `attention_dropout` (a float attention reads)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def cast_lm_head_to_fp32(model) -> None:
    """TRL GRPOConfig's `cast_lm_head_to_fp32`: the LM head's weights in float32 and its logits computed in float32
    from the hidden states (the embeddings' outputs keep their dtype when the head is tied to them), as
    `trl.GRPOTrainer.__init__` does it.

    Raises:
        ValueError: the LM head carries a peft adapter (as TRL).
    """
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, nn.Linear):
        raise ValueError(f"cast_lm_head_to_fp32: {type(model).__name__} has no linear LM head")
    if hasattr(head, "base_layer"):
        raise ValueError("`cast_lm_head_to_fp32=True` is not supported when the lm_head carries a PEFT adapter; "
                         "remove lm_head from the adapter's target modules.")
    original = head.weight.dtype
    head.float()
    head.forward = lambda hidden: nn.functional.linear(hidden.to(torch.float32), head.weight.float(),
                                                       None if head.bias is None else head.bias.float())
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.to(original))
