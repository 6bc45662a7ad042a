"""Inference on an exported model, what a task's inference plugs into: finding, checking and loading a
model folder (``model``), the model families a task picks (``causal``: generation and its engine;
``classifier``: labels and its engine; ``kinds``: their ready-made ``Inference``), the seam itself
(``seam``: ``Inference``, the protocols, the engine protocol) and the HTTP server (``server/``). Nothing
here names a task: a task says which of these it uses (``Task.inference``)."""
