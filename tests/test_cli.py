"""The weir command line: parsing and hand-off to the modules that own a subcommand."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from weir import cli


def test_delegated_command_gets_its_arguments_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("fake_gateway_app")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "fake_gateway_app", fake)
    monkeypatch.setitem(cli.DELEGATED, "gateway", ("fake_gateway_app", "run the gateway service"))
    assert cli.main(["gateway", "--help", "--port", "1"]) == 0
    assert seen == [["--help", "--port", "1"]]


def test_missing_delegated_module_fails_only_when_invoked(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(cli.DELEGATED, "replay", ("weir.no_such_module", "rerun recorded requests"))
    assert cli.main(["replay"]) == 2
    assert "weir.no_such_module" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["kafka", "status"]).action == "status"


def test_bench_runs_as_its_own_program_with_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(cli.os, "execv", lambda path, args: calls.append((path, args)))
    cli.main(["bench", "hop", "--count", "3", "--help"])
    assert calls == [(sys.executable, [sys.executable, "-m", "bench", "hop", "--count", "3", "--help"])]
    assert "bench" not in cli.DELEGATED  # weir/ never imports bench/: a process boundary, not an import


def test_weir_bench_help_lists_the_benches() -> None:
    from bench import BENCHES

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "weir.cli", "bench", "--help"], cwd=repo, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: weir bench")
    assert all(name in done.stdout for name in BENCHES)


def test_kafka_up_flags() -> None:
    args = cli.build_parser().parse_args(["kafka", "up", "--port", "19092", "--topic-prefix", "t", "--no-topics"])
    assert (args.port, args.controller_port, args.topic_prefix, args.no_topics) == (19092, None, "t", True)


def test_topics_create_refuses_a_reply_id_whose_topic_requests_may_not_name(capsys) -> None:
    assert cli.main(["topics", "create", "--bootstrap", "127.0.0.1:1", "--reply", "r" * 240]) == 2
    assert "at most 249 characters" in capsys.readouterr().err
