"""Weir: command line, local launcher and shared Kafka plumbing."""
