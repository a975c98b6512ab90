"""PPOTrainer: PPO as a thin `transformers.Trainer` subclass whose dataloader yields experience.

The Trainer's loop (batch -> `compute_loss` -> backward -> optimizer step -> callbacks) is PPO's inner loop when the
train "dataloader" is an `ExperienceLoader`: each rollout (generate, score, reference, GAE) becomes
`num_mini_batches * num_ppo_epochs` optimizer steps. Everything else (optimizers, schedulers, accumulation, mixed
precision, logging, checkpoints, resume, DeepSpeed) is the Trainer's own. The pieces live in `hf_rlhf.rollout`
(experience, rollouts), `hf_rlhf.rl` and `hf_rlhf.losses` (the math); this file only wires them together.

Logged at each logging step, with TRL's names: per rollout `objective/kl` (summed over the response, mean over
sequences), `objective/entropy`, `objective/non_score_reward`, `objective/rlhf_reward`, `objective/scores`,
`objective/raw_scores` (before normalisation and penalty), `objective/kl_coef` (the β of the rollout),
`val/num_eos_tokens` (responses that stopped); per minibatch, token-weighted means: `loss/policy_avg`,
`loss/value_avg`, `policy/entropy_avg`, `policy/approxkl_avg`, `policy/clipfrac_avg`, `val/clipfrac_avg`,
`val/ratio` (and `loss/ptx_avg`; `loss/kl_avg`, the per-token KL of the loss, with `kl_in_loss`; no value metrics for
the critic-free estimators). All are reduced over ranks.

Resume continues the run exactly: weights, optimizer, scheduler and RNG come back through the Trainer; the KL
controller and running reward statistics through their stateful callbacks; the prompt order through the seeded
loader, which skips used prompts without generating; a rollout cut by the checkpoint from the per-rank experience
file written into it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from ..collators import PaddingCollator
from ..data import as_dataset, prepare_sft_dataset
from ..data.options import DataOptions
from ..data.streaming import check_streamed_rollouts
from ..generation import build_engine
from ..losses.grpo import policy_terms
from ..losses.ppo import importance_log_weights, value_loss
from ..models.adapters import unwrap_peft
from ..models.lm_head import check_liger_lm_head, resolve_lm_head
from ..models.loading import check_model_path, disable_dropout, hub_errors, load_model, resolve_model
from ..models.packing_check import PackingCheckError, check_packing_exact
from ..models.policy_value import PolicyAndValue, response_scores
from ..models.value_adapter import add_value_adapter, resolve_value_adapter
from ..models.value_head import reward_config_of
from ..rewards.base import FunctionReward, run_coroutine
from ..rewards.factory import build_reward_source, check_reward_model_path
from ..rewards.model import ModelReward
from ..rl.critic_free import TOKEN_SUM_LOSS_TYPES, aggregate_loss
from ..rl.kl import kl_penalty, sequence_policy_stats
from ..rollout.experience import Experience
from ..rollout.loader import ExperienceLoader, prepare_prompt_dataset, seeded_generator, validate_prompt_dataset
from ..rollout.multiturn import ToolRollout
from ..rollout.rollout_maker import KL_METRICS, RolloutMaker, stop_token_id_of
from ..tensors import masked_sum
from ..tools import ToolRunner, check_tool_tokenizer, rollout_tokenizer, tool_dict
from ..tools.environments import PLACEHOLDER_PROMPT, EnvironmentPool, placeholder_prompts
from ..training.state_callbacks import (
    AdaptiveEntropyCallback,
    EpochFromStepCallback,
    KLControllerCallback,
    RewardStatsCallback,
    find_callback,
)
from .base_trainer import BaseTrainer
from .model_config import ModelConfig
from .online_eval import OnlineEvalMixin, check_eval_setup
from .policy_loss_terms import PolicyLossTerms, check_sampling_correction
from .ppo_config import PPOConfig

logger = logging.getLogger("hf_rlhf")


def _reference_copy(policy):
    """A frozen copy of the initial policy.

    Under ZeRO-3, `from_pretrained` shards the weights as it loads them (`zero.Init`); a deepcopy of those shards is no
    model, so the reference is loaded again from the policy's directory (and sharded the same way).
    """
    if not any(hasattr(p, "ds_id") for p in policy.parameters()):
        return copy.deepcopy(policy)
    path = policy.config._name_or_path
    if not path:
        raise ValueError("the policy's weights are ZeRO-3 shards and it has no path to load a reference copy from: "
                         "pass ref_model (a path or a model)")
    return load_model(ModelConfig(model_name_or_path=path, dtype=str(policy.dtype).removeprefix("torch.")))


def environment_scores(func, environments: list) -> torch.Tensor:
    """(B,) float32 scores of an environment's reward function (`EnvironmentPool.reward_funcs`), NaN where it
    returned None (a row of another environment); an `async` one is run here."""
    values = func(environments=environments)
    if inspect.iscoroutine(values):
        values = run_coroutine(values)
    return torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32)


def _whole_weights(model):
    """A context with the weights of `model` whole: gathered (on every rank) when they are ZeRO-3 shards."""
    parameters = list(model.parameters())
    if not any(hasattr(p, "ds_id") for p in parameters):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(parameters)


class PPOTrainer(OnlineEvalMixin, PolicyLossTerms, BaseTrainer):
    """PPO with a value function, a KL-penalised reward and an adaptive or fixed KL coefficient; or, with
    `PPOConfig.advantage_estimator`, the same loop with a critic-free estimator (GRPO, RLOO, REINFORCE++) and no value
    function built at all.

    Args:
        model: the policy: a hub id or local path (loaded with `model_config`, 4-bit too), a causal LM or a `PeftModel`.
        reward_model: a Python function `(prompts, completions, **row_fields) -> list[float]`; a reward model
            (sequence classification with one label, or a `ValueHeadModel`) or its path; an endpoint,
            `"http://host:port/path"` or `HTTPReward(url, timeout=...)` (protocol: `hf_rlhf.rewards.http_client`);
            or `RewardAdapter(path)` / `"adapter:<path>"`: a LoRA reward adapter from `RewardTrainer`, run on the
            LoRA policy's own frozen base.
        args: a `PPOConfig`.
        train_dataset: rows with `prompt` (text or messages) or `messages`; other columns reach reward functions.
        processing_class: the policy's tokenizer (default: loaded from the policy's path).
        value_model: None for a value head on the policy; `"adapter"` or `ValueAdapter(peft_config)` for a value LoRA
            adapter + value head on the policy's base; else a value model (or its path) as in `PolicyAndValue`.
        ref_model: the reference. None: the policy with adapters disabled for a `PeftModel`, else a frozen copy of
            the initial policy (kept outside the trained module, so it is not checkpointed).
        reward_processing_class: the reward model's tokenizer, which may differ from the policy's.
        peft_config / model_config: LoRA for the policy (`peft_config`, or from `model_config.use_peft`).
        ptx_dataset: language-modelling data (any SFT format) for `PPOConfig.ptx_coef`.
        callbacks: more `TrainerCallback`s.
        optimizers: (optimizer, scheduler), as for `Trainer`.
        data_collator: trl 1.12's name, taken so its scripts run: prompts are batched and left-padded by the
            rollout itself, so only None or a `DataCollatorWithPadding` (unused) is accepted.
        eval_dataset: prompt rows (as `train_dataset`; a dataset or a dict of them, checked before any model
            loads) for `evaluate()` and `eval_strategy`, as TRL's GRPOTrainer: `num_generations_eval` completions per
            prompt, sampled (or greedy, `eval_do_sample=False`), logged as `eval_reward`, `eval_rewards/{name}/mean`,
            `eval_completions/*`, `eval_pass@k`, ... (`hf_rlhf.rollout.evaluation`); the training RNG is untouched.
        compute_metrics: `(prompts, completions, **columns) -> {name: float}` over every evaluated completion,
            logged as `eval_{name}`.
        tools: Python functions the policy may call (TRL 1.16 GRPOTrainer's `tools`: type-hinted, Google-style
            docstring; sync or async), for every `advantage_estimator`. The prompts (conversational) are rendered
            with them; the rollout then alternates turns and tool calls (`hf_rlhf.rollout.multiturn`) up to
            `max_tool_calling_iterations`; tool results are in the context, not in the loss. A call's exception, an
            unknown tool, a malformed call or a timeout (`tool_call_timeout`) becomes an error message the policy
            reads. Reward functions receive the completion as its message list (assistant turns and tool messages).
        environment_factory: TRL 1.16's: a no-argument callable returning an environment with `reset(**row)`
            (returning None or a string appended to the row's last user message), public methods that are its tools,
            and optionally `get_reward()`, a score added to `reward_model`'s (which may then be None); or a dict
            `{name: factory}` routing each row by its `environment` field. One instance per rollout row, pooled and
            reset per rollout; reward functions receive them as `environments=`. With one factory, `train_dataset`
            may be None: the environment's `reset()` writes each prompt (`max_steps` sets the length).
        rollout_func: TRL 1.16's `(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", "env_mask"?,
            ...}`: generates the rollout itself. It gets one prompt per rollout row (G copies of a prompt for the
            group estimators, where TRL hands over each prompt once) and returns one completion per row; `env_mask`
            (0 on tokens the policy did not generate) keeps those out of the loss; other keys reach the reward as
            columns; `logprobs` are not used (the rollout's own forward computes the old log-probs). Not combined
            with `tools` / `environment_factory`.

    trl 1.12's `trl.experimental.ppo.PPOTrainer` keywords all work (`args`, `processing_class`, `model`,
    `ref_model`, `reward_model`, `train_dataset`, `value_model`, `data_collator`, `eval_dataset`, `optimizers`,
    `callbacks`, `peft_config`); its positional order is not kept (`model` and `reward_model` come first here).

    Override points for subclasses:
        `compute_rewards(prompts, completions, **columns) -> (B,)`: the scores of each rollout batch (default:
        `self.reward_source(...)`). `trainer.reward_source` may also be replaced after `__init__` (a callable of
        the same signature); the next rollout uses it. `reward_normalization="model_stats"` keeps the statistics
        of the reward model given to `__init__`.

    One frozen base for all four roles (`hf_rlhf.rewards.adapter`, `hf_rlhf.models.value_adapter`;
    reference = adapters off)::

        PPOTrainer(model="sft-dir", reward_model=RewardAdapter("rm-lora-dir"), value_model="adapter", args=...,
                   train_dataset=..., model_config=ModelConfig(use_peft=True, load_in_4bit=True))
    """

    config_class = PPOConfig
    tag_names = ("hf_rlhf", "trl", "ppo")
    default_output_dir = "ppo-output"
    loss_is_scaled_for_ga = True  # compute_loss divides by the minibatch's token count (see get_batch_samples)

    def __init__(self, model, reward_model, args: PPOConfig | None = None, train_dataset=None, processing_class=None,
                 value_model=None, ref_model=None, reward_processing_class=None, peft_config=None,
                 model_config: ModelConfig | None = None, ptx_dataset=None, callbacks=None, optimizers=(None, None),
                 data_collator=None, eval_dataset=None, tools=None, environment_factory=None, rollout_func=None,
                 compute_metrics=None, **kwargs):
        self.check_extra_kwargs(kwargs)
        args = self.resolve_args(args)
        args.ignore_data_skip = True  # the loader fast-forwards itself; the Trainer's skip would regenerate rollouts
        if args.importance_sampling_level == "sequence" and args.loss_type == "vespo":  # TRL's warnings, its words
            logger.warning("VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
                           "should be set to `'token'` (the default).")
        if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            logger.warning("When using `importance_sampling_level='sequence'`, the %r loss sums per-token "
                           "contributions, which effectively weights each sequence by its completion length instead "
                           "of optimizing the per-sequence objective; GSPO's own objective is loss_type='grpo'",
                           args.loss_type)
        check_streamed_rollouts(args, train_dataset, eval_dataset)  # TRL's dispatch_batches / workers for streams
        placeholder = False  # True: the prompts are empty user turns, each row's environment `reset()` writes it
        if train_dataset is None and environment_factory is not None:  # the environment owns the data (as TRL)
            train_dataset, placeholder = placeholder_prompts(args, environment_factory), True
        self.require_train_dataset(train_dataset)  # TRL's message: "`train_dataset` is required"
        if ref_model is not None and ref_model is model:
            raise ValueError("model and ref_model are the same object: pass None (a frozen copy is made, or the "
                             "adapters are switched off for a PeftModel) or a separate copy.")
        if data_collator is not None and not isinstance(data_collator, DataCollatorWithPadding):
            raise ValueError("PPOTrainer batches and left-pads the prompts itself for generation; data_collator "
                             f"(a {type(data_collator).__name__}) would not be used. Leave it None.")
        # the prompt rows are checked before any model is loaded: a bad row fails in seconds, naming row and field
        train_dataset = as_dataset(train_dataset)
        if environment_factory is not None and not {"prompt", "messages"} & set(train_dataset.column_names):
            # rows routed to environments only (TRL): each row's `reset()` writes its prompt into an empty user turn
            placeholder = True
            train_dataset = train_dataset.add_column("prompt", [PLACEHOLDER_PROMPT] * len(train_dataset))
        # (empty user turns for the environment to fill are not checked as prompts)
        train_dataset, conversational = (train_dataset, True) if placeholder else validate_prompt_dataset(train_dataset)
        tools = list(tools or [])
        tool_dict(tools)  # named callables, checked before any model is loaded
        if rollout_func is not None and (tools or environment_factory is not None):
            raise ValueError("rollout_func generates the rollout itself: it is not combined with tools or "
                             "environment_factory (run the tools inside it and mark their tokens with env_mask)")
        if rollout_func is not None and not callable(rollout_func):
            raise ValueError(f"rollout_func must be a callable (prompts, trainer) -> dict, got {rollout_func!r}")
        multi_turn = bool(tools) or environment_factory is not None or rollout_func is not None
        self._eval_checked = check_eval_setup(args, eval_dataset, multi_turn)  # eval rows too, before any model
        self.environment_pool = None
        if environment_factory is not None:  # probes each environment: its tools are rendered into the prompts
            self.environment_pool = environment_factory if isinstance(environment_factory, EnvironmentPool) else \
                EnvironmentPool(environment_factory, tools)
            self.environment_pool.prompt_is_placeholder = placeholder or self.environment_pool.prompt_is_placeholder
            tools = self.environment_pool.template_tools
        if reward_model is None and not (self.environment_pool is not None and self.environment_pool.has_reward):
            raise ValueError("No reward source provided: pass a reward function, model or endpoint (reward_model / "
                             "reward_funcs), or an environment_factory whose environment defines get_reward()")
        if tools or environment_factory is not None:
            if not conversational:
                raise ValueError("tools need conversational prompts (a `prompt` or `messages` list of messages): the "
                                 "chat template renders the tools, the tool calls and their results")
            if processing_class is not None and not isinstance(processing_class, str):
                check_tool_tokenizer(rollout_tokenizer(processing_class))
        # every model given by path can be loaded (a local directory, the local hub cache, the Hub): a reward model
        # that cannot fails now, in one line, not after the policy and the reference are loaded
        check_reward_model_path(reward_model)
        for what, path in (("reference model", ref_model if args.uses_reference else None),
                           ("value model", None if args.critic_free else value_model)):
            if isinstance(path, str) and resolve_value_adapter(path) is None:
                check_model_path(path, what)
        set_seed(args.seed)  # as the Trainer does, but before the value head (and a value adapter) are initialised
        policy, model_config = resolve_model(model, model_config, **self.model_init_kwargs(model, args))
        processing_class = self.resolve_tokenizer(processing_class, policy)
        if processing_class.pad_token is None:  # PPO tracks padding with masks, never by id: eos is safe (as TRL)
            processing_class.pad_token = processing_class.eos_token
        if processing_class.pad_token is None:
            raise ValueError("the policy tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        # the tokenizer prompts and turns are rendered with: with tools, TRL's prefix-preserving template if needed
        multi_turn_tools = bool(tools) or self.environment_pool is not None
        self._rollout_tokenizer = rollout_tokenizer(processing_class) if multi_turn_tools else processing_class
        if tools:
            check_tool_tokenizer(self._rollout_tokenizer)
            if stop_token_id_of(args, processing_class) is None:
                raise ValueError("tools need a stop token that ends the policy's turn: stop_token='eos' (with an eos "
                                 "token) or stop_token_id")
        policy = self.add_peft(policy, model_config, args, peft_config, prompt_learning=False)
        if args.use_liger_kernel:
            check_liger_lm_head(policy)
        module, ref_model = self._build_models(policy, value_model, ref_model, args)
        self.share_prompts = self._resolve_prefix_sharing(args, module, ref_model)
        capture_decoding = self._resolve_logprobs_from_generation(args, module, multi_turn)

        reward_source = None if reward_model is None else build_reward_source(
            reward_model, reward_processing_class, device=args.device, batch_size=args.local_rollout_forward_batch_size,
            policy=module.policy, policy_tokenizer=processing_class)
        reward_stats = getattr(reward_source, "reward_stats", None)
        if args.reward_normalization == "model_stats" and reward_stats is None:
            raise ValueError("reward_normalization='model_stats' needs reward_mean / reward_std in the reward model's "
                             "config (train it with RewardConfig(store_reward_stats=True)); a reward function has "
                             "none: use 'running' or 'none'.")
        positions = getattr(getattr(module.policy, "config", None), "max_position_embeddings", None)
        pool = self.environment_pool
        train_dataset = prepare_prompt_dataset(train_dataset, self._rollout_tokenizer, args, max_positions=positions,
                                               conversational=conversational, tools=tools,
                                               row_tools=pool.tools_for if pool is not None and pool.multi else None)
        self.ptx_dataset = self._prepare_ptx(ptx_dataset, processing_class, args)
        own = [KLControllerCallback(args.kl_coef, args.kl_target, args.kl_horizon), EpochFromStepCallback()]
        if args.reward_normalization == "running":
            own.append(RewardStatsCallback())
        if args.use_adaptive_entropy:
            own.append(AdaptiveEntropyCallback(args.entropy_coef))
        super().__init__(model=module, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=own + list(callbacks or []),
                         optimizers=optimizers)
        # evaluation (`OnlineEvalMixin`): eval rows tokenized at their first use; `compute_metrics` on the completions
        self.compute_metrics_fn, self._eval_prepared, self._eval_positions = compute_metrics, {}, positions
        self._evaluating = False

        self.ref_model = self._prepare_frozen(ref_model)
        if isinstance(reward_source, ModelReward):
            reward_source.model = self._prepare_frozen(reward_source.model)
        self.reward_source = reward_source
        # through the method, so a subclass's `compute_rewards` and a `reward_source` set later both take effect
        self.tools = tools
        tool_rollout = None
        if tools or self.environment_pool is not None:
            runner = ToolRunner(args.tool_max_workers, args.tool_call_timeout)
            tool_rollout = ToolRollout(self._rollout_tokenizer, stop_token_id_of(args, processing_class),
                                       args.response_length, args.max_tool_calling_iterations, runner)
        self.lm_heads = self._resolve_lm_heads(args, module, ref_model)
        self.rollout_maker = RolloutMaker(args, processing_class, self.compute_rewards, self.accelerator,
                                          self.ref_model, reward_stats, tool_rollout, self._row_tools,
                                          None if rollout_func is None else lambda prompts: rollout_func(prompts, self),
                                          self.share_prompts, capture_decoding, self.lm_heads)
        self._loader, self._resume_from = None, None

    def _resolve_lm_heads(self, args, module, ref_model) -> tuple:
        """(policy's, reference's) `LMHead` for the log-probs in chunks of tokens (`PPOConfig.chunked_lm_head`), each
        None for the full logits; the reference of a LoRA policy (adapters off) is the policy's head."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3):
            if args.chunked_lm_head:
                raise ValueError("chunked_lm_head=True, but FSDP / DeepSpeed ZeRO-3 shard the LM head outside the "
                                 "model's forward; leave it None or False.")
            return None, None
        name = type(self).__name__
        policy = resolve_lm_head(module.policy, args.chunked_lm_head, name)
        return policy, policy if ref_model is None else resolve_lm_head(ref_model, args.chunked_lm_head, name)

    @staticmethod
    def _build_models(policy, value_model, ref_model, args):
        """(PolicyAndValue, reference or None): the frozen reference copy, the value function, dropout off."""
        if not args.uses_reference:  # β fixed at 0: the KL is used nowhere, so no reference (as TRL's GRPO, beta=0)
            if ref_model is not None:
                logger.warning("ref_model is not used: kl_coef=0 with no kl_target puts no KL in the rewards or the "
                               "loss. Set kl_coef > 0 (or kl_target) to train against it.")
            ref_model = None
        elif isinstance(ref_model, str):
            ref_model = load_model(ModelConfig(model_name_or_path=ref_model))
        elif ref_model is None and unwrap_peft(policy) is policy:  # a PeftModel's reference is its adapters off
            ref_model = _reference_copy(policy)  # kept outside the trained module: never checkpointed
        if args.critic_free:  # GRPO / RLOO / REINFORCE++: nothing of a value function is built or stepped
            if value_model is not None:
                raise ValueError(f"advantage_estimator={args.advantage_estimator!r} uses no value function; "
                                 f"value_model={value_model!r} was given (leave it None, or use 'gae')")
            if args.disable_dropout:
                disable_dropout(policy)
            return PolicyAndValue(policy, with_value=False), ref_model
        value_adapter = resolve_value_adapter(value_model)
        if value_adapter is not None:
            value_model, value_adapter = None, add_value_adapter(policy, value_adapter, args.activation_checkpointing)
        elif isinstance(value_model, str):
            with hub_errors(value_model, "value model"):
                value_model = AutoModelForSequenceClassification.from_pretrained(value_model, num_labels=1)
        if args.disable_dropout:  # old log-probs come from eval mode: the first ratio must be exactly 1
            for part in (policy, value_model):
                if part is not None:
                    disable_dropout(part)
        return PolicyAndValue(policy, value_model, value_adapter=value_adapter), ref_model

    @staticmethod
    def _resolve_prefix_sharing(args, module, ref_model) -> bool:
        """`PPOConfig.prefix_sharing` decided on these models: every model that scores the rollout's rows (policy,
        reference, value model) must take the shared layout's 4D mask and give the padded layout's outputs
        (`check_packing_exact`, a few ms)."""
        wanted = args.prefix_sharing
        if wanted is False or (wanted is None and args.num_generations < 2):
            return False
        models = [m for m in (module.policy, ref_model, module.value_model) if m is not None]
        max_length = None if args.max_prompt_length is None else args.max_prompt_length + args.response_length
        reason = None
        for model in models:
            attn = getattr(reward_config_of(model), "_attn_implementation", None)
            if attn not in ("sdpa", "eager"):
                reason = f"{type(unwrap_peft(model)).__name__} runs {attn!r} attention, which takes no 4D mask"
                break
            try:
                with _whole_weights(model):  # ZeRO-3 shards (zero.Init): every rank gathers them for the check
                    check_packing_exact(model, "prefix_sharing", max_length)
            except PackingCheckError as err:
                reason = str(err)
                break
        if reason is None:
            logger.info("prefix_sharing: the completions of a prompt share one row (the prompt computed once)")
            return True
        if wanted:
            raise ValueError(f"PPOConfig.prefix_sharing=True cannot be honoured: {reason}")
        logger.info("prefix_sharing off (rows of a prompt run apart): %s", reason)
        return False

    @staticmethod
    def _resolve_logprobs_from_generation(args, module, multi_turn: bool) -> bool:
        """`PPOConfig.logprobs_from_generation` decided on this setup (the rollout checks the numbers on its first
        rollout); False where the loss gives the old log-probs anyway."""
        wanted = args.logprobs_from_generation
        if args.sampling_correction:  # the decoding's log-probs are the sampler's, compared with a policy forward
            check_sampling_correction(args, multi_turn)
            if wanted:
                raise ValueError("logprobs_from_generation=True takes the old log-probs off the decoding, and "
                                 "vllm_importance_sampling_correction=True compares those with the trainer's "
                                 "forward: set one of them")
            return False
        if wanted is False or args.old_logprobs_in_loss:
            return False
        reasons = []
        if not build_engine(args.generation_backend).supports_capture:
            reasons.append(f"generation_backend={args.generation_backend!r} returns no log-probs")
        if multi_turn:
            reasons.append("a multi-turn rollout (tools, environment_factory or rollout_func) is scored by a forward")
        if args.filter_groups:
            reasons.append("filter_groups joins rows of several generation rounds")
        if (args.generation_kwargs or {}).get("num_beams", 1) > 1:
            reasons.append("beam search (num_beams > 1) reorders its beams at every decoding step")
        if is_deepspeed_zero3_enabled():
            reasons.append("under ZeRO-3 the value head's shards live outside generation")
        if module.value_model is not None or module.value_adapter is not None:
            reasons.append("a separate value model / value adapter needs its own forward")
        if not reasons:
            return True
        if wanted:
            raise ValueError(f"PPOConfig.logprobs_from_generation=True cannot be honoured: {'; '.join(reasons)}")
        logger.info("logprobs_from_generation off (the rollout runs a policy forward): %s", "; ".join(reasons))
        return False

    @staticmethod
    def _prepare_ptx(ptx_dataset, tokenizer, args):
        if (ptx_dataset is None) != (args.ptx_coef == 0):
            raise ValueError("ptx_coef > 0 needs a ptx_dataset, and a ptx_dataset needs ptx_coef > 0.")
        if ptx_dataset is None:
            return None
        options = DataOptions(max_length=None, overlong_policy="truncate", dataset_num_proc=args.dataset_num_proc)
        return prepare_sft_dataset(ptx_dataset, tokenizer, options)

    def _prepare_frozen(self, model):
        if model is None:
            return None
        model = model.eval().requires_grad_(False)
        if self.is_deepspeed_enabled:
            from trl.models.utils import prepare_deepspeed

            return prepare_deepspeed(model, self.accelerator)
        return model.to(self.accelerator.device) if getattr(model, "hf_device_map", None) is None else model

    # -- data: the experience loader -----------------------------------------------------------------
    def get_train_dataloader(self) -> ExperienceLoader:
        args, micro = self.args, self._train_batch_size  # the trainer's own: auto_find_batch_size may shrink it
        minibatch = micro * args.gradient_accumulation_steps
        if args.rollout_batch_size % minibatch:
            raise ValueError(f"rollout_batch_size={args.rollout_batch_size} is not a multiple of micro-batch x "
                             f"gradient_accumulation_steps = {micro} x {args.gradient_accumulation_steps}")
        self._loader = ExperienceLoader(
            self.train_dataset, self._make_experience, rollout_batch_size=args.rollout_batch_size,
            micro_batch_size=micro, num_ppo_epochs=args.num_ppo_epochs,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            process_index=self.accelerator.process_index, num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            get_global_step=lambda: self.state.global_step, get_resume_dir=lambda: self._resume_from,
            device=self.accelerator.device, extra_batch=self._ptx_batch if self.ptx_dataset is not None else None,
            num_generations=args.num_generations, refill=args.filter_groups,
            group_by_length=args.micro_batches_by_length, shuffle=getattr(args, "shuffle_dataset", True),
            num_workers=args.dataloader_num_workers)
        return self._loader

    def compute_rewards(self, prompts: list, completions: list, **columns) -> torch.Tensor:
        """The scores PPO trains on for one rollout; override in a subclass to score another way.

        Called once per rollout batch on every rank, after generation, with that rank's rows. Default:
        `self.reward_source(prompts, completions, **columns)` (looked up at each call, so assigning
        `trainer.reward_source` after `__init__` takes effect).

        Args:
            prompts: B prompts as in the dataset (strings, or message lists).
            completions: B decoded completions (strings, or `[{"role": "assistant", "content": ...}]`).
            columns: the rows' other dataset columns, each a list of B values.

        Returns:
            (B,) scores (a tensor or a list of numbers; checked finite, one per completion), before
            `reward_normalization`, the missing-stop penalty and the KL penalty.
        """
        environments = columns.pop("environments", None)
        parts = []
        if self.reward_source is not None:
            if environments is not None and isinstance(self.reward_source, FunctionReward):
                columns["environments"] = environments  # as TRL passes them to reward functions
            parts.append(torch.as_tensor(self.reward_source(prompts, completions, **columns), dtype=torch.float32))
        if environments is not None and self.environment_pool.has_reward:  # TRL: weight 1, alongside the others
            parts += [environment_scores(func, environments) for func in self.environment_pool.reward_funcs()]
        if not parts:
            return torch.zeros(len(completions))
        parts = torch.stack(parts)  # NaN: that source did not score the row (another environment's)
        return parts.nansum(0).masked_fill(torch.isnan(parts).all(0), float("nan"))

    def _row_tools(self, rows: list[dict]) -> tuple[list[dict], list[dict], dict]:
        """(rows, {name: callable} per row, extra reward fields) for one generation round of a rollout with tools."""
        if self.environment_pool is None:
            tools = tool_dict(self.tools)
            return rows, [tools for _ in rows], {}
        instances, tool_sets, observations = self.environment_pool.take(rows)
        out = []
        for row, observation in zip(rows, observations):
            if observation is not None:  # TRL: the observation ends the last user message
                prompt = list(row["prompt"])
                prompt[-1] = {**prompt[-1], "content": prompt[-1]["content"] + str(observation)}
                tools = self.environment_pool.tools_for(row) if self.environment_pool.multi else self.tools
                ids = self._rollout_tokenizer.apply_chat_template(prompt, tools=tools or None, tokenize=True,
                                                                add_generation_prompt=True, return_dict=True)
                row = {**row, "prompt": prompt, "input_ids": list(ids["input_ids"])}
            out.append(row)
        return out, tool_sets, {"environments": instances}

    def _make_experience(self, rows, indices, refill=None):
        # looked up at each rollout: a checkpoint restore may have replaced these callbacks in the handler
        kl = find_callback(self.callback_handler, KLControllerCallback).controller
        stats_cb = find_callback(self.callback_handler, RewardStatsCallback)
        # one process, no wrapper: the model itself (accelerate's unwrap re-reads package metadata, ~5 ms a call)
        wrapped = self.model_wrapped
        model = wrapped if wrapped is self.model else self.accelerator.unwrap_model(wrapped)
        if self.environment_pool is not None:
            self.environment_pool.check_rows(rows, indices)  # a dict's unknown environment names the dataset row
            self.environment_pool.new_rollout()
        experience, stats = self.rollout_maker.make(model, rows, kl.value, stats_cb and stats_cb.moments, indices,
                                                    refill)
        if "objective/kl" in stats:  # absent with old_logprobs_in_loss, whose β is fixed (nothing to update)
            kl.update(stats["objective/kl"], self.args.rollout_batch_size * self.accelerator.num_processes)
        return experience, stats

    def _ptx_batch(self, index: int) -> dict:
        # rows drawn by the micro-batch's global index: the same on resume, without replaying anything
        generator = seeded_generator(self.args.seed, self.accelerator.process_index, index, 2)
        rows = torch.randint(len(self.ptx_dataset), (self._train_batch_size,), generator=generator).tolist()
        batch = PaddingCollator(self.processing_class.pad_token_id)([self.ptx_dataset[i] for i in rows])
        return {f"ptx_{key}": value.to(self.accelerator.device) for key, value in batch.items()}

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The minibatch's response tokens as `num_items_in_batch`: the loss is an exact token mean over it."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:
            return batches, None
        tokens = sum(batch["response_mask"].sum() for batch in batches).float().to(device)
        if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
            # DDP averages gradients over ranks, so each rank divides by its share of the global count
            tokens = self.accelerator.reduce(tokens, reduction="sum") / self.accelerator.num_processes
        return batches, tokens

    # -- loss ----------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, exp = self.args, Experience.from_dict(inputs)
        mask = exp.response_mask
        normalizer = num_items_in_batch if num_items_in_batch is not None else mask.sum()
        if args.mask_truncated_completions:  # a minibatch of truncated responses only has no token (as TRL: >= 1)
            normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=mask.device).clamp(min=1.0)
        extra = (inputs["ptx_input_ids"], inputs["ptx_attention_mask"]) if "ptx_input_ids" in inputs else None
        # attention over every token the policy saw (a multi-turn response's tool results too); the loss over `mask`
        # (the LM head in chunks of those tokens where it splits off: `PPOConfig.chunked_lm_head`)
        logprobs, token_entropy, values, ptx_logits = response_scores(
            model, self.lm_heads[0], exp.query_ids, exp.query_mask, exp.response_ids, exp.context_mask,
            args.temperature, self.share_prompts, entropy_grad=args.entropy_coef > 0 or args.use_adaptive_entropy,
            extra_rows=extra)
        # one optimizer step per rollout: this forward runs the rollout's weights, so its detached log-probs are
        # the old ones (the rollout skipped its own policy forward; `PPOConfig.old_logprobs_in_loss`)
        old_logprobs = logprobs.detach() if args.old_logprobs_in_loss else exp.old_logprobs
        entropy_mask = None
        if args.top_entropy_quantile < 1.0:  # TRL's 80/20 rule: the loss on the high-entropy tokens only
            entropy_mask = self.get_high_entropy_mask(token_entropy.detach(), mask, 1 - args.top_entropy_quantile)
        # the loss type, its masks and the sampler correction (`hf_rlhf.losses.grpo`, TRL's order)
        per_token_pg, pg_stats = policy_terms(args, logprobs, old_logprobs, exp.advantages, mask,
                                              exp.sampling_logprobs, exp.sampling_ratio, entropy_mask)
        per_token_loss, sums = per_token_pg, {"loss/policy_avg": masked_sum(per_token_pg.detach(), mask)}
        if args.kl_in_loss and args.uses_reference:  # GRPO: β·KL per token, β the rollout's (the controller's)
            kl = kl_penalty(logprobs, exp.ref_logprobs, args.kl_estimator, clamp=args.kl_clamp)
            if args.use_bias_correction_kl:  # TRL's GRPO: the KL weighted by the ratio, gradient included
                kl = kl * torch.exp(importance_log_weights(logprobs - old_logprobs.detach(), mask,
                                                           args.importance_sampling_level))
            per_token_loss = per_token_pg + inputs["rollout_stats"]["objective/kl_coef"] * kl
            sums["loss/kl_avg"] = masked_sum(kl.detach(), mask)
        loss = self._aggregate(per_token_loss, mask, normalizer)
        pg_stats["policy_loss"] = loss.detach() * (  # TRL's `policy_loss`: before the accumulation's scaling
            1 if args.loss_type in TOKEN_SUM_LOSS_TYPES else self.current_gradient_accumulation_steps)
        means = {"policy/approxkl_avg": pg_stats["approxkl"], "policy/clipfrac_avg": pg_stats["clipfrac"],
                 "val/ratio": pg_stats["ratio_mean"]}
        if not args.critic_free:
            vf_loss, vf_stats = value_loss(values, exp.old_values, exp.returns, mask, args.cliprange_value, normalizer)
            loss = loss + args.vf_coef * vf_loss
            sums["loss/value_avg"], means["val/clipfrac_avg"] = vf_loss * normalizer, vf_stats["clipfrac"]
        # the bonus on the tokens the policy loss acts on (TRL: the entropy mask's), the metric on every token
        bonus_mask = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - self._entropy_coef(token_entropy, bonus_mask) * masked_sum(token_entropy, bonus_mask) / normalizer
        sums["policy/entropy_avg"] = masked_sum(token_entropy.detach(), mask)
        loss = loss + self._aux_loss()

        tokens = mask.sum().float()
        metrics = self.metrics["train"]
        for name, value in sums.items():  # sums over this micro-batch's tokens
            metrics.add(name, value, tokens)
        for name, value in means.items():  # means over this micro-batch's tokens
            metrics.add(name, value * tokens, tokens)
        for name, value in inputs["rollout_stats"].items():
            metrics.add(name, value)
        self.log_policy_terms(metrics, logprobs.detach(), old_logprobs.detach(), exp.advantages, mask, pg_stats)
        if args.old_logprobs_in_loss:  # the rollout's policy statistics, from this forward (per sequence means)
            detached = logprobs.detach()
            token_kl = kl_penalty(detached, exp.ref_logprobs, args.kl_estimator, clamp=args.kl_clamp)
            beta = inputs["rollout_stats"]["objective/kl_coef"]
            for name, value in sequence_policy_stats(token_kl, detached, exp.scores, mask, beta).items():
                if args.uses_reference or name not in KL_METRICS:
                    metrics.add(name, value.sum(), float(value.numel()))
        if ptx_logits is not None:
            labels = inputs["ptx_labels"][:, 1:]
            ptx_loss = F.cross_entropy(ptx_logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            loss = loss + args.ptx_coef * ptx_loss / self.current_gradient_accumulation_steps
            metrics.add("loss/ptx_avg", ptx_loss)
        return (loss, {"logprobs": logprobs, "values": values}) if return_outputs else loss

    def log_policy_terms(self, metrics, logprobs, old_logprobs, advantages, mask, stats=None) -> None:
        """Hook for more per-micro-batch policy metrics (`GRPOTrainer`: TRL's clip ratios); all (B, T), detached;
        `stats`: those of `hf_rlhf.losses.grpo.grpo_policy_loss_per_token`."""

    def _aggregate(self, per_token_loss, mask, normalizer):
        """The policy loss reduced as `loss_type` says, scaled for gradient accumulation (as TRL's GRPO)."""
        if self.args.loss_type in TOKEN_SUM_LOSS_TYPES:  # the step's token count: micro-batches add up to its mean
            return aggregate_loss(per_token_loss, mask, self.args.loss_type, normalizer=normalizer)
        # per micro-batch reductions, averaged over the step's micro-batches (bnpo thus depends on how they are cut)
        loss = aggregate_loss(per_token_loss, mask, self.args.loss_type, self.args.response_length)
        return loss / self.current_gradient_accumulation_steps

    # -- optimizer: the value function may get its own learning rate ---------------------------------
    def create_optimizer(self, model=None):
        module = self.accelerator.unwrap_model(model if model is not None else self.model)
        module.require_value_grads()  # the Trainer keeps only parameters requiring grad; peft's switches may freeze it
        optimizer = super().create_optimizer(model)
        lr = self.args.value_learning_rate
        if lr is not None:
            names = module.value_parameter_names()
            value_ids = {id(p) for name, p in module.named_parameters() if name in names}
            for group in list(optimizer.param_groups):
                value = [p for p in group["params"] if id(p) in value_ids]
                if value:
                    group["params"] = [p for p in group["params"] if id(p) not in value_ids]
                    optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                               "params": value, "lr": lr})
        return optimizer

    # -- checkpoints ---------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        resume_from_checkpoint = self.resolve_resume_checkpoint(resume_from_checkpoint)
        self._resume_from = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def _save_checkpoint_extras(self, checkpoint_dir: str) -> None:
        if self._loader is not None:  # the current rollout's experience (per rank), into the staged checkpoint
            self._loader.save_state(checkpoint_dir)

    def _nonfinite_watch(self, inputs) -> dict:
        stats = inputs["rollout_stats"]  # per rollout, checked before each of its optimizer steps
        # (the KL is absent when the loss computes it, `old_logprobs_in_loss`: a non-finite KL makes the loss so)
        return {name: stats[name] for name in ("objective/kl", "objective/raw_scores") if name in stats}
