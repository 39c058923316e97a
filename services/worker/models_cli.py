"""`weir models`, as the CLI runs it: weir/models/cli.py with the worker's golden recorder.

`weir models push` records each golden by running the model with the worker's own engines
(services/worker/hosts/goldens.py), so that a worker checking the goldens later decodes exactly as the
recording did. weir/ never imports services/ (docs/design.md, "The floors"), so weir/cli.py
dispatches `weir models` here and this passes the recorder in.
"""

from __future__ import annotations

from schemas.model_repo import ModelConfig
from schemas.registry import GoldenCase
from weir.models import cli


def record_goldens(config: ModelConfig, prompts: list[str], max_tokens: int) -> list[GoldenCase]:
    """services/worker/hosts/goldens.py's recorder, imported when a push records goldens (it loads the
    engines; the other actions never need them)."""
    from services.worker.hosts import goldens

    return goldens.record_goldens(config, prompts, max_tokens)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `weir models`; returns the exit status."""
    return cli.main(argv, record_goldens=record_goldens)
