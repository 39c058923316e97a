"""`weir bench guards`: its tables, and the baseline it runs from another commit's checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import guards

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_prints_both_guards_per_language_and_per_split() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "guards", "--baseline", "none", "--misses"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("Input guard, ") and "\nOutput guard, " in out and "\nBy split" in out
    for lang in ("en", "fr", "es", "pt", "de", "ru", "zh", "ja", "ar"):
        assert f"\n{lang} " in out, lang
    assert "Rows the current guards get wrong:" in out


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_a_baseline_at_this_commit_gives_what_this_code_gives_when_nothing_is_uncommitted() -> None:
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "services/gateway/guard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if dirty:
        pytest.skip("the guards have uncommitted changes: HEAD's checkout would differ")
    assert guards.evaluate_at("HEAD") == guards.evaluate()
    assert guards.evaluate_at("no-such-commit-anywhere") is None
