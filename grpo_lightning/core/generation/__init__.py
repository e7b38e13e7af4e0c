"""Rollout generation: the engines that sample completions, and per-token log-probs."""
