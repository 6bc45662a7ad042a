"""Training: the loop and what it plugs into.

``trainer`` (``train()``; ``Trainer``: ``train()``, ``train_step()``, ``evaluate()``,
``save_checkpoint()``), ``state`` (``TrainState``, what a checkpoint restores), ``strategy`` (the
``Strategy`` protocol, ``DDPStrategy`` and ``FSDPStrategy``, ``for_job`` choosing between them),
``loggers`` (the metric-logger fan-out: ``history.jsonl``, TensorBoard, the progress line and
``progress.json``), ``tracking`` (MLflow). What a task plugs in (``Task``, ``Prepared``) is in
``tasks/base.py``.
"""
