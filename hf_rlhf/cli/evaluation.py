"""Held-out evaluation of a policy (greedy completions scored by the run's reward) and the summary of its logged KL."""

from __future__ import annotations

from collections.abc import Callable

KL_BAND = 0.25  # the adaptive KL controller's acceptance band: target ± 25 %


def evaluate_completions(model, tokenizer, rows, reward: Callable, max_new_tokens: int, batch_size: int,
                         check: Callable | None = None, tools: list | None = None,
                         max_tool_calling_iterations: int | None = None) -> dict:
    """Greedy completions of the held-out `rows`, scored by `reward` (and `check`).

    Args:
        rows: a `datasets.Dataset` with "prompt"; its other columns (but "input_ids") go to `reward` by name.
        reward: `(prompts, completions, **columns) -> (N,) tensor` (a PPO trainer's `reward_source`).
        check: optional `(prompts, completions, rows) -> dict` of extra metrics.
        tools: the run's tools: the completions are then multi-turn (the rollout's turn loop, greedy; message lists,
            as the reward sees them in training) and `max_new_tokens` bounds the whole multi-turn response.

    Returns:
        {"score": mean score, **check's metrics}; without `check`, when every score is 0 or 1 (a verifiable
        reward), also "exact_match": the share of completions that scored 1; with `tools`, also
        "tool_calls_per_completion" and "tool_error_rate" (the share of calls answered with an error).
    """
    from ..generation import generate_completions
    from ..rollout.multiturn import greedy_tool_completions

    prompts = list(rows["prompt"])
    tool_stats = {}
    if tools:
        sample = greedy_tool_completions(model, tokenizer, prompts, tools, max_new_tokens,
                                         max_tool_calling_iterations, batch_size)
        completions, tool_stats = sample.completions, sample.summary()
    else:
        completions = generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size)
    columns = {name: list(rows[name]) for name in rows.column_names if name not in ("prompt", "input_ids")}
    scores = reward(prompts, completions, **columns).float()
    out = {"score": float(scores.mean())}
    if check is not None:
        out.update(check(prompts, completions, rows))
    elif bool(((scores == 0) | (scores == 1)).all()):
        out["exact_match"] = float((scores == 1).float().mean())
    return {**out, **tool_stats}


def kl_summary(log_history: list[dict], target: float | None) -> dict:
    """The logged KL: final value, mean over the second half of the steps, and (adaptive) the share in target ± 25 %."""
    logged = [(h["step"], h["objective/kl"]) for h in log_history if "objective/kl" in h]
    if not logged:
        return {}
    last_step = logged[-1][0]
    second = [kl for step, kl in logged if step > last_step / 2] or [logged[-1][1]]
    coefs = [h["objective/kl_coef"] for h in log_history if "objective/kl_coef" in h]
    out = {"final": logged[-1][1], "mean_second_half": sum(second) / len(second), "target": target,
           "coef_final": coefs[-1] if coefs else None, "logged_steps_second_half": len(second)}
    if target is not None:
        inside = [abs(kl / target - 1) <= KL_BAND for kl in second]
        out["within_25pct_second_half"] = sum(inside) / len(inside)
        out["mean_second_half_within_25pct"] = abs(out["mean_second_half"] / target - 1) <= KL_BAND
    return out
