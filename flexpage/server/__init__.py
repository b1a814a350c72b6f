"""OpenAI-compatible HTTP server for the flexpage engine (``flexpage serve``).

* :mod:`flexpage.server.engine_loop`: the one thread that owns the engine;
* :mod:`flexpage.server.api`: the FastAPI app (endpoints, SSE streaming, errors, guards);
* :mod:`flexpage.server.metrics`: Prometheus metrics on a private registry;
* :mod:`flexpage.server.protocol`: request schemas and the OpenAI error shape;
* :mod:`flexpage.server.main`: start-up banner, uvicorn, draining shutdown.
"""
