"""Verifiable reward functions for train.task grpo, without torch: the built-ins (`builtins`) and resolving a
spec's functions by name with their signatures checked (`resolve`), so `nightloom validate` refuses a function
that cannot be used before any node is rented. Scoring a batch is nightloom/train/rollout/rewards.py."""
