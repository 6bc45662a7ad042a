"""Training: the trainer and its seams.

``trainer`` (Trainer: train() / train_step() / evaluate() / save_checkpoint(); Task; Prepared),
``state`` (TrainState), ``strategy`` (Strategy protocol; DDPStrategy), ``loggers`` (metric
logger fan-out: JSONL history, TensorBoard).
"""
