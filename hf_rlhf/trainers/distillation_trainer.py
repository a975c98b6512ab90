"""DistillationTrainer: trl 1.16's on-policy distillation (`DistillationTrainer` signature and metrics) on
`PPOTrainer`'s rollout loop.

The student samples completions (any `generation_backend`, tools too: the rollout is PPO's), the frozen teacher
scores every completion token, and the loss is the generalised JSD between their next-token distributions
(`hf_rlhf.losses.distillation`; `beta` 0 forward KL, 1 reverse KL). With `lmbda` < 1 a seeded share of the rollouts
trains on the dataset's completions instead (GKD). Where both models' LM heads split off (`chunked_lm_head`,
`hf_rlhf.models.lm_head`) the divergence runs a chunk of tokens at a time from their last hidden states, so neither
model's (N, V) logits are held. A LoRA student whose teacher is its own base (the same path, or the same model
object) uses that base with the adapters off as the teacher: one copy of the weights.

Logged with TRL's names: `loss`, `entropy` (the student's, per completion token), `completions/*`, `num_tokens`,
`step_time`, `tools/*`; and `on_policy` (the share of rollouts sampled by the student). Resume is PPOTrainer's:
exact, a rollout cut by a checkpoint included. What differs from TRL: docs/distillation.md.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import AutoConfig
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from ..data import DataValidationError, as_dataset
from ..losses.distillation import (
    chunked_divergence,
    divergence_chunk_tokens,
    generalized_jsd_loss,
    linear_head_divergence,
    reduce_divergence,
    token_divergence,
)
from ..models.adapters import adapter_scope, unwrap_peft
from ..models.lm_head import resolve_lm_head
from ..models.loading import check_model_path, load_model
from ..models.policy_value import response_hidden, response_logits
from ..rollout.experience import Experience
from ..rollout.loader import prepare_prompt_dataset, seeded_generator, validate_prompt_dataset
from .distillation_config import DistillationConfig
from .grpo_metrics import completion_metrics
from .model_config import ModelConfig
from .ppo_trainer import PPOTrainer
from .step_time import StepTimeMixin

TEACHER_SHARES_BASE = "the student's base, adapters off"


def _no_reward(prompts, completions, **columns) -> list[float]:
    """Distillation scores nothing: the rollout's reward slot gets zeros (advantages are never read)."""
    return [0.0] * len(completions)


