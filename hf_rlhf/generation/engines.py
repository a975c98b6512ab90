"""Generation engines: how a rollout turns left-padded prompts into sampled response tokens.

One small interface, `GenerationEngine.generate(model, query_ids, query_mask, ...) -> GenerationOutput`, with
two in-process implementations on transformers' own `generate`:

- `generate` (`GenerateEngine`): `model.generate` with the dynamic KV cache, today's path and the reference.
- `lean` (`LeanDecodeEngine`): a minimal decode loop on the model's own forward with transformers' `DynamicCache`,
  the logits warpers `generate` would build, and the same random draws: the tokens of `generate` (greedy, and
  sampled with the same seed) without its per-step Python overhead, which dominates small models on CPU.
- `static` (`StaticCacheEngine`): `model.generate(cache_implementation="static")` (a pre-allocated `StaticCache`)
  with the decoding forward compiled by transformers' auto-compile (`CompileConfig`, `torch.compile`; inductor on
  CPU, CUDA graphs on GPUs). Prompts are left-padded to a multiple of `bucket` columns so that a new prompt
  length reuses the compiled graph of its bucket instead of recompiling (the cache length is bucket + new
  tokens). The compile is paid on the first call of each (batch, bucket) shape and counted in `stats`.

`generate` and `lean` also return, when asked (`return_logprobs`, `return_hidden`), the sampled tokens' log-probs
and the LM head's inputs taken off their decoding forwards (`DecodeCapture`), which spares the rollout its policy
forward (`PPOConfig.logprobs_from_generation`); `static` does not (not implemented for its compiled decoding).

All read the live module they are given (no weight copy): after an optimizer step the next call samples from
the new weights. An engine that keeps its own copy of the weights (a vLLM-like server) implements
`sync_weights(model)`, which the trainer's side calls after each optimizer step; in-process engines make it a
no-op.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..models.adapters import unwrap_peft
from ..tensors import prompt_groups
from .capture import DecodeCapture

logger = logging.getLogger("hf_rlhf")

GENERATION_BACKENDS = ("generate", "static", "lean")


@dataclass
class GenerationOutput:
    """What an engine returns.

    response_ids: (B, R) the new tokens only (R <= max_new_tokens; rows that stopped early are padded with
        `pad_token_id` after their stop token).
    logprobs: (B, R) float32 log-probabilities of `response_ids` under softmax(logits / temperature), taken off
        the decoding forwards (`DecodeCapture`; equal to a full-sequence forward's to float rounding); None unless
        asked for (`return_logprobs`) and the engine can (`supports_capture`: `generate` and `lean`).
    hidden: (B, R, H) what the LM head read at each step (after the final norm), with `return_hidden`; else None.
    """

    response_ids: torch.LongTensor
    logprobs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


@dataclass
class EngineStats:
    """Running totals of one engine. compile_seconds: wall time of the calls that hit a new shape (compile
    included; 0 for an engine that does not compile); compiles: how many such shapes."""

    calls: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    compiles: int = 0
    compile_seconds: float = 0.0
    shapes: set = field(default_factory=set, repr=False)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens (B x R, all calls) per second of generation, compile included."""
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return dict(calls=self.calls, new_tokens=self.new_tokens, seconds=self.seconds, compiles=self.compiles,
                    compile_seconds=self.compile_seconds, tokens_per_second=self.tokens_per_second)


class GenerationEngine:
    """Base class: sample responses for a batch of left-padded prompts.

    Subclasses implement `_generate`; `generate` times it and keeps `stats`.
    """

    name = "base"
    supports_capture = False  # True: `_generate` runs its decoding forwards inside `self._recording(model)`

    def __init__(self):
        self.stats = EngineStats()
        self._capture: DecodeCapture | None = None

    def check_model(self, model) -> None:
        """Raise a ValueError naming the architecture and the reason when this engine cannot serve `model`."""

    def sync_weights(self, model) -> None:
        """Hook called after each optimizer step with the updated policy. In-process engines read the live
        module, so this is a no-op; an engine holding its own weights (another process, a server) copies them
        here (under ZeRO-3 the caller gathers them first)."""

    def generate(self, model, query_ids, query_mask, *, max_new_tokens: int, do_sample: bool = True,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_token_id=None,
                 pad_token_id: int, generation_kwargs: dict | None = None, return_logprobs: bool = False,
                 return_hidden: bool = False) -> GenerationOutput:
        """Sample (or, with do_sample=False, greedily decode) up to `max_new_tokens` per row.

        Args:
            model: a `PreTrainedModel` or `PeftModel` in eval mode (already unwrapped/gathered by the caller).
            query_ids: (B, P) left-padded prompt ids; query_mask: (B, P), 0 on the padding.
            eos_token_id: stop token (None: every row runs to max_new_tokens).
            generation_kwargs: extra `generate` arguments (override the ones above).
            return_logprobs, return_hidden: also return the sampled tokens' log-probs at `temperature` (1 without
                sampling) and the LM head's inputs, taken off the decoding forwards; an engine that cannot
                (`supports_capture` False) returns None for them.

        Returns:
            `GenerationOutput` with response_ids (B, R) (and logprobs / hidden when asked for and supported).
        """
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad_token_id,
                      eos_token_id=eos_token_id, use_cache=True)
        if do_sample:
            kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p)
        kwargs.update(generation_kwargs or {})
        shape = self._shape_key(query_ids, max_new_tokens)
        new_shape = shape is not None and shape not in self.stats.shapes
        start = time.perf_counter()
        capture = None
        if return_logprobs and self.supports_capture and not beam_search(model, kwargs):
            capture = DecodeCapture(temperature if do_sample else 1.0, hidden=return_hidden)
        self._capture = capture
        try:
            response_ids = self._generate(model, query_ids, query_mask, kwargs)
        finally:
            self._capture = None
        logprobs, hidden = capture.result(response_ids) if capture is not None else (None, None)
        seconds = time.perf_counter() - start
        stats = self.stats
        stats.calls += 1
        stats.new_tokens += response_ids.numel()
        stats.seconds += seconds
        if new_shape:
            stats.shapes.add(shape)
            stats.compiles += 1
            stats.compile_seconds += seconds
            logger.info("generation engine %r: first call of shape %s took %.1f s (compile included)", self.name,
                        shape, seconds)
        return GenerationOutput(response_ids, logprobs, hidden)

    def _recording(self, model):
        """Record the decoding forwards run inside this context when the current call captures (else nothing)."""
        return self._capture.recording(model) if self._capture is not None else contextlib.nullcontext()

    def _shape_key(self, query_ids, max_new_tokens):
        """The shape that triggers a compile (None: this engine never compiles)."""
        return None

    def _generate(self, model, query_ids, query_mask, kwargs) -> torch.LongTensor:
        raise NotImplementedError


