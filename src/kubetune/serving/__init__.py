"""``kubetune serve``: an exported model behind an HTTP server (``app.py``), the OpenAI protocol for
causal LMs and KServe's v1 / open inference v2 for classifiers, requests batched together
(``batcher.py``) for the engine that computes them (``engine.py``)."""
