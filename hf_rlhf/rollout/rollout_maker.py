"""`RolloutMaker`: prompts in, `Experience` out (generate, score, reference, KL-shaped rewards, advantages).

The steps follow Ziegler et al. 2019 / Stiennon et al. 2020 as `trl.PPOTrainer` implements them; the math is
the pure functions of `hf_rlhf.rl`, `hf_rlhf.losses` and `hf_rlhf.tensors`, so this file only orders the calls and
moves tensors.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from trl.models.utils import unwrap_model_for_generation

from ..collators import LeftPaddingCollator
from ..generation import GenerationOutput, build_engine
from ..losses.grpo import sampling_importance_ratio, sampling_mismatch_sums
from ..models.adapters import adapter_scope, unwrap_peft
from ..models.policy_value import response_scores
from ..rewards.base import RewardError, check_scores
from ..rl.critic_free import informative_groups, truncated_loss_mask
from ..rl.estimators import estimate_advantages
from ..rl.kl import kl_penalty, sequence_policy_stats
from ..tensors import (
    first_true_indices,
    left_padding,
    length_sorted_chunks,
    padding_bounds,
    rejoin_chunks,
)
from .experience import Experience
from .multiturn import ToolRollout, rollout_func_sample

logger = logging.getLogger("hf_rlhf")

ROLLOUT_METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                   "objective/scores", "objective/raw_scores")
# what needs the rollout-time policy log-probs: computed by the loss instead when `args.old_logprobs_in_loss`
POLICY_METRICS = ROLLOUT_METRICS[:4]
KL_METRICS = ("objective/kl", "objective/non_score_reward")  # not logged without a reference (β fixed at 0)


def stop_token_id_of(args, tokenizer) -> int | None:
    """`stop_token_id`, else eos when `stop_token == "eos"`, else None (responses run to `response_length`)."""
    if args.stop_token_id is not None:
        return args.stop_token_id
    return tokenizer.eos_token_id if args.stop_token == "eos" else None


class RolloutMaker:
    """Turn a batch of prompt rows into an `Experience` and its (all-reduced) statistics.

    Args:
        args: a `PPOConfig`.
        tokenizer: the policy's tokenizer.
        compute_rewards: `(prompts, completions, **row_fields) -> (B,)` scores, called once per rollout
            (`PPOTrainer.compute_rewards`, which a subclass may override; its result is checked by
            `hf_rlhf.rewards.base.check_scores`).
        accelerator: the Trainer's accelerator (device, gathers across ranks).
        ref_model: a frozen reference model; None when the policy is a `PeftModel` (reference = adapters off).
        reward_stats: {"reward_mean", "reward_std"} for `reward_normalization="model_stats"`.
        tool_rollout: a `ToolRollout` for multi-turn rollouts with tools; None: one turn.
        row_tools: `rows -> (rows, [{name: callable}, ...], extra reward fields)`: the rows of a generation round
            (a prompt may change, e.g. by an environment's `reset` observation, with its `input_ids`), the tools of
            each (one environment instance per row) and fields passed to `compute_rewards` (`environments`);
            required with `tool_rollout`.
        rollout_func: `prompts -> dict`, TRL's `rollout_func` bound to the trainer: replaces steps 1-3 (see
            `hf_rlhf.rollout.multiturn.rollout_func_sample` for what it returns).
        share_prompts: the forwards run the rows of one prompt as one row (`PPOConfig.prefix_sharing`).
        capture_decoding: the old log-probs (and a value head's values) come off the decoding forwards instead of a
            policy forward (`PPOConfig.logprobs_from_generation` as `PPOTrainer` resolved it: an engine that returns
            them, one turn, old log-probs needed at all).
        lm_heads: (the policy's, the reference's) `LMHead` for the log-probs from hidden states in chunks of tokens
            (`PPOConfig.chunked_lm_head`, `hf_rlhf.models.lm_head`); None: from the full logits.
    """

    def __init__(self, args, tokenizer, compute_rewards, accelerator, ref_model=None, reward_stats=None,
                 tool_rollout: ToolRollout | None = None, row_tools=None, rollout_func=None,
                 share_prompts: bool = False, capture_decoding: bool = False, lm_heads=(None, None)):
        self.args, self.tokenizer, self.compute_rewards = args, tokenizer, compute_rewards
        self.accelerator, self.ref_model, self.reward_stats = accelerator, ref_model, reward_stats
        self.collator = LeftPaddingCollator(tokenizer.pad_token_id)
        self.stop_token_id = stop_token_id_of(args, tokenizer)
        self._warned_no_stop = False
        # `PPOConfig.generation_backend`; reads the live policy module, so no `sync_weights` after optimizer steps
        # the shared prefill is one more forward per call: only where generation runs on gathered (or whole) weights,
        # never as a ZeRO-3 collective that ranks with and without repeated prompts would call unevenly
        self.engine = build_engine(args.generation_backend,
                                   share_prompts=share_prompts and args.ds3_gather_for_generation)
        self._engine_checked = False
        self.tool_rollout, self.row_tools, self.rollout_func = tool_rollout, row_tools, rollout_func
        self._tool_counts = [0, 0, 0]  # calls, failures, completions of this rollout (every generation round)
        self.share_prompts = share_prompts  # `PPOConfig.prefix_sharing` as the trainer resolved it
        # `PPOConfig.logprobs_from_generation` as the trainer resolved it (turned off by a failed first check)
        self.capture_decoding = capture_decoding
        self._capture_checked = False
        self.lm_heads = lm_heads
        # NaN (a reward function's None) scores a row as "not scored": out of its group's baseline, advantage 0 (TRL's
        # GRPO; `GRPOTrainer` turns it on for the grpo estimator)
        self.allow_unscored = False

    @torch.no_grad()
    def make(self, model, rows: list[dict], kl_coef: float, reward_moments=None, row_indices=None, refill=None):
        """One rollout.

        Args:
            model: the unwrapped `PolicyAndValue`.
            rows: B prompt rows with `prompt`, `input_ids` and any other columns (passed to the reward).
            kl_coef: β for this rollout's rewards.
            reward_moments: a `RunningMoments` for `reward_normalization="running"` (updated here).
            row_indices: the rows' dataset indices, named in reward errors.
            refill: for `filter_groups`: `round -> (rows, row_indices)`, B more rows (G per prompt) for generation
                round `round` >= 1; None: no refill (groups are not filtered).

        Returns:
            (Experience on the accelerator's device, {metric name: float}, identical on every rank).
        """
        args = self.args
        if args.mask_truncated_completions and self.stop_token_id is None:
            raise ValueError("mask_truncated_completions needs a stop token (stop_token='eos' or stop_token_id): "
                             "without one every response runs to response_length and none would be trained on")
        # steps 1-4. prompts, responses, scores (with `filter_groups`: only groups whose rewards differ, refilled)
        self._tool_counts = [0, 0, 0]
        sample, captured = self._sample(model, rows, row_indices)
        filter_stats = {}
        if args.filter_groups and refill is not None:
            sample, filter_stats = self._filter_groups(model, sample, refill)
        query_ids, query_mask, response_ids, response_mask, context_mask, stopped, raw_scores = sample

        # step 5. old log-probs and values of the policy, log-probs of the reference (eval mode, micro-batches);
        # with one optimizer step per rollout and no KL in the rewards, the loss's own forward gives the old
        # log-probs (`PPOConfig.old_logprobs_in_loss`) and the policy forward here is skipped; with
        # `logprobs_from_generation` they (and a value head's values) come off the decoding, the forward skipped too
        # (run once more on the first such rollout, to check that the two agree)
        model.eval()
        sampling_logprobs = None
        if args.sampling_correction:  # the engine's log-probs are the sampler's; the forward below the trainer's
            sampling_logprobs = self._decoded_scores(model, (captured[0], None), response_mask)[0]
            captured = None
        policy_forward = not args.old_logprobs_in_loss and (captured is None or not self._capture_checked)
        old_logprobs, old_values, ref_logprobs = self._forward(model, query_ids, query_mask, response_ids,
                                                               context_mask, policy=policy_forward)
        if captured is not None:
            decoded = self._decoded_scores(model, captured, response_mask)
            if not self._capture_checked:
                self._check_decoded(decoded, (old_logprobs, old_values), response_mask, model)
            if self.capture_decoding:
                old_logprobs, old_values = decoded
        if self.tool_rollout is not None or self.rollout_func is not None:  # environment tokens: never the policy's
            keep = response_mask.bool()
            old_logprobs, old_values, ref_logprobs = (
                torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))
                for t in (old_logprobs, old_values, ref_logprobs))

        # step 6. per-token KL, score shaping, then the estimator's rewards and advantages (GAE, GRPO, ...)
        if args.old_logprobs_in_loss or not args.uses_reference:  # no KL in the rewards (the loss computes it)
            kl = torch.zeros_like(ref_logprobs)
        else:
            kl = kl_penalty(old_logprobs, ref_logprobs, args.kl_estimator, clamp=args.kl_clamp)
        scores = self._shape_scores(raw_scores, stopped, reward_moments)
        reduce = self._all_reduce_sum if self.accelerator.num_processes > 1 else None
        rewards, advantages, returns = estimate_advantages(args, scores, kl, response_mask, old_values, kl_coef,
                                                           reduce)
        if self.allow_unscored:  # unscored rows: advantage 0 already; nothing else of theirs reaches a loss or a mean
            scores, rewards, returns = (torch.nan_to_num(t, nan=0.0) for t in (scores, rewards, returns))
            raw_scores = torch.nan_to_num(raw_scores, nan=0.0)
        experience = Experience(query_ids, query_mask, response_ids, response_mask, old_logprobs, ref_logprobs,
                                old_values, scores, rewards, advantages, returns, context_mask)
        stats = self._stats(experience, kl, raw_scores, stopped, kl_coef)
        if sampling_logprobs is not None:  # TRL's vllm_importance_sampling_* with this engine as the sampler
            experience.sampling_logprobs = sampling_logprobs
            experience.sampling_ratio = sampling_importance_ratio(
                old_logprobs, sampling_logprobs, response_mask, args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
            stats.update(self._mismatch_stats(old_logprobs, sampling_logprobs, response_mask,
                                              experience.sampling_ratio))
        stats.update(filter_stats)
        if self.tool_rollout is not None:
            stats.update(self._tool_stats())
        # per row, before the truncated ones leave the loss: what a trainer's completion metrics read
        self.last_lengths, self.last_stopped = response_mask.sum(1), stopped
        if args.mask_truncated_completions:  # counted in the baselines above, left out of the loss (as TRL)
            experience.response_mask = truncated_loss_mask(response_mask, stopped)
        return experience, stats

    def _sample(self, model, rows, row_indices):
        """((query_ids, query_mask, response_ids, response_mask, context_mask, stopped, raw_scores), captured) of one
        generation round; `context_mask` differs from `response_mask` (the loss mask) only on the environment's
        tokens of a multi-turn rollout; `captured`: (log-probs (B, R), LM head inputs (B, R, H) or None) off the
        decoding with `capture_decoding` (one turn), else None."""
        device = self.accelerator.device
        if self.tool_rollout is not None:
            rows, tool_sets, extra_fields = self.row_tools(rows)
        # step 1. left-padded prompts (the last column is every row's last prompt token)
        batch = self.collator(rows)
        query_ids, query_mask = batch.pop("input_ids").to(device), batch.pop("attention_mask").to(device)
        batch.pop("position_ids")  # every forward below builds its own from the masks (`sequence_inputs`)
        prompts = batch.pop("prompt")

        captured = None
        if self.rollout_func is not None:  # steps 1-3 are the user's (TRL's rollout_func); the ids are trained as given
            conversational = isinstance(prompts[0], list)
            query_ids, query_mask, turns, extra_fields = rollout_func_sample(
                self.rollout_func(list(prompts)), len(rows), self.tokenizer, self.stop_token_id, conversational, device)
            response_ids, response_mask, stopped = turns.response_ids, turns.loss_mask, turns.stopped
            context_mask, completions = turns.context_mask, turns.completions
            batch.update(extra_fields)
        elif self.tool_rollout is not None:  # steps 2-3 over several turns: generate, call tools, append, repeat
            with self._generator(model.policy) as generate:
                turns = self.tool_rollout.run(lambda *call: generate(*call).response_ids, query_ids, query_mask,
                                              tool_sets)
            batch.update(extra_fields)
            response_ids, response_mask, stopped = turns.response_ids, turns.loss_mask, turns.stopped
            context_mask, completions = turns.context_mask, turns.completions
            self._tool_counts = [self._tool_counts[0] + sum(turns.tool_calls),
                                 self._tool_counts[1] + sum(turns.tool_failures), self._tool_counts[2] + len(rows)]
        else:
            # step 2. sample responses with the KV cache, policy in eval mode (dropout off, as for the old log-probs)
            with self._generator(model.policy) as generate:
                out = generate(query_ids, query_mask, self.args.response_length,
                               capture=self.capture_decoding or self.args.sampling_correction,
                               hidden=self.capture_decoding and model.reads_policy_hidden)
            captured = None if out.logprobs is None else (out.logprobs, out.hidden)

            # step 3. truncate after the first stop token: mask 1 up to and including it, pad after it
            response_ids, response_mask, stopped = self._truncate(out.response_ids)
            context_mask = response_mask
            completions = self._decode(response_ids, response_mask, conversational=isinstance(prompts[0], list))

        # step 4. score the decoded text (each reward source re-tokenizes it its own way)
        raw_scores = self._score(prompts, completions, batch, row_indices).to(device)
        return (query_ids, query_mask, response_ids, response_mask, context_mask, stopped, raw_scores), captured

    def _mismatch_stats(self, old_logprobs, sampling_logprobs, mask, ratio) -> dict[str, float]:
        """TRL's `sampling/*` metrics: each process's mean / extreme, then their mean / extreme over processes."""
        sums = sampling_mismatch_sums(old_logprobs, sampling_logprobs, mask, ratio,
                                      self.args.vllm_importance_sampling_mode)
        names = list(sums)
        values = torch.stack([sums[n].float() for n in names])
        means = self.accelerator.reduce(values.clone(), reduction="mean")
        signs = torch.tensor([-1.0 if n.endswith("/min") else 1.0 for n in names], device=values.device)
        extremes = self.accelerator.reduce(values * signs, reduction="max") * signs  # min as -max(-x)
        return {n: (means[i] if n.endswith("/mean") else extremes[i]).item() for i, n in enumerate(names)}

    def _tool_stats(self) -> dict[str, float]:
        """TRL's `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed / calls), over
        every rank's completions of this rollout."""
        counts = torch.tensor([float(c) for c in self._tool_counts], device=self.accelerator.device)
        calls, failures, completions = self.accelerator.reduce(counts, reduction="sum").tolist()
        return {"tools/call_frequency": calls / max(completions, 1.0),
                "tools/failure_frequency": failures / calls if calls else 0.0}

    def _filter_groups(self, model, sample, refill):
        """DAPO's dynamic sampling: keep groups whose rewards differ; generate more rounds until the rollout is full.

        Every rank runs the same number of rounds (a generation may be collective, e.g. under ZeRO-3): rounds go on
        while any rank is short, up to `max_num_gen_batches`; a rank still short then completes its rollout with
        dropped groups (zero advantage: no gradient). The kept groups come in round order, the first ones first.
        """
        args, G = self.args, self.args.num_generations
        wanted = sample[0].shape[0] // G
        kept, dropped, rounds, dropped_count = [], [], 0, 0
        while True:
            keep = informative_groups(sample[6], G, sample[5] if self._stop_matters() else None)
            rows = keep.repeat_interleave(G)
            kept.append(tuple(t[rows] for t in sample))
            dropped.append(tuple(t[~rows] for t in sample))
            dropped_count += int((~keep).sum())
            rounds += 1
            short = max(wanted - sum(part[0].shape[0] for part in kept) // G, 0)
            any_short = self.accelerator.reduce(torch.tensor(float(short), device=sample[0].device), reduction="sum")
            if any_short.item() == 0 or rounds >= args.max_num_gen_batches:
                break
            sample, _ = self._sample(model, *refill(rounds))
        parts = kept + dropped  # dropped groups only complete a rollout still short after the last round
        query_ids = _cat_left_padded([p[0] for p in parts], self.tokenizer.pad_token_id)
        query_mask = _cat_left_padded([p[1] for p in parts], 0)
        response_ids = _cat_right_padded([p[2] for p in parts], self.tokenizer.pad_token_id)
        response_mask = _cat_right_padded([p[3] for p in parts], 0)
        context_mask = _cat_right_padded([p[4] for p in parts], 0)
        stopped, raw_scores = torch.cat([p[5] for p in parts]), torch.cat([p[6] for p in parts])
        n = wanted * G
        totals = self.accelerator.reduce(torch.tensor([float(dropped_count), float(max(wanted * G - sum(
            p[0].shape[0] for p in kept), 0) // G)], device=stopped.device), reduction="sum")
        stats = {"filter/dropped_groups": totals[0].item(), "filter/refilled_with_dropped": totals[1].item(),
                 "filter/gen_batches": float(rounds)}
        sample = (query_ids[:n], query_mask[:n], response_ids[:n], response_mask[:n], context_mask[:n], stopped[:n],
                  raw_scores[:n])
        width = max(int(sample[4].sum(1).max()), 1)  # the longest kept response: the rest is padding
        return sample[:2] + tuple(t[:, :width] for t in sample[2:5]) + sample[5:], stats

    def _stop_matters(self) -> bool:
        return self.args.missing_eos_penalty is not None and self.stop_token_id is not None

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    # -- steps ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def complete(self, model, rows: list[dict], do_sample: bool = True) -> dict:
        """Steps 1-3 of a rollout for an evaluation: completions of `rows`, sampled as the rollout samples them or
        greedy, nothing else run (no reference, no scores) and no state of the run touched.

        Args:
            model: the unwrapped `PolicyAndValue`.
            rows: B prompt rows with `prompt`, `input_ids` and any other columns.
            do_sample: sample at the training temperature / top-k / top-p; False: greedy decoding.

        Returns:
            {"prompts": B prompts, "completions": B decoded completions, "columns": {name: B values} of the other
            columns, "response_mask": (B, R), "stopped": (B,) bool}.
        """
        batch = self.collator(rows)
        query_ids = batch.pop("input_ids").to(self.accelerator.device)
        query_mask = batch.pop("attention_mask").to(self.accelerator.device)
        batch.pop("position_ids")
        prompts = batch.pop("prompt")
        with self._generator(model.policy, do_sample=do_sample) as generate:
            out = generate(query_ids, query_mask, self.args.response_length)
        response_ids, response_mask, stopped = self._truncate(out.response_ids)
        completions = self._decode(response_ids, response_mask, conversational=isinstance(prompts[0], list))
        return {"prompts": prompts, "completions": completions, "columns": batch, "response_mask": response_mask,
                "stopped": stopped}

    @contextmanager
    def _generator(self, policy, do_sample: bool = True):
        """Yields `generate(ids, mask, max_new_tokens, capture=False, hidden=False) -> GenerationOutput`: (B, N) sampled
        ids, N <= max_new_tokens, padded after early stops (`self.engine`), with `capture` their log-probs and with
        `hidden` the LM head's inputs taken off the decoding (None where the engine cannot), for as many calls (turns)
        as needed inside one unwrapped-policy scope."""
        args, pad = self.args, self.tokenizer.pad_token_id
        checkpointing = {k: v for k, v in (args.activation_checkpointing_kwargs or {}).items()
                         if k not in ("every_n_layers", "offload")}  # re-enabled after generation with these
        # the policy itself, not the wrapper: trl's helper needs a PreTrainedModel / PeftModel (and gathers ZeRO-3)
        gather = args.ds3_gather_for_generation
        with unwrap_model_for_generation(policy, self.accelerator, gather_deepspeed3_params=gather,
                                         gradient_checkpointing_kwargs=checkpointing or None) as unwrapped:
            unwrapped.eval()
            if not self._engine_checked:
                self.engine.check_model(unwrapped)
                self._engine_checked = True

            def generate(query_ids, query_mask, max_new_tokens: int, capture: bool = False,
                         hidden: bool = False) -> GenerationOutput:
                # stop token None: no early stop (a kwarg, unlike a config, overrides)
                kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, pad_token_id=pad, eos_token_id=self.stop_token_id,
                              generation_kwargs=args.generation_kwargs, return_logprobs=capture, return_hidden=hidden)
                chunks, order = [], self._row_chunks(query_mask)
                multiple = getattr(args, "pad_to_multiple_of", None)  # TRL GRPOConfig's, for the generation's shapes
                for rows in order:  # each chunk without the prompt columns that are padding in all its rows
                    start = left_padding(query_mask[rows])
                    if multiple:  # keep (or add) left padding up to a multiple of it
                        query_ids, query_mask = _left_pad_to(query_ids, query_mask, multiple, pad)
                        start = left_padding(query_mask[rows])
                        start -= (-(query_mask.shape[1] - start)) % multiple
                    chunks.append(self.engine.generate(unwrapped, query_ids[rows, start:], query_mask[rows, start:],
                                                       **kwargs))
                width = max(chunk.response_ids.shape[1] for chunk in chunks)

                def joined(name, value):  # (B, N) or (B, N, H), rows in the caller's order
                    parts = [getattr(chunk, name) for chunk in chunks]
                    return None if any(part is None for part in parts) else rejoin_chunks(parts, order, width, value)

                return GenerationOutput(joined("response_ids", pad), joined("logprobs", 0.0), joined("hidden", 0.0))

            yield generate

    def _truncate(self, response_ids):
        """(response_ids with pad after the stop token, response_mask (B, R), stopped (B,) bool)."""
        length = response_ids.shape[1]
        if self.stop_token_id is None:
            stop_at = torch.full_like(response_ids[:, 0], length)
        else:
            stop_at = first_true_indices(response_ids == self.stop_token_id)
        stopped = stop_at < length
        columns = torch.arange(length, device=response_ids.device)
        response_mask = (columns.unsqueeze(0) <= stop_at.unsqueeze(1)).long()
        response_ids = torch.where(response_mask.bool(), response_ids, self.tokenizer.pad_token_id)
        return response_ids, response_mask, stopped

    def _decode(self, response_ids, response_mask, conversational: bool) -> list:
        tokens = [ids[: int(n)].tolist() for ids, n in zip(response_ids, response_mask.sum(1))]
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts

    def _score(self, prompts, completions, row_fields, row_indices) -> torch.Tensor:
        try:
            scores = self.compute_rewards(prompts, completions, **row_fields)
        except RewardError as err:
            if err.row is None or row_indices is None:
                raise
            raise RewardError(f"{err} [dataset row {row_indices[err.row]}]", err.row) from err
        return check_scores(scores, len(completions), "compute_rewards", prompts, completions,
                            allow_none=self.allow_unscored)

    def _forward(self, model, query_ids, query_mask, response_ids, response_mask, policy: bool = True):
        """(old log-probs, old values, reference log-probs), each (B, R); without `policy` the first two are zeros
        (the loss computes the old log-probs; critic-free estimators have no values). `response_mask` is the
        attention over the response side (the context mask: environment tokens included)."""
        args, width = self.args, response_ids.shape[1]
        logprobs, values, ref_logprobs = [], [], []
        order = self._row_chunks(query_mask)
        for rows in order:  # each chunk cut to its own width: (b, r) outputs, padded back to (b, R) below
            q_start, r_end = padding_bounds(query_mask[rows], response_mask[rows])
            part = [query_ids[rows, q_start:], query_mask[rows, q_start:], response_ids[rows, :r_end],
                    response_mask[rows, :r_end]]
            if policy:
                logprob, _, value, _ = response_scores(model, self.lm_heads[0], *part, temperature=args.temperature,
                                                       share_prompts=self.share_prompts)
                logprobs.append(logprob)
                values.append(value if value is not None else torch.zeros_like(logprobs[-1]))  # critic-free
            else:
                logprobs.append(torch.zeros(part[2].shape, device=part[2].device))
                values.append(torch.zeros_like(logprobs[-1]))
            if not args.uses_reference:  # β fixed at 0: no reference forward (its log-probs stay 0, never read)
                ref_logprobs.append(torch.zeros(part[2].shape, device=part[2].device))
                continue
            ref_logprobs.append(self._reference_logprobs(model.policy, part))
        # zeros past each chunk's width (after every row's end), rows in the caller's order
        return tuple(rejoin_chunks(parts, order, width) for parts in (logprobs, values, ref_logprobs))

    def _row_chunks(self, query_mask) -> list[torch.LongTensor]:
        """The rows of a rollout forward or generation call in chunks of `local_rollout_forward_batch_size`: with
        `group_by_length` sorted by prompt length (a prompt's G rows stay together), else in order."""
        size, batch = self.args.local_rollout_forward_batch_size, query_mask.shape[0]
        if self.args.group_by_length is not False and batch > size:
            return length_sorted_chunks(query_mask.sum(1), size)
        return list(torch.arange(batch, device=query_mask.device).split(size))

    def _reference_logprobs(self, policy, part):
        """The reference's log-probs of the response tokens (B, R): the frozen copy, or the policy adapters off."""
        options = dict(temperature=self.args.temperature, share_prompts=self.share_prompts)
        if self.ref_model is not None:
            return response_scores(self.ref_model, self.lm_heads[1], *part, **options)[0]
        if unwrap_peft(policy) is policy:
            raise ValueError("no reference model: pass ref_model, or use a PeftModel policy (reference = adapters off)")
        with adapter_scope(policy, None):  # the LoRA policy's base is the reference; requires_grad restored after
            return response_scores(policy, self.lm_heads[1], *part, **options)[0]

    def _decoded_scores(self, model, captured, response_mask):
        """(old log-probs, old values), each (B, R), from what the decoding captured; zero after a row's end. The
        values: the value head on the LM head's inputs (zeros without a value function, as `_forward`)."""
        logprobs, hidden = captured
        keep = response_mask.bool()
        logprobs = torch.where(keep, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
        if hidden is None:
            return logprobs, torch.zeros_like(logprobs)
        values = model.head_values(hidden)
        return logprobs, torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))

    def _check_decoded(self, decoded, forward, response_mask, model) -> None:
        """Compare the decoding's log-probs / values with the policy forward's on the first rollout that has both.

        They agree to float rounding when the capture reads the right positions and states; a structural mismatch
        (a position off, another hidden state) is off by the size of the values themselves. The test is on the mean
        absolute difference over the response tokens: <= tol + tol x the mean |forward value|, tol 1e-3, or 5e-2
        where the weights are 16-bit or the forward runs under mixed precision (its rounding is the bf16 / fp16
        one, the decoding's may be float32). Beyond it the capture is turned off from here on (a warning names the
        differences; an error with `logprobs_from_generation=True`). Every rank decides on the worst rank's numbers.
        """
        self._capture_checked = True
        keep = response_mask.bool()
        count = keep.sum().clamp(min=1)
        half = (next(model.policy.parameters()).dtype in (torch.float16, torch.bfloat16)
                or self.accelerator.mixed_precision in ("fp16", "bf16"))
        tol = 5e-2 if half else 1e-3
        numbers = []
        for ours, theirs in zip(decoded, forward):
            diff = torch.where(keep, (ours - theirs).abs(), 0.0)
            mean_diff, mean_size = diff.sum() / count, torch.where(keep, theirs.abs(), 0.0).sum() / count
            numbers += [mean_diff, diff.max(), mean_diff - tol - tol * mean_size]
        numbers = self.accelerator.reduce(torch.stack(numbers).float(), reduction="max")
        logprob_mean, logprob_max, logprob_excess, value_mean, value_max, value_excess = numbers.tolist()
        if logprob_excess <= 0 and value_excess <= 0:
            logger.info("logprobs_from_generation: the decoding's log-probs / values match the policy forward's "
                        "(mean |diff| %.2e / %.2e, max %.2e / %.2e); the rollout's policy forward is skipped from "
                        "here on", logprob_mean, value_mean, logprob_max, value_max)
            return
        message = (f"the log-probs / values taken off the decoding differ from the policy forward's by "
                   f"{logprob_mean:.3g} / {value_mean:.3g} on average (max {logprob_max:.3g} / {value_max:.3g}): more "
                   f"than float rounding (tolerance {tol:g} + {tol:g} x the mean value)")
        if self.args.logprobs_from_generation:
            raise ValueError(f"PPOConfig.logprobs_from_generation=True cannot be honoured: {message}")
        logger.warning("logprobs_from_generation off: %s; the rollout runs its policy forward", message)
        self.capture_decoding = False

    def _shape_scores(self, raw_scores, stopped, reward_moments) -> torch.Tensor:
        """Normalise, clip, then subtract the missing-eos penalty (see `PPOConfig`)."""
        args, scores = self.args, raw_scores.float()
        if args.reward_normalization == "running":
            gathered = self.accelerator.gather(scores)  # the same statistics on every rank (unscored rows left out)
            reward_moments.update(gathered[~torch.isnan(gathered)])
            scores = reward_moments.normalize(scores)
        elif args.reward_normalization == "model_stats":
            scores = (scores - self.reward_stats["reward_mean"]) / (self.reward_stats["reward_std"] + 1e-8)
        if args.reward_clip is not None:
            scores = scores.clamp(-args.reward_clip, args.reward_clip)
        if args.missing_eos_penalty is not None and self.stop_token_id is not None:
            scores = torch.where(stopped, scores, scores - args.missing_eos_penalty)
        return scores

    def _stats(self, experience: Experience, kl, raw_scores, stopped, kl_coef) -> dict[str, float]:
        """TRL's rollout metrics, averaged over ranks (`val/num_eos_tokens`: responses that stopped, summed)."""
        mask = experience.response_mask
        per_sequence = sequence_policy_stats(kl, experience.old_logprobs, experience.scores, mask, kl_coef)
        # float64: rewards near the float32 limit (±3e38) overflow a float32 mean to inf/NaN
        means = torch.stack([per_sequence[name].mean() for name in POLICY_METRICS]
                            + [experience.scores.double().mean(), raw_scores.double().mean()])
        means = self.accelerator.reduce(means, reduction="mean")
        num_stopped = self.accelerator.reduce(stopped.sum().float(), reduction="sum")
        stats = dict(zip(ROLLOUT_METRICS, means.tolist()))
        if self.args.old_logprobs_in_loss:  # no rollout-time policy log-probs: the loss logs these
            stats = {name: value for name, value in stats.items() if name not in POLICY_METRICS}
        if not self.args.uses_reference:
            stats = {name: value for name, value in stats.items() if name not in KL_METRICS}
        stats["objective/kl_coef"] = float(kl_coef)  # the same on every rank
        stats["val/num_eos_tokens"] = num_stopped.item()
        if self.stop_token_id is not None and stats["val/num_eos_tokens"] == 0 and not self._warned_no_stop:
            self._warned_no_stop = True
            logger.warning(
                "no response of this rollout produced the stop token %d within response_length=%d tokens "
                "(val/num_eos_tokens = 0); missing_eos_penalty=%s was %s. Raise response_length, check the stop "
                "token, or train the policy to stop (SFT).", self.stop_token_id, self.args.response_length,
                self.args.missing_eos_penalty,
                "applied" if self.args.missing_eos_penalty is not None else "not set, so nothing was subtracted")
        return stats


def _left_pad_to(ids: torch.Tensor, mask: torch.Tensor, multiple: int, pad: int):
    """(B, Q) ids and mask left-padded to a width that is a multiple of `multiple` (unchanged when it is one)."""
    extra = (-ids.shape[1]) % multiple
    if not extra:
        return ids, mask
    return F.pad(ids, (extra, 0), value=pad), F.pad(mask, (extra, 0), value=0)


def _cat_left_padded(parts: list[torch.Tensor], value) -> torch.Tensor:
    """(B_i, L_i) tensors left-padded with `value` to the widest, concatenated: (Σ B_i, max L_i)."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([F.pad(p, (width - p.shape[1], 0), value=value) for p in parts])


def _cat_right_padded(parts: list[torch.Tensor], value) -> torch.Tensor:
    """(B_i, L_i) tensors right-padded with `value` to the widest, concatenated: (Σ B_i, max L_i)."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([F.pad(p, (0, width - p.shape[1]), value=value) for p in parts])
