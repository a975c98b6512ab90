"""`PPOConfig`: PPO options as a `transformers.TrainingArguments` subclass (TRL's names where TRL has them).

Batch sizes, per device, for one rollout::

    per_device_train_batch_size   micro-batch: rows in one forward/backward          (TRL: same)
    gradient_accumulation_steps   micro-batches per optimizer step (a "minibatch")   (TRL: same)
    num_mini_batches              optimizer steps per pass over the rollout          (TRL: same)
    rollout_batch_size            prompts per rollout = micro x GA x num_mini_batches  (TRL's `local_batch_size`)
    num_ppo_epochs                passes over each rollout                           (TRL: same)

so one rollout gives `num_mini_batches * num_ppo_epochs` optimizer steps. With `num_generations = G > 1` a rollout's
rows are completions: `rollout_batch_size / G` prompts, each sampled G times (TRL's GRPO counts its batches in
completions too); every rank samples its own prompts' G completions, so a prompt's group is on one rank.
`max_steps` / `num_train_epochs` count optimizer steps and passes over the prompt dataset, as in every Trainer
(TRL's `total_episodes` is not used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..data.options import InputCheckOptions
from ..generation.engines import GENERATION_BACKENDS, check_lean_options
from ..losses.ppo import IMPORTANCE_SAMPLING_LEVELS
from ..rl.critic_free import LOSS_TYPES, SCALE_REWARDS
from ..rl.kl import KL_ESTIMATORS
from .base_config import DeviceDefaultsMixin, NonFiniteOptions
from .config_checks import check_field_types, renamed_options
from .eval_options import OnlineEvalOptions
from .policy_loss_options import PolicyLossOptions

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
CRITIC_FREE = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")  # a baseline from the prompt's G samples
TRL_NUM_GENERATIONS = 8  # trl.GRPOConfig's / trl.RLOOConfig's default number of completions per prompt
REWARD_NORMALIZATIONS = ("none", "running", "model_stats")
PROMPT_OVERLONG_POLICIES = ("error", "truncate", "drop")


@renamed_options("init_kl_coef", "adap_kl_ctrl", "target", "horizon", "epsilon")
@dataclass
class PPOConfig(OnlineEvalOptions, InputCheckOptions, NonFiniteOptions, PolicyLossOptions, DeviceDefaultsMixin,
                TrainingArguments):
    """PPO options (a `TrainingArguments`): every Trainer option works as usual.

    Batches (per device; see the module docstring):
        per_device_train_batch_size, gradient_accumulation_steps: the micro-batch and the micro-batches per
            optimizer step, as for any Trainer.
        num_mini_batches: optimizer steps per pass over one rollout.
        rollout_batch_size: rows (completions) per rollout per device: `rollout_batch_size / num_generations`
            prompts, each sampled `num_generations` times. None: `per_device_train_batch_size *
            gradient_accumulation_steps * num_mini_batches`. When given it must be a multiple of
            `per_device_train_batch_size * gradient_accumulation_steps`, and `num_mini_batches` is derived from it.
        num_ppo_epochs: passes over each rollout.
        local_rollout_forward_batch_size: rows per no-grad forward during the rollout (generation, log-probs,
            values, reward model).
    Prompts:
        max_prompt_length: longest tokenized prompt. None: the policy's `max_position_embeddings` minus
            `response_length` (a prompt and its response must fit in the model's positions; a value above that is
            an error). Longer prompts are handled by `prompt_overlong_policy`: `error` (default; the error names the
            row), `truncate` (keep the last tokens, as TRL's GRPO truncates prompts from the left) or `drop`; the
            number truncated or dropped is logged.
        max_unk_share, strict: prompts with more than this share of unknown tokens are counted in a warning, or
            with `strict` are an error (`InputCheckOptions`).
    Generation:
        response_length: max new tokens (TRL's name). temperature, top_k (0: off), top_p: sampling; the
            log-probabilities of training use the same temperature. generation_kwargs: extra `generate` arguments.
        generation_backend: the rollout's generation engine (`hf_rlhf.generation`). "generate": transformers'
            `generate` with the dynamic KV cache (the reference). "static": a pre-allocated static KV cache with the
            decoding forward compiled (`torch.compile`), prompts left-padded to multiples of 32 columns so a new
            prompt length reuses its bucket's graph; it pays a one-off compile per (batch, bucket) shape
            (tens of seconds on CPU), logged and counted in the engine's stats. Same greedy tokens as
            "generate" on every zoo architecture. "lean": a minimal decode loop on the model's own forward with
            transformers' `DynamicCache` and the logits warpers `generate` builds (temperature, top_k, top_p): the
            same tokens as "generate" (greedy, and sampled with the same seed) without generate's per-step Python
            overhead; options it does not implement (repetition_penalty, min_new_tokens, num_beams, ... in
            generation_kwargs or the model's generation_config) are a ValueError naming them.
            Default "generate" on every device: on this project's loaded 2-core CPU (bench/generation.py,
            docs/benchmarks.md) compiled "static" decoded a 42M Llama at 1.14x generate's tokens/s (per-round
            ratios 1.35 and 0.94: within the machine's noise) and the 0.9M toy at 0.83x, after 24-28 s of compile
            per (batch, bucket) shape, so compile included it was 0.59x / 0.13x over 4 batches; the eager static
            cache alone is no faster; no GPU was measured here. Try "static" for long runs with one batch shape, on
            GPUs above all.
            "lean" is not the default either: transformers 5.24's `generate` costs only ~1 ms a step over the
            model's own forward, so per CPU-second lean decoded 1.17-1.18x generate's tokens on the 0.9M toy but
            0.91-1.01x on the 42M Llama, and GRPO (bench/critic_free.py) ran at 1.02-1.03x episodes per CPU-second
            (0.94-1.03x wall, within the machine's noise); it is exact, so it can be chosen freely where its options
            suffice.
        prefix_sharing: rows of a forward that share a prompt (the G completions of a group estimator) run as one
            row [prompt | completion 1 | ... | completion k] with a 4D attention mask, the prompt computed once, in
            the reference's forward, the rollout's policy forward and the loss's forward and backward
            (`hf_rlhf.rollout.shared_prompts`; DPOConfig's option of the same name, with G tails). The same
            log-probs and values to float rounding. None (default): on when num_generations > 1 and every model
            takes the 4D mask (sdpa or eager attention; checked on the model before training,
            `hf_rlhf.models.packing_check`), else off with a log line; True: required (an error where it cannot be);
            False: off.
        chunked_lm_head: the log-probs and entropy of the response tokens (the loss's, the rollout's old and the
            reference's) from the last hidden states, the LM head applied to a chunk of response tokens at a time and
            recomputed in the backward, never the (B, R, V) logits (`hf_rlhf.models.lm_head`). None: for each model
            with a vocabulary over 4,096 whose head splits off (checked once), else its full logits (with a warning
            naming a model that does not split); True: an error instead; False: the full logits. The full logits
            anyway with FSDP / DeepSpeed ZeRO-3 and a ptx batch.
        logprobs_from_generation: the rollout's old log-probs, and a value head's values, are read off the decoding
            forwards (`hf_rlhf.generation.DecodeCapture`: each step's logits at `temperature`, the LM head's input for
            the value head), so the rollout runs no policy forward (TRL 1.12's PPO reads its old log-probs off
            `generate`'s logits too). They equal the forward's to float rounding: the first such rollout runs the
            forward as well and compares (on a larger difference the capture is turned off, with a warning). None
            (default): on where it applies: the `generate` or `lean` engine, one turn (no tools, no `rollout_func`),
            no `filter_groups`, no ZeRO-3 (its sharded value head is outside generation), and a value head on the
            policy or no value function (a separate value model or a value adapter needs its own forward anyway);
            else off with a log line. True: required (an error where it cannot be); False: off. Nothing to do where
            the loss gives the old log-probs (`old_logprobs_in_loss`: one optimizer step per rollout, critic-free).
        group_by_length: rows of similar length are computed together, with less padding: the rollout's generation
            and forward chunks (`local_rollout_forward_batch_size` rows) take the rows sorted by prompt length, each
            chunk cut to its own width, and each optimizer step's micro-batches are re-cut by length (the step holds
            the same rows, so its token-mean loss and gradient are the same to float rounding;
            `hf_rlhf.rollout.loader.group_steps_by_length`). None (default): on, except the micro-batch cut with
            `loss_type="bnpo"`, whose token mean per micro-batch depends on the cut (grouping by length would weigh
            the tokens of short responses more); True: on (an error with bnpo); False: off (rows in their random
            order, chunks and micro-batches padded to their longest row). `train_sampling_strategy` (the Trainer's
            prompt sampler) does not apply: prompts are drawn in a seeded random order.
        stop_token: "eos" (default) or None; stop_token_id: an explicit stop token (wins over stop_token). The
            response ends after the first stop token; tokens after it are padding.
        missing_eos_penalty: subtracted from the score of a response that never produced the stop token.
        ds3_gather_for_generation: gather ZeRO-3 weights for generation (TRL's name).
    Rewards:
        reward_normalization: `none`, `running` (running mean/std over all rollouts, saved in checkpoints) or
            `model_stats` (`reward_mean` / `reward_std` stored in the reward model's config by `RewardTrainer`
            with `store_reward_stats=True`). reward_clip: clip normalised scores to [-c, c].
        Order: normalise, clip, then subtract `missing_eos_penalty`.
    KL:
        kl_coef: β (the initial value when adaptive). 0 with no `kl_target`: no reference is built or run and the
            KL is not logged (`uses_reference`; TRL's GRPO default, beta=0). kl_estimator: k1, k2 or k3
            (`hf_rlhf.rl.kl.kl_penalty`).
        kl_clamp: bound of each token's k3 estimate (default 10, as OpenRLHF and verl; None: unclamped).
        kl_target: None for a fixed β; else the target KL (per sequence, summed over tokens) of the adaptive
            controller (Ziegler et al. 2019), with `kl_horizon`.
    PPO:
        gamma, lam: GAE. cliprange, cliprange_value: PPO clipping. vf_coef, entropy_coef: loss weights.
        whiten_advantages (TRL always whitens), whiten_rewards (TRL's option, scale only): gae only.
        value_learning_rate: learning rate of the value head / value model (None: `learning_rate`).
        ptx_coef: weight of the language-modelling loss on the `ptx_dataset` given to the trainer (InstructGPT's
            PPO-ptx); 0 turns it off.
        disable_dropout: turn dropout off in the policy (and value model): PPO's first ratio is then exactly 1.
    Advantage estimators (`hf_rlhf.rl.critic_free`):
        advantage_estimator: `gae` (PPO with a value function: the default), or a critic-free one, which builds and
            steps no value head, value model or value adapter: `grpo` (group-normalised scores, Shao et al. 2024),
            `rloo` (leave-one-out baseline, Ahmadian et al. 2024), `reinforce_pp` (REINFORCE++: KL-penalised returns
            whitened over the global batch, Hu 2025) or `reinforce_pp_baseline` (its group-mean baseline variant).
        num_generations: G, completions sampled per prompt (>= 2 for grpo, rloo and reinforce_pp_baseline). None
            (default): TRL's 8 for those group estimators, 1 for the others, so `--advantage_estimator grpo` alone
            runs.
        scale_rewards: grpo: divide by the std of the `group` (GRPO), of the `batch`, or `none` (Dr. GRPO) (TRL).
        normalize_advantages: rloo: whiten the advantages over the global batch (TRL's RLOO option).
        kl_in_loss: the KL term goes into the loss, β·KL per token with `kl_estimator` (GRPO's: k3), instead of the
            reward; β is still the controller's (fixed or adaptive). With it off, critic-free estimators subtract
            β·Σ_t KL_t from each score before the baseline (as TRL's RLOO), reinforce_pp per token.
        use_bias_correction_kl: with kl_in_loss, each token's KL is multiplied by the importance ratio (TRL GRPO's
            option, on by default in `GRPOConfig`; the ratio is 1 in value on the first pass but carries a gradient).
        loss_type: how the policy loss is reduced (TRL's GRPO names): `dapo` (token mean over the optimizer step's
            minibatch: the default, PPO's), `bnpo` (token mean per micro-batch), `grpo` (mean over sequences of
            each sequence's token mean) or `dr_grpo` (token sum / (sequences x response_length)).
    GRPO options (TRL 1.16's `GRPOConfig` names; every estimator accepts them):
        epsilon_high: upper clip, ratio <= 1 + epsilon_high (DAPO's clip-higher, 0.28 there); the lower clip is
            `cliprange` (TRL's `epsilon`, which is not taken as a second name: one option per meaning;
            `epsilon=` is an error that names `cliprange`).
        importance_sampling_level: `token` (PPO's ratio), `sequence` (GSPO: exp of the response's mean log-ratio)
            or `sequence_sum` (TRL's RLOOTrainer: exp of the summed log-ratio).
            With `sequence`, `loss_type="grpo"` is GSPO's own reduction (TRL warns about the others; so does
            `PPOTrainer`).
        mask_truncated_completions: responses without the stop token count in the group baselines but not in the
            loss (DAPO's overlong filtering; needs a stop token).
        filter_groups: DAPO's dynamic sampling (veRL's `algorithm.filter_groups`; TRL has none): prompt groups whose
            rewards (raw score and missing-stop penalty) are all equal have zero advantage; they are dropped and
            the rollout refilled with groups of further prompts, drawn by a seeded generator per (epoch, rollout,
            round, rank), so resume needs no extra state; at most `max_num_gen_batches` generation rounds, after
            which the rollout is completed with dropped groups. `filter/dropped_groups`, `filter/gen_batches` logged.

    Checkpoints may be taken at any step, also in the middle of a rollout's optimizer steps: the rollout being
    trained on is written into the checkpoint per rank (`ppo_experience_rank{r}.pt`) and read back on resume, so
    no rollout is regenerated. `PPOTrainer` forces `ignore_data_skip=True`: the experience loader fast-forwards its
    own prompts on resume.
    """

    learning_rate: float = field(default=3e-6, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X updates steps."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. None: on for CUDA with bf16, off on CPU."}
    )
    # batches
    num_mini_batches: int = field(default=1, metadata={"help": "Optimizer steps per pass over a rollout."})
    rollout_batch_size: int | None = field(
        default=None, metadata={"help": "Prompts per rollout per device. None: micro-batch x GA x num_mini_batches."}
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout."})
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Rows per no-grad forward (generation, log-probs, values, rewards)."}
    )
    # prompts
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for prompt tokenization."})
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Longest tokenized prompt. None: the model's positions minus response_length."})
    prompt_overlong_policy: str = field(
        default="error", metadata={"help": "Prompts longer than max_prompt_length: error, truncate (keep the end) "
                                           "or drop.", "choices": list(PROMPT_OVERLONG_POLICIES)},
    )
    # generation
    response_length: int = field(default=53, metadata={"help": "Max new tokens per response."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (also applied to log-probs)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 turns it off."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling; 1.0 turns it off."})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra keyword arguments of generate (a dict, or JSON on the command line)."}
    )
    generation_backend: str = field(
        default="generate",
        metadata={"help": "Rollout generation engine: generate (transformers' generate, dynamic KV cache), static "
                          "(static KV cache, decoding forward compiled, prompts bucketed) or lean (a minimal "
                          "decode loop with a DynamicCache, generate's tokens).",
                  "choices": list(GENERATION_BACKENDS)},
    )
    prefix_sharing: bool | None = field(
        default=None, metadata={"help": "Run the completions of one prompt in one row, the prompt computed once. "
                                        "None: on for num_generations > 1 where the model takes a 4D mask."},
    )
    chunked_lm_head: bool | None = field(
        default=None, metadata={"help": "Log-probs from the LM head in chunks of tokens, not the full logits. None: "
                                        "where the vocabulary is over 4,096 and the head splits off; True: or an "
                                        "error; False: the full logits."}
    )
    logprobs_from_generation: bool | None = field(
        default=None, metadata={"help": "Read the old log-probs (and a value head's values) off the decoding instead "
                                        "of a policy forward. None: on where it applies."},
    )
    group_by_length: bool | None = field(
        default=None, metadata={"help": "Compute rows of similar length together (rollout chunks sorted by prompt "
                                        "length, each step's micro-batches re-cut by length). None: on, except the "
                                        "micro-batch cut with loss_type bnpo."},
    )
    stop_token: str | None = field(
        default="eos", metadata={"help": "'eos' to end responses at the eos token, or None (run to response_length)."}
    )
    stop_token_id: int | None = field(default=None, metadata={"help": "Token id that ends a response."})
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the score of responses without the stop token."}
    )
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "Gather ZeRO-3 weights to generate."})
    # rewards
    reward_normalization: str = field(
        default="none", metadata={"help": "none, running, or model_stats (reward_mean/std of the reward model).",
                                  "choices": list(REWARD_NORMALIZATIONS)},
    )
    reward_clip: float | None = field(default=None, metadata={"help": "Clip normalised scores to [-c, c]."})
    # KL
    kl_coef: float = field(default=0.05, metadata={"help": "KL coefficient (initial value when adaptive)."})
    kl_estimator: str = field(
        default="k1", metadata={"help": "Per-token KL estimator.", "choices": list(KL_ESTIMATORS)}
    )
    kl_clamp: float | None = field(default=10.0, metadata={"help": "Bound of each token's k3 KL estimate "
                                                                   "(as OpenRLHF); None: unclamped."})
    kl_target: float | None = field(default=None, metadata={"help": "Target KL of the adaptive controller; "
                                                                    "None: fixed kl_coef."})
    kl_horizon: float = field(default=10000, metadata={"help": "Horizon of the adaptive KL controller."})
    # PPO
    gamma: float = field(default=1.0, metadata={"help": "GAE discount."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip range."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss weight."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus weight."})
    whiten_advantages: bool = field(default=True, metadata={"help": "Whiten advantages per rollout."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Scale per-token rewards per rollout."})
    value_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the value parameters (None: learning_rate)."}
    )
    ptx_coef: float = field(default=0.0, metadata={"help": "Weight of the LM loss on the ptx_dataset."})
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the policy/value."})
    # advantage estimators
    advantage_estimator: str = field(
        default="gae", metadata={"help": "gae (PPO with a value function), grpo, rloo, reinforce_pp or "
                                         "reinforce_pp_baseline (critic-free: no value function).",
                                 "choices": list(ADVANTAGE_ESTIMATORS)},
    )
    num_generations: int | None = field(default=None, metadata={
        "help": "Completions sampled per prompt. None: 8 (TRL's) for grpo, rloo and reinforce_pp_baseline, else 1."})
    scale_rewards: str = field(
        default="group", metadata={"help": "grpo: std of the group, batch, or none (Dr. GRPO).",
                                   "choices": list(SCALE_REWARDS)},
    )
    normalize_advantages: bool = field(default=False, metadata={"help": "rloo: whiten advantages over the batch."})
    kl_in_loss: bool = field(default=False, metadata={"help": "KL as a loss term (GRPO) instead of a reward "
                                                              "penalty."})
    loss_type: str = field(
        default="dapo", metadata={"help": "Policy loss reduction: dapo, bnpo, grpo or dr_grpo (TRL's names).",
                                  "choices": list(LOSS_TYPES)},
    )
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip of the policy ratio, 1 + epsilon_high (DAPO's clip-higher, TRL's "
                                        "name; DAPO uses 0.28). None: the same as the lower one, cliprange."},
    )
    importance_sampling_level: str = field(
        default="token", metadata={"help": "Policy ratio per `token`, or per `sequence` (GSPO: the exp of the mean "
                                           "log-ratio over the response) (TRL's name).",
                                   "choices": list(IMPORTANCE_SAMPLING_LEVELS)},
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Leave responses that did not stop within response_length out of the loss "
                                         "(DAPO's overlong filtering, TRL's name)."},
    )
    filter_groups: bool = field(
        default=False, metadata={"help": "Dynamic sampling (DAPO; veRL's algorithm.filter_groups): drop prompt groups "
                                         "whose rewards are all equal and refill the rollout from more prompts."},
    )
    max_num_gen_batches: int = field(
        default=10, metadata={"help": "filter_groups: most generation rounds per rollout (veRL's name); a rollout "
                                      "still short after them is completed with dropped groups."},
    )
    use_bias_correction_kl: bool = field(
        default=False, metadata={"help": "kl_in_loss: weight each token's KL by the importance ratio (with its "
                                         "gradient), as TRL's GRPO (its default there; GRPOConfig's here)."},
    )
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "With tools: most rounds of tool calls per rollout (TRL's name); None: no "
                                        "limit but response_length, which bounds the whole multi-turn response."},
    )
    tool_call_timeout: float | None = field(
        default=30.0, metadata={"help": "With tools: seconds the tool calls of one turn may take together; a call "
                                        "still running then is answered with a timeout error. None: no limit."},
    )
    tool_max_workers: int = field(
        default=8, metadata={"help": "With tools: threads that run a turn's tool calls concurrently."},
    )

    def __post_init__(self):
        check_field_types(self)
        self._resolve_device_defaults()
        super().__post_init__()
        if isinstance(self.stop_token, str) and self.stop_token.lower() == "none":  # from the command line
            self.stop_token = None
        if isinstance(self.generation_kwargs, str):
            self.generation_kwargs = json.loads(self.generation_kwargs)
        if self.num_generations is None:
            self.num_generations = TRL_NUM_GENERATIONS if self.advantage_estimator in GROUP_ESTIMATORS else 1
        self._check_batches()
        self._check_options()
        self._check_policy_loss_options()
        self._resolve_eval_options()
        if self.generation_backend == "lean":  # options it does not implement are refused now, not ignored
            check_lean_options(self.generation_kwargs)

    @property
    def critic_free(self) -> bool:
        """True when no value function is trained (every estimator but gae)."""
        return self.advantage_estimator in CRITIC_FREE

    @property
    def prompts_per_rollout(self) -> int:
        """Prompts per rollout per device (each sampled `num_generations` times)."""
        return self.rollout_batch_size // self.num_generations

    @property
    def micro_batches_by_length(self) -> bool:
        """Whether each optimizer step's micro-batches are re-cut by length (`group_by_length`; not with bnpo)."""
        return self.group_by_length is not False and self.loss_type != "bnpo"

    @property
    def uses_reference(self) -> bool:
        """False when β is fixed at 0: the KL is then in no reward and no loss, so no reference is built (no frozen
        copy, no adapters-off forward) and the KL is not logged, as TRL's GRPO with `beta=0`. Set a small `kl_coef`
        (or a `kl_target`) to train against, and monitor, a reference."""
        return self.kl_target is not None or self.kl_coef != 0

    @property
    def old_logprobs_in_loss(self) -> bool:
        """True when the rollout makes no policy forward: the loss's own log-probs, detached, are the old ones (TRL's
        GRPO does the same when each generation gets one optimizer step), and the KL / entropy statistics come from
        that forward too.

        Exact when: each rollout gets one optimizer step (one minibatch, one epoch: the loss sees the rollout's
        weights), no value function is trained (GAE needs the rollout's values), dropout is off (rollout and loss
        then compute alike), the KL does not enter the rewards (`kl_in_loss`, or β = 0) and β is fixed (the adaptive
        controller reads the rollout's KL before that step), and no sampler correction asks for the rollout-time
        trainer log-probs beside the sampler's (as TRL computes them with its vLLM correction).
        """
        return (self.critic_free and self.steps_per_rollout == 1 and self.disable_dropout
                and self.kl_target is None and (self.kl_in_loss or self.kl_coef == 0) and not self.sampling_correction)

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps made from one rollout."""
        return self.num_mini_batches * self.num_ppo_epochs

    def _check_batches(self):
        for name in ("num_mini_batches", "num_ppo_epochs", "response_length", "local_rollout_forward_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"PPOConfig.{name} must be >= 1, got {getattr(self, name)}.")
        minibatch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.rollout_batch_size is None:
            self.rollout_batch_size = minibatch * self.num_mini_batches
            return self._check_generations()
        if self.rollout_batch_size < 1 or self.rollout_batch_size % minibatch:
            raise ValueError(
                f"PPOConfig.rollout_batch_size={self.rollout_batch_size} must be a positive multiple of "
                f"per_device_train_batch_size x gradient_accumulation_steps = {self.per_device_train_batch_size} x "
                f"{self.gradient_accumulation_steps} = {minibatch}, so that every optimizer step takes whole "
                "micro-batches of one rollout.")
        derived = self.rollout_batch_size // minibatch
        self._check_generations()
        if self.num_mini_batches not in (1, derived):
            raise ValueError(
                f"PPOConfig: rollout_batch_size={self.rollout_batch_size} gives {derived} mini-batches of {minibatch} "
                f"but num_mini_batches={self.num_mini_batches}; set only one of them.")
        self.num_mini_batches = derived

    def _check_generations(self):
        if self.num_generations < 1 or self.rollout_batch_size % self.num_generations:
            raise ValueError(f"PPOConfig.rollout_batch_size={self.rollout_batch_size} (completions per rollout) must "
                             f"be a multiple of num_generations={self.num_generations} (completions per prompt).")
        if self.advantage_estimator in GROUP_ESTIMATORS and self.num_generations < 2:
            raise ValueError(f"PPOConfig: advantage_estimator={self.advantage_estimator!r} needs num_generations >= 2 "
                             f"(its baseline comes from the prompt's other samples), got {self.num_generations}.")

    def _check_options(self):
        returned = (self.generation_kwargs or {}).get("num_return_sequences", 1)
        checks = [
            (self.temperature > 0, f"temperature must be > 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 turns it off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.stop_token in ("eos", None), f"stop_token must be 'eos' or None, got {self.stop_token!r}"),
            (self.kl_estimator in KL_ESTIMATORS, f"kl_estimator must be one of {KL_ESTIMATORS}, "
                                                 f"got {self.kl_estimator!r}"),
            (self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}"),
            (self.kl_clamp is None or self.kl_clamp > 0, f"kl_clamp must be > 0 or None, got {self.kl_clamp}"),
            (self.kl_target is None or self.kl_target > 0, f"kl_target must be > 0 or None, got {self.kl_target}"),
            (self.kl_horizon > 0, f"kl_horizon must be > 0, got {self.kl_horizon}"),
            (0 <= self.gamma <= 1 and 0 <= self.lam <= 1, f"gamma and lam must be in [0, 1], got {self.gamma}, "
                                                          f"{self.lam}"),
            (self.cliprange > 0 and self.cliprange_value > 0, "cliprange and cliprange_value must be > 0"),
            (self.reward_normalization in REWARD_NORMALIZATIONS,
             f"reward_normalization must be one of {REWARD_NORMALIZATIONS}, got {self.reward_normalization!r}"),
            (self.reward_clip is None or self.reward_clip > 0, f"reward_clip must be > 0 or None, "
                                                               f"got {self.reward_clip}"),
            (self.prompt_overlong_policy in PROMPT_OVERLONG_POLICIES,
             f"prompt_overlong_policy must be one of {PROMPT_OVERLONG_POLICIES}, got {self.prompt_overlong_policy!r}"),
            (self.max_prompt_length is None or self.max_prompt_length >= 1, "max_prompt_length must be >= 1 or None"),
            (0 <= self.max_unk_share <= 1, f"max_unk_share must be in [0, 1], got {self.max_unk_share}"),
            (self.ptx_coef >= 0 and self.vf_coef >= 0 and self.entropy_coef >= 0,
             "ptx_coef, vf_coef and entropy_coef must be >= 0"),
            (self.value_learning_rate is None or self.value_learning_rate >= 0, "value_learning_rate must be >= 0"),
            (self.advantage_estimator in ADVANTAGE_ESTIMATORS,
             f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {self.advantage_estimator!r}"),
            (self.scale_rewards in SCALE_REWARDS, f"scale_rewards must be one of {SCALE_REWARDS}, "
                                                  f"got {self.scale_rewards!r}"),
            (self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}"),
            (self.epsilon_high is None or self.epsilon_high > 0, f"epsilon_high must be > 0 or None, "
                                                                 f"got {self.epsilon_high}"),
            (self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, f"importance_sampling_level must be one "
             f"of {IMPORTANCE_SAMPLING_LEVELS}, got {self.importance_sampling_level!r}"),
            (not self.filter_groups or self.advantage_estimator in GROUP_ESTIMATORS,
             f"filter_groups drops prompt groups whose rewards are all equal: it needs a group estimator "
             f"{GROUP_ESTIMATORS}, got advantage_estimator={self.advantage_estimator!r}"),
            (self.max_num_gen_batches >= 1, f"max_num_gen_batches must be >= 1, got {self.max_num_gen_batches}"),
            (not (self.group_by_length and self.loss_type == "bnpo"),
             "group_by_length=True re-cuts each step's micro-batches by length, and loss_type='bnpo' takes a token "
             "mean per micro-batch: the cut would weigh the tokens of short responses more. Use loss_type='dapo' "
             "(the step's token mean) or group_by_length=None / False"),
            (self.train_sampling_strategy == "random",
             f"train_sampling_strategy={self.train_sampling_strategy!r} is the Trainer's sampler, which PPOTrainer "
             "does not use: prompts are drawn in a seeded random order (seed / data_seed); group_by_length groups "
             "the rollout's rows by length"),
            (self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
             f"max_tool_calling_iterations must be >= 0 or None, got {self.max_tool_calling_iterations}"),
            (self.tool_call_timeout is None or self.tool_call_timeout > 0,
             f"tool_call_timeout must be > 0 or None, got {self.tool_call_timeout}"),
            (self.tool_max_workers >= 1, f"tool_max_workers must be >= 1, got {self.tool_max_workers}"),
            (not (self.kl_in_loss and self.advantage_estimator == "gae"),
             "kl_in_loss is for the critic-free estimators; gae's KL is a reward penalty (its value function "
             "learns the penalised return)"),
            (self.advantage_estimator != "reinforce_pp_baseline" or self.gamma == 1.0,
             f"reinforce_pp_baseline needs gamma = 1 (as OpenRLHF forces it), got {self.gamma}"),
            (returned == 1, "generation_kwargs num_return_sequences must be 1: each rollout row is one completion "
                            f"(set num_generations for several per prompt), got {returned}"),
            (not (self.critic_free and self.value_learning_rate is not None),
             f"value_learning_rate has no value function to act on with advantage_estimator="
             f"{self.advantage_estimator!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"PPOConfig: {message}.")
