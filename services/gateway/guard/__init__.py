"""The gateway's guard: everything a request passes between its body and Kafka, and the filter
its text passes on the way back.

    gate.py          the facade the routes call: authenticate, authorize, admit, reserve, release
    auth.py          API keys and JWTs (401, 403); keys live in a KeyStore
    validation.py    a body against its model: prompt tokens, context length, stops (400)
    input_guard.py   prompt-injection block or flag per tenant (400, review flags); injection.py
                     is its detector, injection_model.json the classifier's weights
    admission.py     in-flight lanes and breakers per model (503, 429)
    limits.py        token buckets per credential and tenant (429, Retry-After)
    peers.py         keys and rate-limit usage shared with the other gateway instances over Kafka
    output_guard.py  personal data redacted from replies, across token boundaries (redaction.py)
    normalize.py     the view both guards match on: NFKC, invisible characters out, look-alikes folded
    settings.py      GuardSettings, a mixin of GatewaySettings

A lower floor than the routes and the bus: nothing here imports app.py, routes/, kafka_bus.py or
streaming.py; the bus and an Exchange come in as the small protocols gate.py names.
"""
