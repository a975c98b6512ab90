"""A memory plan before a run: the peak memory of each part of a training run, predicted from the model's config
and the training options alone (no model is built, no Trainer).

Parts (bytes):
    weights          parameters x weight dtype (policy; LoRA adds its adapter weights in fp32).
    reference        a separate frozen copy of the policy (DPO, GRPO/PPO with a KL), none with LoRA (adapters off).
    value            a separate value model (PPO with `value_model=`); a value head is counted in the weights.
    reward model     a separate reward model (PPO with a model as its reward; none for reward functions).
    gradients        trainable parameters x 4 bytes (fp32 master weights) or x the weight dtype's bytes.
    optimizer        AdamW: 2 fp32 moments per trainable parameter (8 B); 8-bit AdamW: 2 B; SGD: 0.
    activations      per layer per token, kept for the backward: `ACTIVATION_FLOATS` x hidden-sized and
                     intermediate-sized vectors; with activation checkpointing one hidden vector per layer per
                     token plus one layer's full set (recomputed in the backward).
    logits           micro-batch x positions x vocabulary x 4 bytes x copies (the logits, their log-softmax, the
                     gradient in the backward: `LOGITS_COPIES`), or one chunk of rows with a chunked LM-head loss.
    kv_cache         generation: layers x 2 x kv_heads x head_dim x (prompt + completion) x generation batch.
    rollout_buffer   generation: ids, masks and per-token log-probs / values / advantages of the rollout.

The peak of a step is the max over its phases: generating (KV cache), forward / backward (activations, the
logits' copies and the LM head's gradient, the first one the backward makes; with gradient accumulation every
gradient, which the earlier micro-batches left), the end of the backward (every
gradient; with tied embeddings the embedding's gradient is summed into the head's) and the optimizer step (its
temporaries). Weights, reference and optimizer state live through all of them. A run's first optimizer step never
holds the optimizer state and the activations together (`steps=1`); every later one does.

The constants were calibrated on CPU measurements at real vocabularies (bench/scale.py, which prints the
prediction against the measured peak for each configuration). `hf-rlhf plan <command> ...` prints the table.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

# the chunked LM-head loss: logits of at most CHUNK_ELEMENTS elements per chunk, on every device
from ..losses.chunked_head import CHUNK_ELEMENTS

GIB = 2**30
MIB = 2**20

# floats kept per token per decoder layer for the backward (fp32 / bf16 activations): in units of the hidden size
# (norm inputs and outputs, q and the attention output, o_proj's input, the residuals) and of the intermediate size
# (gate, up, act(gate), act(gate) * up); k and v add 2 x kv_heads x head_dim
ACTIVATION_FLOATS = {"hidden": 8, "intermediate": 4}
# copies of a (positions x vocabulary) fp32 tensor alive together at the loss's peak, by command, without the
# chunked LM head: the logits, the log-softmax (or the cross-entropy's internal copy) and, in the backward, its
# gradient. dpo: measured (bench/scale.py, Qwen2.5-0.5B shape, 152k vocabulary, CPU) before DPOTrainer had the
# chunked head: ~7.3 copies of its (2 x completion x V) logits at the peak (padded and padding-free alike); sft:
# 6.1 / 5.6 / 5.2 / 5.2 at V = 32k / 64k / 128k / 152k (`chunked_lm_head=False`, one step of 1 x 1,000 tokens,
# bench/lm_head_memory.py --sweep vocab=...); grpo, ppo: the textbook 3 (hf_rlhf chunks their LM head by default)
LOGITS_COPIES = {"sft": 5.3, "dpo": 7.3, "grpo": 3.0, "ppo": 3.0, "reward": 0.0}
RUNTIME_OVERHEAD = {"cpu": 60 * MIB}
# copies of one chunk's (chunk, V) fp32 logits alive at once in its backward: 3.15 and 3.0 measured (hf_rlhf GRPO,
# SmolLM2-135M shape, 1,024 and 2,048 completion tokens, CPU, the accumulated gradients counted)
CHUNK_COPIES = 3.1
# the prefix-shared layout (GRPO / PPO: a micro-batch's rows of one prompt as one row, the prompt once): its 4D
# mask over the shared row's L tokens, ~4 fp32 copies of (L x L) alive in the forward / backward (measured: +271 MB
# at L = 64 + 4 x 1,024, Qwen2.5-0.5B shape, sdpa on CPU, against the rows run apart)
SHARED_MASK_COPIES = 4.0
OPTIMIZER_BYTES = {"adamw": 8, "adamw_torch": 8, "adamw_torch_fused": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2,
                   "adamw_bnb_8bit": 2, "sgd": 0, "adafactor": 4}
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "4bit": 0.5, "int8": 1}

# real models' shapes, for planning without a download (`--model_name_or_path` a name below)
NAMED_SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         tie_word_embeddings=True),
}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only model's config (Llama / Qwen2 / Mistral family layout)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config object or a dict of one (config.json)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        if get("text_config") is not None:  # multimodal wrappers: plan the language model
            return cls.from_config(get("text_config"))
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        return cls(vocab_size=get("vocab_size"), hidden_size=hidden, intermediate_size=get("intermediate_size"),
                   num_layers=get("num_hidden_layers"), num_heads=heads,
                   num_kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or hidden // heads, tied=bool(get("tie_word_embeddings", False)),
                   qkv_bias=get("model_type") == "qwen2" or bool(get("attention_bias", False)))

    @classmethod
    def load(cls, name_or_path: str, num_layers: int | None = None) -> ModelShape:
        """A named shape (`NAMED_SHAPES`), a model directory (its config.json) or a config.json file; `num_layers`
        overrides the depth."""
        if name_or_path.lower() in NAMED_SHAPES:
            shape = cls.from_config(NAMED_SHAPES[name_or_path.lower()])
        else:
            path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{name_or_path}: neither a named shape ({', '.join(NAMED_SHAPES)}) nor a "
                                        "model directory with a config.json")
            with open(path) as f:
                shape = cls.from_config(json.load(f))
        if num_layers is not None:
            shape = ModelShape(**{**asdict(shape), "num_layers": num_layers})
        return shape

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections (+ q/k/v biases), gate/up/down, two RMSNorm weights."""
        q = self.num_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * self.kv_dim) + q * self.hidden_size
        if self.qkv_bias:
            attention += q + 2 * self.kv_dim
        return attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The LM head's own parameters (0 when tied to the embedding)."""
        return 0 if self.tied else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        return self.embedding_params + self.head_params + self.num_layers * self.layer_params + self.hidden_size

    def decode_params(self) -> int:
        """Parameters read by one decoding step: every layer and the LM head (the embedding: one row per token)."""
        return self.num_layers * self.layer_params + self.hidden_size + self.vocab_size * self.hidden_size

    def lora_params(self, r: int, targets: str = "all-linear") -> int:
        """LoRA adapter parameters: r x (in + out) per targeted linear per layer (all-linear: q, k, v, o, gate, up,
        down; "attention": q, k, v, o)."""
        h, q, i = self.hidden_size, self.num_heads * self.head_dim, self.intermediate_size
        attention = (h + q) + 2 * (h + self.kv_dim) + (q + h)
        mlp = 2 * (h + i) + (i + h)
        per_layer = attention + (mlp if targets == "all-linear" else 0)
        return r * per_layer * self.num_layers


