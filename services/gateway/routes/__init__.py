"""The gateway's HTTP and WebSocket routes, one module per concern; create_app (app.py) wires them.

    completions.py  POST /v1/chat/completions, POST /v1/completions (JSON or SSE)
    embeddings.py   POST /v1/embeddings
    streams.py      WS /v1/stream, GET /v1/streams/{request_id} (resume)
    batches.py      OpenAI's Files and Batch APIs (/v1/files, /v1/batches)
    operations.py   GET /v1/models, /healthz, /readyz, /metrics
    errors.py       the one exception handler: every error leaves in OpenAI's format
    reading.py      a request's body under the size limit, its timeout header
    parts.py        GatewayParts: what the routes share, built once by create_app

Each module has an `add_*_routes(router, ...)` that puts its endpoints on the app's router; the
handlers are a few lines: read the request, call the guard, the bus or a pure function, answer.
The edge: routes import the guard, the bus and the formats; nothing below imports routes.
"""
