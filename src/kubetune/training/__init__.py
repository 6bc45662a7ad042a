"""Training: the loop and what it plugs into.

``build`` (``build_trainer``: a ``Trainer`` made from its parts, resumed from a checkpoint; ``hooks``),
``trainer`` (``Trainer``: ``train()``, ``train_step()``, ``evaluate()``, ``save_checkpoint()``), ``layout``
(``Layout``: the data over ranks and steps), ``guard`` (``FiniteGuard``: a diverged run stops), ``hooks`` (the one
hook interface of the periodic duties: ``Hook``, ``Run``, ``Evaluation``, ``Checkpointing``), ``scoring``
(``Harness``: lm-evaluation-harness's scores as a hook), ``events`` (``Event``, ``EventBus``, ``events.jsonl``, the
human lines, the event lines a pod's log carries), ``recipe`` (seeding, precision, the optimizer and LR schedule
picked by spec fields), ``state`` (``TrainState``, every piece of loop state; ``Contents``, what a checkpoint saves
and restores), ``strategy`` (the ``Strategy`` protocol, ``DDPStrategy`` and ``FSDPStrategy``, ``for_job`` choosing
between them), ``loggers`` (renderings of the events: ``history.jsonl``, TensorBoard, the progress line and
``progress.json``), ``tracking`` (MLflow), ``trainer_status`` (the TrainJob's ``status.trainerStatus``). What a task
plugs in (``Task``, ``Prepared``) is in ``tasks/base.py``.
"""
