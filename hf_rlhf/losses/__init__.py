"""Every loss as torch-only functions: `sft` (DFT), `reward` (pairwise), `dpo` (the DPO family, SimPO, ORPO),
`kto` (KTO, unpaired APO-zero, the KL reference point), `ppo` (clipped policy and value losses, importance weights)."""
