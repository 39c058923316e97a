"""The `kafka` marker, not a file name, says a test needs the broker, and a test that talks to Kafka
without it is refused at collection (tests/conftest.py: pytest_collection_modifyitems)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest
from tests.conftest import pytest_collection_modifyitems  # noqa: F401 - the check under test

@pytest.fixture
def gateway_bootstrap():
    return "127.0.0.1:1"
"""
CASES = {
    # name: (test module, refused?)
    "imports_the_address": ("from tests.conftest import BOOTSTRAP\n\ndef test_x():\n    assert BOOTSTRAP\n", True),
    "through_a_helper": (
        "from tests.kafka_helpers import produce\n\ndef send():\n    return produce\n\n"
        "def test_x():\n    assert send()\n",
        True,
    ),
    "through_a_fixture": ("def test_x(gateway_bootstrap):\n    assert gateway_bootstrap\n", True),
    "marked_in_the_module": (
        "import pytest\nfrom tests.conftest import BOOTSTRAP\n\npytestmark = pytest.mark.kafka\n\n"
        "def test_x():\n    assert BOOTSTRAP\n",
        False,
    ),
    "marked_as_a_cluster": (
        "import pytest\n\n@pytest.mark.cluster\ndef test_x(gateway_bootstrap):\n    assert 1\n",
        False,
    ),
    "no_kafka_at_all": ("def test_x():\n    assert 1\n", False),
    # the name says nothing: a *_kafka.py file without Kafka is fine, and one with Kafka is checked
    "not_kafka_kafka": ("def test_x():\n    assert 1\n", False),
}


def collect(tmp_path: Path, cases: list[str]) -> tuple[int, str]:
    """Collect the given cases' modules in a directory of their own, under the check; (exit code, output)."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for case in cases:
        (tmp_path / f"test_{case}.py").write_text(textwrap.dedent(CASES[case][0]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_test_that_talks_to_kafka_without_the_marker_is_refused_at_collection(tmp_path: Path) -> None:
    refused = sorted(case for case, (_, is_refused) in CASES.items() if is_refused)
    code, out = collect(tmp_path, refused)
    assert code == pytest.ExitCode.USAGE_ERROR, out
    assert "carry no `kafka` marker" in out, out
    for case in refused:
        assert f"test_{case}.py::test_x" in out, out


def test_marked_tests_and_tests_without_kafka_are_collected_whatever_their_file_is_called(tmp_path: Path) -> None:
    fine = sorted(case for case, (_, is_refused) in CASES.items() if not is_refused)
    code, out = collect(tmp_path, fine)
    assert code == pytest.ExitCode.OK, out
    assert f"{len(fine)} tests collected" in out, out
