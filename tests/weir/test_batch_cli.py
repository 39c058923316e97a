"""`weir batch`'s options: --base-url and --api-key before or after the action, as docs/batch.md shows."""

from __future__ import annotations

from weir.batch_cli import build_parser


def test_the_gateway_url_and_key_may_come_before_or_after_the_action() -> None:
    parser = build_parser()
    assert parser.parse_args(["submit", "f.jsonl", "--base-url", "http://x:1"]).base_url == "http://x:1"
    assert parser.parse_args(["--base-url", "http://y:2", "submit", "f.jsonl"]).base_url == "http://y:2"
    assert parser.parse_args(["status", "b", "--api-key", "k"]).api_key == "k"
    assert parser.parse_args(["cancel", "b"]).base_url  # the default (env WEIR_BASE_URL, else localhost)
