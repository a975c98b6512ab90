"""Every loss as torch-only functions: `sft` (DFT), `reward` (pairwise), `dpo` (the DPO family, SimPO, ORPO),
`ppo` (clipped policy and value losses, importance weights)."""
