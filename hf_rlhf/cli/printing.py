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
