"""``kubetune serve``'s HTTP side: the app (``app``), requests batched for the engine (``batcher``),
their limits and metrics (``compute``), the OpenAI protocol (``openai_routes``), KServe's v1 and open
inference v2 (``kserve_routes``, ``v2``), the request and response shapes (``protocol``) and the server
(``http``)."""