@dataclass
class PlanOptions:
    """A run's options that set its memory (names as in the trainers' configs)."""

    command: str = "sft"  # sft, dpo, grpo, ppo, reward
    batch_size: int = 1  # sequences per micro-batch (DPO: pairs; each pair is two sequences)
    seq_len: int = 2048  # tokens per sequence (SFT: max_length; DPO / GRPO: prompt + completion)
    logits_positions: int | None = None  # positions per sequence that get logits (None: seq_len)
    weight_dtype: str = "float32"
    compute_dtype: str = "float32"  # activations (bf16 under autocast / bf16 weights)
    optimizer: str = "adamw_torch_fused"  # transformers' default `optim`
    lora_r: int = 0
    lora_targets: str = "all-linear"
    activation_checkpointing: bool = False
    chunked_head: bool = False  # hf_rlhf's chunked LM-head loss (SFTConfig / PPOConfig.chunked_lm_head)
    logits_chunk: int | None = None  # its rows per chunk (None: as hf_rlhf picks them for the vocabulary, device)
    logits_copies: float | None = None  # override LOGITS_COPIES[command]
    reference: bool | None = None  # None: the command's default (DPO yes, GRPO/PPO when beta > 0, not with LoRA)
    beta: float = 0.0
    value_model: bool = False
    reward_model: bool = False  # ppo: a separate reward model (a sequence classifier of the policy's size)
    # generation (grpo, ppo)
    generation_batch: int = 0  # sequences generated together (prompts x G)
    prompt_len: int = 0
    completion_len: int = 0
    steps: int = 2  # optimizer steps: 1 never holds the optimizer state during a backward
    prefix_sharing: bool = False  # grpo / ppo: the micro-batch's rows of one prompt in one row (`prefix_sharing`)
    gradient_accumulation_steps: int = 1  # > 1: every micro-batch's backward but the first adds to held gradients
    device: str = "cpu"
    extra: dict = field(default_factory=dict)


