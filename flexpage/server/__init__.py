"""OpenAI-compatible HTTP server for the flexpage engine (``flexpage serve``).

* :mod:`flexpage.server.engine_loop`: the one thread that owns the engine;
* :mod:`flexpage.server.api`: the FastAPI app (endpoints, request validation, errors);
* :mod:`flexpage.server.guard`: the ASGI guard in front of it (API key, draining, body size);
* :mod:`flexpage.server.responses`: one request's submissions, collected or streamed (SSE);
* :mod:`flexpage.server.state`: what the handlers share;
* :mod:`flexpage.server.metrics`: Prometheus metrics on a private registry;
* :mod:`flexpage.server.protocol`: request schemas and the OpenAI error shape;
* :mod:`flexpage.server.main`: start-up banner, uvicorn, draining shutdown.
"""
