"""The command line: what the recipes (`recipes/*.py`) share, one module per job.

- `arguments`: argv and `--config file.yaml` into the recipe's dataclasses (trl's `TrlParser`), option checks
- `data_loading`: datasets read and checked before any model loads; PPO's prompts; reward functions by name
- `resume`: `--resume_from_checkpoint` and the whole run's metrics after a resume
- `evaluation`: held-out greedy evaluation and the KL summary
- `results`: results.json, and the exit after a non-finite stop
- `printing`: what a finished run prints
- `errors`: a bad option or input as one `[hf_rlhf] error: ...` line
"""