def _model_config(path: str, init_kwargs: dict | None) -> ModelConfig:
    kwargs = dict(init_kwargs or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    kwargs.pop("device_map", None)
    return ModelConfig(model_name_or_path=path, dtype=str(dtype).removeprefix("torch.") if dtype else "float32",
                       **kwargs)


def _vocab_size(model) -> int:
    config = model if not hasattr(model, "config") else unwrap_peft(model).config
    return int(config.get_text_config().vocab_size)


class DistillationTrainer(StepTimeMixin, PPOTrainer):
    """On-policy distillation of `teacher_model` into `model`, with trl 1.16 `DistillationTrainer`'s arguments.

    Args:
        model: the student: a path (loaded with `args.model_init_kwargs` or `model_config`), a causal LM or a
            `PeftModel`.
        teacher_model: the teacher: a path (loaded with `args.teacher_model_init_kwargs`), or a causal LM; None:
            `args.teacher_model_name_or_path`. It must have the student's vocabulary size (as TRL; refused by name
            otherwise). The student's path (or its base model object) with a LoRA student: the base, adapters off.
        args: a `DistillationConfig`.
        train_dataset: `prompt` rows (text or messages); with `lmbda` < 1 also a `completion` of the same kind.
        eval_dataset: prompt rows (or a dict of them): `evaluate()` samples completions and reports `eval_loss`
            (the divergence over their tokens) and `eval_entropy`.
        processing_class: the student's tokenizer (the teacher reads the same ids).
        callbacks, optimizers, peft_config, tools: as trl / `PPOTrainer`.
        quantization_config: refused: load with `model_config=hf_rlhf.ModelConfig(load_in_4bit=True, ...)`.
        **kwargs: `PPOTrainer`'s extras (`model_config`, `environment_factory`, `rollout_func`).
    """

    config_class = DistillationConfig
    tag_names = ("hf_rlhf", "trl", "distillation")
    default_output_dir = "distillation-output"
    counts_tokens = True  # TRL's num_tokens: prompt and completion tokens of every rollout so far

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, **kwargs):
        args = self.resolve_args(args)
        if quantization_config is not None:
            raise ValueError("DistillationTrainer(quantization_config=...) is not taken: pass model_config=hf_rlhf."
                             "ModelConfig(load_in_4bit=True, ...) (or a model loaded quantized).")
        teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if teacher_model is None:
            raise ValueError("DistillationTrainer needs a teacher: teacher_model (a path or a model) or "
                             "DistillationConfig.teacher_model_name_or_path")
        if not isinstance(teacher_model, str) and args.teacher_model_init_kwargs is not None:
            raise ValueError("You passed teacher_model_init_kwargs to the config, but your teacher_model is already "
                             "instantiated.")
        # rows and paths are checked before any model is loaded
        if train_dataset is not None:
            train_dataset = as_dataset(train_dataset)
            self._check_completions(train_dataset, args)
        self._eval_prompts = self._check_eval(eval_dataset)
        model_config = kwargs.pop("model_config", None)
        if isinstance(model, str) and model_config is None:
            model_config = _model_config(model, args.model_init_kwargs)
        student_path = model if isinstance(model, str) else getattr(model_config, "model_name_or_path", None)
        lora = peft_config is not None or bool(getattr(model_config, "use_peft", False))
        shares_base = (lora or unwrap_peft(model) is not model) and (
            teacher_model is model or (isinstance(teacher_model, str) and teacher_model == student_path)
            or (not isinstance(model, str) and teacher_model is unwrap_peft(model)))
        if isinstance(teacher_model, str) and not shares_base:
            check_model_path(teacher_model, "teacher model")
            if isinstance(model, str):
                self._check_vocab(AutoConfig.from_pretrained(model), AutoConfig.from_pretrained(teacher_model))
        super().__init__(model, _no_reward, args=args, train_dataset=train_dataset, processing_class=processing_class,
                         peft_config=peft_config, model_config=model_config, callbacks=callbacks,
                         optimizers=optimizers, tools=tools, eval_dataset=eval_dataset, **kwargs)
        self.eval_dataset = eval_dataset
        policy = self.accelerator.unwrap_model(self.model).policy
        if shares_base:
            if unwrap_peft(policy) is policy:
                raise ValueError("the teacher is the student's own model, and the student has no LoRA adapter: "
                                 "distilling a model into itself trains nothing (pass peft_config, or a teacher)")
            self.teacher_model, teacher_head = None, self.lm_heads[0]
        else:
            if isinstance(teacher_model, str):
                teacher_model = load_model(_model_config(teacher_model, args.teacher_model_init_kwargs))
            self._check_vocab(policy, teacher_model)
            self.teacher_model = self._prepare_frozen(teacher_model)
            teacher_head = resolve_lm_head(self.teacher_model, args.chunked_lm_head, type(self).__name__)
        # chunked only when both heads split off; else both models' full logits
        self.heads = (self.lm_heads[0], teacher_head) if None not in (self.lm_heads[0], teacher_head) else None

    # -- checks before any model loads ---------------------------------------------------------------
    @staticmethod
    def _check_vocab(student, teacher) -> None:
        ours, theirs = _vocab_size(student), _vocab_size(teacher)
        if ours != theirs:
            raise ValueError(f"The student model has vocab_size {ours} but the teacher model has vocab_size {theirs}."
                             " Distillation compares the teacher's full next-token distribution, which requires a "
                             "shared vocabulary (and tokenizer). Use a teacher with the same vocab_size.")

    @staticmethod
    def _check_completions(dataset, args) -> None:
        """Every row's prompt; with lmbda < 1 also a `completion` of its prompt's kind (text, or messages)."""
        dataset, conversational = validate_prompt_dataset(dataset)
        if args.lmbda == 1.0:
            return
        if "completion" not in dataset.column_names:
            raise DataValidationError(None, "completion", f"a 'completion' column (lmbda={args.lmbda} trains "
                                      "that share of rollouts on the dataset's completions)")
        for row, value in enumerate(dataset["completion"]):
            good = (isinstance(value, list) and value and all(isinstance(m, dict) and m.get("content")
                                                               for m in value)) if conversational else (
                isinstance(value, str) and value.strip())
            if not good:
                kind = "assistant messages with content" if conversational else "a non-empty string"
                raise DataValidationError(row, "completion", kind, value)

    @staticmethod
    def _check_eval(eval_dataset):
        datasets = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
        for dataset in datasets.values():
            if dataset is not None and hasattr(dataset, "__len__"):  # a streamed dataset is checked when read
                validate_prompt_dataset(as_dataset(dataset))
        return {}

    # -- rollouts: the student's samples, or (1 - lmbda) of the time the dataset's completions -----------
    def _on_policy(self) -> bool:
        if self.args.lmbda >= 1.0:
            return True
        # one draw per rollout, from its first optimizer step: the same on every rank and after a resume
        coin = torch.rand((), generator=seeded_generator(self.args.seed, self.state.global_step, 7)).item()
        return coin < self.args.lmbda

    def _make_experience(self, rows, indices, refill=None):
        maker, gather = self.rollout_maker, self.accelerator.gather
        on_policy = self._on_policy()
        if on_policy:
            experience, stats = super()._make_experience(rows, indices, refill)
            stats = {k: v for k, v in stats.items() if k.startswith("tools/")}
            lengths, stopped = maker.last_lengths, maker.last_stopped
        else:
            experience, stats = self._dataset_experience(rows), {}
            lengths = experience.response_mask.sum(1)
            stopped = torch.ones_like(lengths, dtype=torch.bool)
        stats.update(completion_metrics(gather(lengths).cpu(), gather(stopped.to(lengths.device)).cpu()))
        stats["on_policy"] = float(on_policy)
        self.metrics["train"].add("num_tokens", (experience.query_mask.sum() + lengths.sum()).float())
        return experience, stats

    def _dataset_experience(self, rows) -> Experience:
        """The rows' prompts with their dataset completions, as a rollout (stop token appended, cut to length)."""
        tokenizer, args, device = self.processing_class, self.args, self.accelerator.device
        stop = tokenizer.eos_token_id
        responses = []
        for row in rows:
            if isinstance(row["prompt"], list):
                whole = tokenizer.apply_chat_template(list(row["prompt"]) + list(row["completion"]), tokenize=True,
                                                      return_dict=True, tools=self.tools or None)["input_ids"]
                ids = list(whole[len(row["input_ids"]):])
            else:
                ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
                if stop is not None and (not ids or ids[-1] != stop):
                    ids = ids + [stop]
            responses.append(ids[:args.response_length])
        width, pad = max(len(ids) for ids in responses), tokenizer.pad_token_id
        query = self.rollout_maker.collator(rows)
        response_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in responses], device=device)
        response_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in responses], device=device)
        zeros = torch.zeros(response_ids.shape, device=device)
        return Experience(query["input_ids"].to(device), query["attention_mask"].to(device), response_ids,
                          response_mask, zeros, zeros, zeros, torch.zeros(len(rows), device=device), zeros, zeros,
                          zeros)

    # -- loss ----------------------------------------------------------------------------------------
    def _divergence(self, model, query_ids, query_mask, response_ids, loss_mask, context_mask):
        """(divergence (N,), student entropy (N,), Σ divergence or None) over the N tokens where `loss_mask` is 1.

        The sum is given (and carries the gradient) where the student's head is a plain linear layer trained here
        (`linear_head_divergence`: gradients worked out in the forward, one (V, H) buffer); elsewhere the
        divergence itself carries it (chunked under activation checkpointing, or from the full logits)."""
        args, keep = self.args, loss_mask.bool()
        part = (query_ids, query_mask, response_ids, context_mask)
        teacher = self.teacher_model
        if teacher is None:  # the LoRA student's base, adapters off
            teacher = self.accelerator.unwrap_model(self.model).policy

        def teacher_scope():
            return adapter_scope(teacher, None) if self.teacher_model is None else contextlib.nullcontext()

        if self.heads is not None:
            student_head, teacher_head = self.heads
            hidden = response_hidden(model, *part, share_prompts=self.share_prompts)
            with torch.no_grad(), teacher_scope():
                teacher_hidden = response_hidden(teacher, *part)

            def teacher_logits(h):
                with teacher_scope():
                    return teacher_head.logits(h)

            chunk = divergence_chunk_tokens(student_head.vocab_size)
            student_hidden, teacher_hidden = hidden[keep], teacher_hidden[keep].to(hidden.device)
            linear = student_head.module
            if type(linear) is nn.Linear and torch.is_grad_enabled() and not is_deepspeed_zero3_enabled():
                total, divergence, entropy = linear_head_divergence(
                    student_hidden.to(linear.weight.device), linear.weight, linear.bias, teacher_hidden,
                    teacher_logits, args.beta, args.temperature, student_head.scale, student_head.softcap, chunk)
                return divergence, entropy, total
            return (*chunked_divergence(student_hidden, teacher_hidden, student_head.logits, teacher_logits,
                                        args.beta, args.temperature, chunk), None)
        logits, _, _ = response_logits(model, *part, share_prompts=self.share_prompts)
        with torch.no_grad(), teacher_scope():
            teacher_logits, _, _ = response_logits(teacher, *part)
        return (*token_divergence(logits[keep], teacher_logits[keep].to(logits.device), args.beta, args.temperature),
                None)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Σ divergence over the completion tokens / num_items_in_batch (the step's tokens; else this batch's).

        `inputs`: a rollout micro-batch (`Experience` fields), or TRL's layout (`prompt_ids`, `prompt_mask`,
        `completion_ids`, `completion_mask`, optionally `tool_mask`)."""
        if "prompt_ids" in inputs:  # TRL's key layout
            context = inputs["completion_mask"]
            loss_mask = context * inputs["tool_mask"] if "tool_mask" in inputs else context
            part = (inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], loss_mask, context)
        else:
            exp = Experience.from_dict(inputs)
            part = (exp.query_ids, exp.query_mask, exp.response_ids, exp.response_mask, exp.context_mask)
        divergence, entropy, total = self._divergence(model, *part)
        if total is None:
            loss = reduce_divergence(divergence, torch.ones_like(divergence), num_items_in_batch)
        else:  # the same reduction, of the sum that carries the gradient
            count = max(divergence.numel(), 1) if num_items_in_batch is None else num_items_in_batch
            loss = total / (count.to(total.device) if torch.is_tensor(count) else count)
        mode = "train" if model.training else "eval"
        tokens = float(divergence.numel())
        metrics = self.metrics[mode]
        metrics.add("entropy", entropy.sum(), tokens)
        for name, value in inputs.get("rollout_stats", {}).items():
            metrics.add(name, value)
        return (loss, {"divergence": divergence}) if return_outputs else loss

    def _nonfinite_watch(self, inputs) -> dict:
        return {}  # no rollout statistic feeds the loss; a non-finite loss is caught by the Trainer's guard

    # -- evaluation: on-policy samples of the eval prompts, the divergence over their tokens ---------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        datasets = eval_dataset if eval_dataset is not None else self.eval_dataset
        if datasets is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(datasets, dict):
            metrics = {}
            for name, dataset in datasets.items():
                metrics.update(self.evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        rows = self._eval_rows(datasets)
        module = self.accelerator.unwrap_model(self.model)
        was_training = module.training
        sums = torch.zeros(3, device=self.accelerator.device)  # divergence, entropy, tokens
        size = self.args.per_device_eval_batch_size
        shard = rows[self.accelerator.process_index::self.accelerator.num_processes]
        with torch.no_grad():
            for start in range(0, len(shard), size):
                experience, _ = self.rollout_maker.make(module, shard[start:start + size], 0.0)
                module.eval()
                divergence, entropy, _ = self._divergence(module, experience.query_ids, experience.query_mask,
                                                          experience.response_ids, experience.response_mask,
                                                          experience.context_mask)
                sums += torch.stack([divergence.sum(), entropy.sum(), torch.tensor(float(divergence.numel()))]).to(
                    sums.device)
        module.train(was_training)
        sums = self.accelerator.reduce(sums, reduction="sum")
        tokens = sums[2].clamp(min=1)
        metrics = {f"{metric_key_prefix}_loss": (sums[0] / tokens).item(),
                   f"{metric_key_prefix}_entropy": (sums[1] / tokens).item()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _eval_rows(self, dataset) -> list[dict]:
        key = id(dataset)
        if key not in self._eval_prompts:
            dataset = as_dataset(list(dataset) if not hasattr(dataset, "__len__") else dataset)
            dataset, conversational = validate_prompt_dataset(dataset)
            prepared = prepare_prompt_dataset(dataset, self.processing_class, self.args, conversational=conversational,
                                              tools=self.tools)
            self._eval_prompts[key] = [dict(row) for row in prepared]
        return self._eval_prompts[key]

    @staticmethod
    def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean", num_items_in_batch=None):
        """TRL's `generalized_jsd_loss` (GKD's static method): `hf_rlhf.losses.distillation.generalized_jsd_loss`."""
        return generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature, reduction,
                                    num_items_in_batch)

