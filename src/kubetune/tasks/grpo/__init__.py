"""GRPO: online RL (Group Relative Policy Optimization) of a causal LM: completions sampled per prompt,
scored by reward functions, and the policy moved toward the completions that beat their group
(work in progress: the loss, ``loss.py``; the task is not registered yet)."""