@dataclass
class Plan:
    parts: list[tuple[str, float, str]]  # (name, bytes, how)
    phases: dict[str, float]  # phase -> bytes at its peak
    peak: float

    def table(self, unit: str = "GiB") -> str:
        div = GIB if unit == "GiB" else MIB
        lines = [f"| part | {unit} | how |", "|---|---:|---|"]
        for name, size, how in self.parts:
            lines.append(f"| {name} | {size / div:,.3f} | {how} |")
        for phase, size in self.phases.items():
            lines.append(f"| peak while {phase} | {size / div:,.3f} | sum of the parts alive then |")
        lines.append(f"| **predicted peak** | **{self.peak / div:,.3f}** | max over the phases |")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"parts": {name: size for name, size, _ in self.parts}, "phases": self.phases, "peak": self.peak}


def dtype_bytes(name: str) -> float:
    try:
        return DTYPE_BYTES[str(name).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; one of {', '.join(DTYPE_BYTES)}") from None


def activation_bytes(shape: ModelShape, tokens: int, act_bytes: float, checkpointing: bool) -> float:
    """Activations kept for the backward over `tokens` token positions (all layers)."""
    per_layer_token = (ACTIVATION_FLOATS["hidden"] * shape.hidden_size
                       + ACTIVATION_FLOATS["intermediate"] * shape.intermediate_size + 2 * shape.kv_dim)
    if checkpointing:  # each layer's input, plus one layer recomputed at a time
        return tokens * act_bytes * (shape.num_layers * shape.hidden_size + per_layer_token)
    return tokens * act_bytes * shape.num_layers * per_layer_token


def plan_memory(shape: ModelShape, options: PlanOptions) -> Plan:
    """Predict the peak memory of each part of a run (see the module's docstring)."""
    o = options
    if o.command not in LOGITS_COPIES:
        raise ValueError(f"unknown command {o.command!r}; one of {', '.join(LOGITS_COPIES)}")
    wbytes, abytes = dtype_bytes(o.weight_dtype), dtype_bytes(o.compute_dtype)
    if o.optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer {o.optimizer!r}; one of {', '.join(OPTIMIZER_BYTES)}")
    lora = o.lora_r > 0
    trainable = shape.lora_params(o.lora_r, o.lora_targets) if lora else shape.params
    grad_bytes = 4 if lora or wbytes >= 4 else wbytes  # LoRA adapters are fp32
    sequences = o.batch_size * (2 if o.command in ("dpo", "reward") else 1)
    tokens = sequences * o.seq_len
    positions = sequences * (o.logits_positions or o.seq_len)
    copies = LOGITS_COPIES[o.command] if o.logits_copies is None else o.logits_copies
    rows = positions
    if o.chunked_head or o.logits_chunk:
        rows = min(positions, o.logits_chunk or max(1, CHUNK_ELEMENTS // shape.vocab_size))
        copies = CHUNK_COPIES if o.logits_copies is None else o.logits_copies
    reference = o.reference
    if reference is None:
        reference = (o.command == "dpo" or (o.command in ("grpo", "ppo") and o.beta > 0)) and not lora

    parts: list[tuple[str, float, str]] = []
    weights = shape.params * wbytes + (trainable * 4 if lora else 0)
    parts.append(("weights", weights, f"{shape.params / 1e6:,.1f}M params x {wbytes:g} B"
                  + (f" + LoRA r={o.lora_r} {trainable / 1e6:,.2f}M x 4 B" if lora else "")))
    ref = shape.params * wbytes if reference else 0.0
    if reference:
        parts.append(("reference", ref, "a frozen copy of the policy"))
    value = shape.params * wbytes if o.value_model else 0.0
    if o.value_model:
        parts.append(("value model", value, "a separate value model (trained: its gradients and moments too)"))
    reward_weights = shape.params * wbytes if o.reward_model else 0.0
    if o.reward_model:
        parts.append(("reward model", reward_weights, "a separate frozen reward model of the policy's shape"))
    value_trainable = shape.params if o.value_model else 0
    gradients = (trainable + value_trainable) * grad_bytes
    parts.append(("gradients", gradients, f"{(trainable + value_trainable) / 1e6:,.2f}M trainable x {grad_bytes:g} B"))
    optimizer = (trainable + value_trainable) * OPTIMIZER_BYTES[o.optimizer]
    parts.append(("optimizer state", optimizer, f"{o.optimizer}: {OPTIMIZER_BYTES[o.optimizer]} B per trainable"))
    activations = activation_bytes(shape, tokens, abytes, o.activation_checkpointing)
    parts.append(("activations", activations, f"{tokens:,} tokens x {shape.num_layers} layers"
                  + (" (checkpointed)" if o.activation_checkpointing else "")))
    shared_mask = 0.0
    if o.prefix_sharing and o.command in ("grpo", "ppo") and o.batch_size > 1 and o.completion_len:
        length = o.prompt_len + o.batch_size * o.completion_len
        shared_mask = SHARED_MASK_COPIES * length**2 * 4
        parts.append(("shared-prompt mask", shared_mask, f"{o.batch_size} rows of a prompt as one row of {length:,} "
                                                         f"tokens: its 4D mask x {SHARED_MASK_COPIES:g} copies"))
    logits = rows * shape.vocab_size * 4 * copies
    parts.append(("logits", logits, f"{rows:,} rows x {shape.vocab_size:,} x 4 B x {copies:g} copies"
                  + (f" (a chunk of the {positions:,} rows)" if rows < positions else "")))

    # the optimizer step's temporaries: torch's AdamW makes ~2 tensors the size of the parameter it updates (one
    # parameter at a time on CPU; every parameter at once with the foreach kernels, CUDA's default)
    # the fused kernel (`adamw_torch_fused`, transformers' default) updates in place: none (measured on CPU: 0 MB
    # above the state, against 552 MB foreach and 1,022 MB one parameter at a time for a 152k x 896 embedding)
    largest = trainable // max(shape.num_layers, 1) if lora else max(shape.embedding_params, shape.layer_params // 3)
    fused = o.optimizer in ("sgd", "adamw_torch_fused")
    step_temp = 0 if fused else 2 * 4 * (trainable + value_trainable if o.device == "cuda" else largest)
    parts.append(("optimizer step temporaries", step_temp, "none: a fused, in-place update" if fused else
                  "AdamW's sqrt / division copies: 2 x the "
                  + ("trainable parameters (foreach)" if o.device == "cuda" else "largest parameter")))
    # the LM head's gradient is the first to exist in the backward, while the logits' copies still do; the other
    # gradients come once the logits are freed
    head_grad = 0 if lora else shape.vocab_size * shape.hidden_size * grad_bytes
    # what a CPU process grows by besides the tensors above (allocator arenas, the data loader, lazy imports),
    # measured at ~55-65 MiB on tiny models; on CUDA torch's allocator does not count the context (~0.5 GiB)
    runtime = RUNTIME_OVERHEAD.get(o.device, 0)
    if runtime:
        parts.append(("runtime", runtime, "allocator arenas, data loader, lazy imports (measured on CPU)"))
    resident = weights + ref + value + reward_weights + runtime
    moments = optimizer if o.steps > 1 else 0.0
    # accumulating: the later micro-batches' backwards add into the gradients the earlier ones left (all of them),
    # each new gradient made whole before it is added (the LM head's first, while the logits' copies still live)
    held = gradients + head_grad if o.gradient_accumulation_steps > 1 else head_grad
    phases = {
        "forward / backward": resident + moments + activations + logits + held + shared_mask,
        "end of backward": resident + moments + gradients + (head_grad if shape.tied else 0),
        "optimizer step": resident + gradients + optimizer + step_temp,
    }
    if o.generation_batch and o.completion_len:
        context = o.prompt_len + o.completion_len
        kv = shape.num_layers * 2 * shape.kv_dim * context * o.generation_batch * abytes
        parts.append(("kv cache", kv, f"{shape.num_layers} layers x 2 x {shape.kv_dim} x {context} tokens x "
                                      f"{o.generation_batch} sequences x {abytes:g} B"))
        gen_logits = o.generation_batch * shape.vocab_size * 4 * 2  # the last position's logits and their softmax
        parts.append(("generation logits", gen_logits, "last position only, logits + softmax"))
        buffer = o.generation_batch * context * (8 + 8) + o.generation_batch * o.completion_len * 4 * 4
        parts.append(("rollout buffer", buffer, "ids, masks, per-token log-probs / values / advantages"))
        phases["generating"] = resident + moments + kv + gen_logits + buffer
        for phase in ("forward / backward", "end of backward", "optimizer step"):
            phases[phase] += buffer
    return Plan(parts=parts, phases=phases, peak=max(phases.values()))
