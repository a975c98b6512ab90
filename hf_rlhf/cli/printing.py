"""What a recipe prints when it finishes: the figures before and after, where the model, results and plots went."""

from __future__ import annotations

import os


def print_outputs(stage: str, output_dir: str, results: dict) -> None:
    def fmt(d):
        return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()) or "-"

    print(f"\n[hf_rlhf] {stage} finished")
    print(f"  before: {fmt(results.get('before', {}))}")
    print(f"  after:  {fmt(results.get('after', {}))}")
    print(f"  model and tokenizer: {os.path.abspath(output_dir)}")
    print(f"  results:             {os.path.join(os.path.abspath(output_dir), 'results.json')}")
    for name, path in results.get("plots", {}).items():
        print(f"  plot ({name}): {path}")


def print_kl(kl: dict, timings: dict) -> None:
    """Print `kl_summary`'s figures and the run's timings."""
    if kl:
        target = f", target {kl['target']:.3g}" if kl.get("target") else " (fixed coefficient)"
        share = (f", {kl['within_25pct_second_half']:.0%} of logged steps within ±25 %"
                 if "within_25pct_second_half" in kl else "")
        print(f"  KL: final {kl['final']:.3f}, mean over the 2nd half {kl['mean_second_half']:.3f}{target}{share}; "
              f"β final {kl['coef_final']:.4g}")
    if timings:
        print("  seconds: " + ", ".join(f"{name.removesuffix('_s')} {value:.0f}" for name, value in timings.items()))


def print_chain_summary(results: dict, output_dir: str, sft_path: str, reward_path: str | None) -> None:
    """What a newcomer needs after the toy RLHF chain: the stages' seconds, exact match before and after, where
    the policy, the curves and results.json went, and the commands that continue on a real model."""
    def pick(stage):
        return results.get(stage, {})

    out = os.path.abspath(output_dir)
    timings = results.get("timings", {})
    print("\n[hf_rlhf] the RLHF chain on the toy task: SFT policy -> reward model -> PPO")
    stages = [(name, timings[f"{name}_s"]) for name in ("sft", "reward", "ppo", "eval") if f"{name}_s" in timings]
    if stages:
        print("  seconds: " + ", ".join(f"{name} {seconds:.0f}" for name, seconds in stages)
              + ("  (sft / reward: built now; a model found on disk is reused)" if len(stages) < 4 else ""))
    if "exact_match" in pick("before") and "exact_match" in pick("after"):
        before, after = pick("before")["exact_match"], pick("after")["exact_match"]
        print(f"  exact match (held out, greedy): {before:.4f} -> {after:.4f} ({100 * (after - before):+.1f} points)")
    if "score" in pick("before") and "score" in pick("after"):
        print(f"  reward score (held out):        {pick('before')['score']:.3f} -> {pick('after')['score']:.3f}")
    print(f"  SFT policy:      {os.path.abspath(sft_path)}")
    if reward_path:
        print(f"  reward model:    {os.path.abspath(reward_path)}")
    print(f"  PPO policy:      {out}")
    if results.get("plots", {}).get("curves"):
        print(f"  curves (PNG):    {os.path.abspath(results['plots']['curves'])}")
    print(f"  results:         {os.path.join(out, 'results.json')}")
    print("  next, the same chain on a real model (a GPU; the configs are in recipes/configs/):")
    for line in NEXT_ON_A_REAL_MODEL:
        print(f"    {line}")


# the chain on a real model, after the toy one (printed by `hf-rlhf chain`, listed in the README)
NEXT_ON_A_REAL_MODEL = (
    "hf-rlhf sft --config recipes/configs/sft_qwen_lora.yaml",
    "hf-rlhf merge --adapter outputs/sft-qwen2.5-0.5b-lora --output outputs/sft-qwen2.5-0.5b",
    "hf-rlhf reward --config recipes/configs/reward_qwen_lora.yaml --model_name_or_path outputs/sft-qwen2.5-0.5b",
    "hf-rlhf merge --adapter outputs/reward-qwen2.5-0.5b-lora --output outputs/reward-qwen2.5-0.5b --task seq_cls",
    "hf-rlhf ppo --model_name_or_path outputs/sft-qwen2.5-0.5b --reward_model_path outputs/reward-qwen2.5-0.5b "
    "--dataset_name trl-lib/ultrafeedback-prompt --output_dir outputs/ppo-qwen2.5-0.5b",
)
