"""Training: the loop and what it plugs into.

``build`` (``build_trainer``: a ``Trainer`` made from its parts, resumed from a checkpoint),
``trainer`` (``Trainer``: ``train()``, ``train_step()``, ``evaluate()``, ``save_checkpoint()``;
``Layout``), ``recipe`` (seeding, precision, the optimizer and LR schedule picked by spec fields), ``state``
(``TrainState``, every piece of loop state; ``Contents``, what a checkpoint saves and restores), ``strategy`` (the
``Strategy`` protocol, ``DDPStrategy`` and ``FSDPStrategy``, ``for_job`` choosing between them),
``loggers`` (the metric-logger fan-out: ``history.jsonl``, TensorBoard, the progress line and
``progress.json``), ``tracking`` (MLflow). What a task plugs in (``Task``, ``Prepared``) is in
``tasks/base.py``.
"""
