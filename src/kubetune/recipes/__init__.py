"""The tasks' pieces for the shared trainer (kubetune.training.trainer): sequence classification
(``classify``), causal-LM fine-tuning (``causal_lm``), and what they share (``common``)."""
