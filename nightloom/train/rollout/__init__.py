"""Reinforcement learning with verifiable rewards: native rollouts over nightloom's own model (`generate`: batched
sampling with a KV cache), reward functions (`rewards`) and the GRPO loss as pure torch functions (`grpo`)."""
