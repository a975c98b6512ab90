"""Training pieces that are not user-facing callbacks: atomic checkpoints, the non-finite guard, and the
stateful callbacks that carry PPO's KL controller and reward statistics through checkpoints."""
