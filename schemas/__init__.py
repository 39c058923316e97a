"""Weir's wire contract: message types, topic names, group ids and the model repository format."""

from schemas.messages import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION"]