class GenerateEngine(GenerationEngine):
    """transformers' `generate` with its default dynamic cache (the reference engine).

    Args:
        share_prompts: rows with the same prompt (a group estimator's G samples) prefill it once: the prompt but its
            last token runs once per distinct prompt, its KV cache is copied to every row of it
            (`shared_prompt_cache`), and `generate` starts from that cache (transformers' prefix caching). The
            random draws are generate's own; the logits match the unshared prefill to float rounding.
    """

    name = "generate"
    supports_capture = True

    def __init__(self, share_prompts: bool = False):
        super().__init__()
        self.share_prompts = share_prompts

    def _generate(self, model, query_ids, query_mask, kwargs):
        # beam search runs num_beams rows per prompt inside generate: a prefilled cache of B rows cannot seed it
        share = self.share_prompts and not beam_search(model, kwargs)
        cache = shared_prompt_cache(model, query_ids, query_mask) if share else None
        if cache is not None:
            kwargs = dict(kwargs, past_key_values=cache)
        with self._recording(model):  # after the shared prefill: its forward predicts no new token
            out = model.generate(input_ids=query_ids, attention_mask=query_mask, **kwargs)
        return out[:, query_ids.shape[1]:]


def beam_search(model, kwargs: dict) -> bool:
    """Whether `generate` runs beam search (num_beams > 1, from `kwargs` or the model's `generation_config`).

    Its decoding forwards then run num_beams rows per prompt and reorder them at each step, so neither a cache
    prefilled with one row per prompt (`shared_prompt_cache`) nor log-probs taken off those forwards (`DecodeCapture`)
    fit it: the rollout then prefills inside `generate` and computes the old log-probs with a forward (TRL's way).
    """
    beams = kwargs.get("num_beams")
    if beams is None:
        beams = getattr(getattr(unwrap_peft(model), "generation_config", None), "num_beams", 1)
    return (beams or 1) > 1


