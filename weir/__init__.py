"""Weir's shared floor, under the four services, and the `weir` command on top of it.

The floor (imported by services/, importing only schemas/ and kernels/):
  bus.py          Kafka client factories, dead-lettering, offset bookkeeping (OffsetTracker)
  kafka/          the local Apache Kafka broker from Maven jars (launcher) and topic admin
  service.py      the one way to be a service: flags, logging, exit codes, signals, ops endpoint
  metrics.py      a service's OpenTelemetry meters, rendered for Prometheus
  supervision.py  when `weir up` restarts a service that died
  stack.py        `weir up`: the broker and the four services as supervised processes
  files.py        file chunks on Kafka (OpenAI Files and Batch inputs and outputs)
  embedding/      the ONNX embedding runtime shared by the worker and the auditor
  batch_cli.py, replay.py   client commands that talk to a deployment over HTTP and Kafka

The command (`weir.cli`) is the one module above the services: it hands each subcommand to the
module that owns it (docs/design.md, "The floors").
"""
