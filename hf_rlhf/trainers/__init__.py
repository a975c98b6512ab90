"""The trainers and their configs: one `<method>_config.py` beside one `<method>_trainer.py` (sft, reward, dpo, kto,
ppo, grpo), what they share (`base_trainer`, `base_config`, `model_config`, `config_checks`, `option_ranges`) and the
on-device metric accumulators (`metrics`, `grpo_metrics`). The public names are exported lazily by `hf_rlhf`."""
