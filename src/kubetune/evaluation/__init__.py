"""Evaluation with EleutherAI's lm-evaluation-harness on a kubetune model (``harness``): its task registry and
task YAML, its scoring, kubetune's model loading and processes."""
