"""The worker's Kafka edge: batches and cancellations in; reply, audit and shadow events out.

The map of the worker's rooms is docs/worker.md, "Code layout"."""
