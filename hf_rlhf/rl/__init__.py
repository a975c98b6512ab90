"""The math of online RL, torch only: KL estimators and controllers (`kl`), per-token rewards and GAE
(`advantages`), the critic-free estimators (`critic_free`: GRPO, RLOO, REINFORCE++), the estimator switch
(`estimators`) and running reward moments (`running_moments`)."""