@torch.no_grad()
def shared_prompt_cache(model, query_ids, query_mask):
    """The KV cache of each row's prompt but its last token, every distinct prompt computed once; None when the rows'
    prompts are all distinct (or one column wide), or the model's cache cannot be re-indexed by row.

    Args:
        model: a causal LM (or a `PeftModel` of one) in eval mode.
        query_ids, query_mask: (B, P) left-padded prompts; rows are the same prompt when ids and mask are equal.

    Returns:
        A transformers `Cache` of B rows and P - 1 positions, or None.
    """
    if query_ids.shape[1] < 2:
        return None
    group, first = prompt_groups(query_ids, query_mask)
    if first.shape[0] == query_ids.shape[0]:
        return None
    ids, mask = query_ids[first, :-1], query_mask[first, :-1]
    position_ids = mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(mask == 0, 1)  # as generate builds them for left padding
    cache = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True).past_key_values
    if not callable(getattr(cache, "batch_select_indices", None)):
        return None
    cache.batch_select_indices(group)
    return cache


class StaticCacheEngine(GenerationEngine):
    """transformers' `generate` with a `StaticCache`, the decoding step compiled, prompts bucketed.

    Args:
        compile: compile the decoding forward (transformers' auto-compile, forced on CPU too); False runs the
            static cache eagerly (same tokens, no compile: what the equality tests check).
        bucket: prompts are left-padded to a multiple of this many columns (one compiled graph per bucket).
        compile_mode: `torch.compile` mode; None: "reduce-overhead" (CUDA graphs) on CUDA, "default" elsewhere.
    """

    name = "static"

    def __init__(self, compile: bool = True, bucket: int = 32, compile_mode: str | None = None):
        super().__init__()
        self.compile, self.bucket, self.compile_mode = compile, bucket, compile_mode

    def check_model(self, model) -> None:
        base = unwrap_peft(model)
        if not getattr(base, "_can_compile_fullgraph", False):
            raise ValueError(
                f"PPOConfig.generation_backend='static' cannot serve {type(base).__name__} "
                f"(model_type={base.config.model_type!r}): transformers does not support a static KV cache for "
                "it (`_can_compile_fullgraph` is False); use generation_backend='generate'.")

    def _shape_key(self, query_ids, max_new_tokens):
        if not self.compile:
            return None
        return (query_ids.shape[0], self._bucketed(query_ids.shape[1]), max_new_tokens)

    def _bucketed(self, length: int) -> int:
        return -(-length // self.bucket) * self.bucket

    def _compile_config(self, device):
        from transformers import CompileConfig

        mode = self.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default")
        config = CompileConfig(fullgraph=False, mode=mode)
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        return config

    def _generate(self, model, query_ids, query_mask, kwargs):
        width = self._bucketed(query_ids.shape[1])
        extra = width - query_ids.shape[1]
        if extra:  # left padding: every row's last prompt token stays in the last column
            query_ids = F.pad(query_ids, (extra, 0), value=kwargs["pad_token_id"])
            query_mask = F.pad(query_mask, (extra, 0), value=0)
        kwargs = dict(kwargs, cache_implementation="static")
        if self.compile:
            kwargs["compile_config"] = self._compile_config(query_ids.device)
        else:
            kwargs["disable_compile"] = True
        out = model.generate(input_ids=query_ids, attention_mask=query_mask, **kwargs)
        return out[:, width:]


# the generate options `lean` implements; any other one (repetition_penalty, min_new_tokens, num_beams, stop_strings,
# a streamer, ...) is refused by name rather than silently ignored
LEAN_OPTIONS = frozenset({"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "pad_token_id",
                          "eos_token_id", "bos_token_id", "use_cache"})
_LEAN_CONFIG_NEUTRAL = dict(num_beams=1, num_return_sequences=1, max_time=None, stop_strings=None,
                            prefill_chunk_size=None, return_dict_in_generate=False, output_scores=False,
                            output_logits=False, use_cache=True)
_REFER = "use generation_backend='generate' (transformers' generate implements every option)"


def check_lean_options(generation_kwargs: dict | None) -> None:
    """Raise a ValueError naming the `generation_kwargs` that the `lean` engine does not implement (config time)."""
    unsupported = sorted(set(generation_kwargs or {}) - LEAN_OPTIONS)
    if unsupported:
        raise ValueError(f"generation_backend='lean' does not implement the generation_kwargs {unsupported} (it "
                         f"implements {sorted(LEAN_OPTIONS)}); {_REFER}")


class LeanDecodeEngine(GenerationEngine):
    """A minimal decode loop: prefill with a `DynamicCache`, then one forward of the model per new token.

    Every step is the one transformers' `generate` (`_sample`) takes, minus its per-step bookkeeping: the generation
    config merged as `generate` merges it (the model's `generation_config`, then the arguments), position ids from
    the attention mask as `generate` builds them (cumsum - 1, 0 on the padding), `logits_to_keep=1` on the prefill
    where the model accepts it, float32 logits of the last position through the logits processors `generate` builds
    (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, in its order), `torch.multinomial` on their
    softmax (argmax without sampling), pad tokens after a row's eos, and a stop once every row has finished. So it
    consumes the random stream as `generate` does and samples the same tokens for the same seed; greedy tokens are
    equal too. Under ZeRO-3 / FSDP with several ranks, the ranks keep stepping until all have finished, as
    `generate`'s `synced_gpus` does.

    Options it does not implement (repetition_penalty, min_new_tokens, num_beams, stop_strings, ..., whether passed
    or set in the model's `generation_config`) are a ValueError naming them.
    """

    name = "lean"
    supports_capture = True

    def check_model(self, model) -> None:
        base = unwrap_peft(model)
        peft_config = getattr(model, "active_peft_config", None)
        if peft_config is not None and peft_config.is_prompt_learning:
            raise ValueError(f"PPOConfig.generation_backend='lean' cannot serve a {peft_config.peft_type} peft model "
                             f"(prompt learning adds inputs that only peft's generate builds); {_REFER}.")
        if base.config.is_encoder_decoder or not base._supports_default_dynamic_cache():
            raise ValueError(
                f"PPOConfig.generation_backend='lean' cannot serve {type(base).__name__} "
                f"(model_type={base.config.model_type!r}): it needs a decoder-only model that uses transformers' "
                f"DynamicCache; {_REFER}.")

    def _plan(self, base, query_ids, kwargs):
        """(generation config as `generate` resolves it, its logits processors), or a ValueError naming what `lean`
        does not implement."""
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        check_lean_options({k: v for k, v in kwargs.items() if k not in LEAN_OPTIONS})
        config, model_kwargs = base._prepare_generation_config(None, **kwargs)
        if model_kwargs:
            check_lean_options(model_kwargs)
        changed = {k: getattr(config, k) for k, neutral in _LEAN_CONFIG_NEUTRAL.items()
                   if getattr(config, k, None) not in (neutral, None)}
        if changed or config.cache_implementation not in (None, "dynamic"):
            changed.update({"cache_implementation": config.cache_implementation} if config.cache_implementation
                           not in (None, "dynamic") else {})
            raise ValueError(f"generation_backend='lean' does not implement {changed} (from the arguments or the "
                             f"model's generation_config); {_REFER}")
        processors = base._get_logits_processor(generation_config=config, input_ids_seq_length=query_ids.shape[1],
                                                encoder_input_ids=query_ids, device=query_ids.device, model_kwargs={})
        implemented = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
        others = [type(p).__name__ for p in processors if not isinstance(p, implemented)]
        if others:
            raise ValueError(f"generation_backend='lean' does not implement the logits processors {others} that "
                             f"generate would apply (set by the arguments or the model's generation_config: "
                             f"repetition_penalty, min_new_tokens, bad_words_ids, ...); {_REFER}")
        return config, processors

    def _generate(self, model, query_ids, query_mask, kwargs):
        from transformers import DynamicCache
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        # the transformers model itself, as peft's generate runs it: LoRA layers sit inside it (and a disabled
        # adapter is off there too), so the peft wrapper's per-call forward hooks are skipped at every step
        self.check_model(model)
        base = unwrap_peft(model)
        config, processors = self._plan(base, query_ids, kwargs)
        eos = config.eos_token_id
        eos = None if eos is None else torch.as_tensor(eos, device=query_ids.device).view(-1)
        pad = config.pad_token_id if config.pad_token_id is not None else (None if eos is None else int(eos[0]))
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        synced = world > 1 and (is_deepspeed_zero3_enabled() or _fsdp_managed(model))
        accepted = _forward_parameters(base)

        mask = query_mask.long()
        inputs = dict(input_ids=query_ids, attention_mask=mask, use_cache=True)
        inputs["cache"] = DynamicCache(config=base.config.get_text_config(decoder=True))
        if "position_ids" in accepted:
            positions = mask.cumsum(-1) - 1
            inputs["position_ids"] = positions.masked_fill(mask == 0, 0)
        if "logits_to_keep" in accepted:
            inputs["logits_to_keep"] = 1
        unfinished = torch.ones(query_ids.shape[0], dtype=torch.long, device=query_ids.device)
        with self._recording(base):
            return self._decode(base, inputs, config, processors, query_ids, eos, pad, synced, unfinished)

    @staticmethod
    def _decode(base, inputs, config, processors, query_ids, eos, pad, synced, unfinished):
        batch, mask, tokens, finished_here = query_ids.shape[0], inputs["attention_mask"], [], False
        for step in range(config.max_new_tokens):
            out = base(**inputs, return_dict=True)
            if not finished_here:
                logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
                scores = processors(query_ids, logits)  # these warpers read only the scores
                if config.do_sample:
                    next_tokens = torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                else:
                    next_tokens = torch.argmax(scores, dim=-1)
                if eos is not None:
                    next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
                    unfinished = unfinished & ~torch.isin(next_tokens, eos)
                tokens.append(next_tokens)
                finished_here = step + 1 == config.max_new_tokens or (eos is not None and unfinished.max() == 0)
            del out
            if not _keep_stepping(finished_here, synced, query_ids.device) or step + 1 == config.max_new_tokens:
                break
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=-1)
            # generate's next input is the last token appended (a rank that has finished keeps feeding its last one)
            inputs.update(input_ids=tokens[-1][:, None], attention_mask=mask)
            inputs.pop("logits_to_keep", None)
            if "position_ids" in inputs:
                inputs["position_ids"] = inputs["position_ids"][:, -1:] + 1
        return torch.stack(tokens, dim=1)


def _forward_parameters(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _fsdp_managed(model) -> bool:
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return is_fsdp_managed_module(model)


def _keep_stepping(this_rank_finished: bool, synced: bool, device) -> bool:
    """generate's `_has_unfinished_sequences`: with `synced` ranks (ZeRO-3, FSDP), every rank runs forwards until
    all have finished (a forward gathers parameters from every rank)."""
    if not synced:
        return not this_rank_finished
    flag = torch.tensor(0.0 if this_rank_finished else 1.0, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.SUM)
    return flag.item() != 0.0


def build_engine(backend: str, share_prompts: bool = False, **kwargs) -> GenerationEngine:
    """The engine of `PPOConfig.generation_backend` (one of `GENERATION_BACKENDS`); `share_prompts`: the `generate`
    engine prefills each distinct prompt once (`PPOConfig.prefix_sharing`; the other engines ignore it)."""
    if backend == "generate":
        return GenerateEngine(share_prompts)
    if backend == "lean":
        return LeanDecodeEngine(**kwargs)
    if backend == "static":
        return StaticCacheEngine(**kwargs)
    raise ValueError(f"generation_backend={backend!r}; expected one of {list(GENERATION_BACKENDS)}")
