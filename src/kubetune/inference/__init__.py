"""Inference on an exported model, what a task's inference plugs into: loading and checking a model
folder (``model``), the engines that compute (``engine``) and the HTTP server with its protocols
(``server/``). Nothing here names a task: a task says which of these it uses (``tasks.base.Inference``)."""
