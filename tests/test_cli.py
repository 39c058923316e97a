"""The weir command line: parsing and hand-off to the modules that own a subcommand."""

from __future__ import annotations

import sys
import types

import pytest

from weir import cli


def test_delegated_command_gets_its_arguments_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("fake_gateway_app")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_gateway_app", fake)
    monkeypatch.setitem(cli.DELEGATED, "gateway", ("fake_gateway_app", "run the gateway service"))
    assert cli.main(["gateway", "--help", "--port", "1"]) == 0
    assert seen == [["--help", "--port", "1"]]


def test_missing_delegated_module_fails_only_when_invoked(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(cli.DELEGATED, "bench", ("weir.no_such_module", "benchmark"))
    assert cli.main(["bench"]) == 2
    assert "weir.no_such_module" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["kafka", "status"]).action == "status"


def test_kafka_up_flags() -> None:
    args = cli.build_parser().parse_args(["kafka", "up", "--port", "19092", "--topic-prefix", "t", "--no-topics"])
    assert (args.port, args.controller_port, args.topic_prefix, args.no_topics) == (19092, None, "t", True)
