"""`weir models compare` and `weir models promote --require-*` against the real broker: the summary
is read from Topics.comparisons (forged records skipped), and promote refuses unless the comparison of
(current default -> the version) passes its thresholds (docs/design.md, "Traffic policies")."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from schemas.codec import encode
from schemas.registry import ModelComparison
from schemas.topics import Topics
from weir.registry import read_registry

from .test_registry_cli_kafka import _heartbeat, _produce, _push, _settings, prefix, tiny, weir  # noqa: F401

pytestmark = pytest.mark.kafka


def comparison(i: int, mirror: str = "tiny@2", similarity: float = 0.9, mirror_ttft: float = 110.0,
               error: str | None = None) -> tuple[bytes, bytes]:
    c = ModelComparison(request_id=f"r{i}", name="tiny", live="tiny@1", mirror=mirror, exact_match=i % 2 == 0,
                        token_edit_distance=i % 3, similarity=None if error else similarity, live_ttft_ms=100.0,
                        mirror_ttft_ms=None if error else mirror_ttft, live_tokens_per_s=50.0,
                        mirror_tokens_per_s=None if error else 45.0, mirror_error=error)
    return b"tiny", encode(c)


def test_compare_prints_the_summary_per_pair(prefix: str, capsys) -> None:  # noqa: F811
    assert weir(prefix, "compare", "tiny") == 0  # the topic is made when missing; nothing yet
    assert "tiny: no comparisons" in capsys.readouterr().out
    asyncio.run(_produce(prefix, Topics(prefix).comparisons, [
        *[comparison(i) for i in range(4)], comparison(4, error="timeout"),
        comparison(5, mirror="tiny@3", similarity=0.5),
        (b"x", b"forged: not a comparison"),
        (b"x", orjson.dumps({"request_id": "r", "name": "tiny"})),
    ]))
    assert weir(prefix, "compare", "tiny", "--json") == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["name"] == "tiny" and out["skipped"] == 2
    pair, other = out["pairs"]
    assert (pair["live"], pair["mirror"], pair["samples"], pair["errors"]) == ("tiny@1", "tiny@2", 5, 1)
    assert pair["error_rate"] == pytest.approx(0.2) and pair["exact_match_rate"] == pytest.approx(0.5)
    assert pair["mean_similarity"] == pytest.approx(0.9) and pair["latency_ratio"] == pytest.approx(1.1)
    assert pair["mean_edit_distance"] == pytest.approx((0 + 1 + 2 + 0) / 4)
    assert (other["mirror"], other["samples"], other["mean_similarity"]) == ("tiny@3", 1, 0.5)
    assert weir(prefix, "compare", "tiny") == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split()[:4] == ["LIVE", "MIRROR", "N", "ERRORS"]
    assert lines[1].split()[:5] == ["tiny@1", "tiny@2", "5", "1", "(20.0%)"] and "0.900" in lines[1]
    assert "2 records" in captured.err and "skipped" in captured.err
    assert weir(prefix, "compare", "other") == 0 and "other: no comparisons" in capsys.readouterr().out
    assert weir(prefix, "compare", "tiny@2") == 2 and "compare takes a NAME" in capsys.readouterr().err


def test_promote_refuses_unless_the_comparison_passes(prefix: str, tiny, capsys) -> None:  # noqa: F811
    assert _push(prefix, tiny, "1") == 0 and _push(prefix, tiny, "2") == 0
    topics = Topics(prefix)
    asyncio.run(_produce(prefix, topics.workers, [_heartbeat("w1", {"tiny@1": "ready", "tiny@2": "ready"})]))
    # the one heartbeat stays live for the whole test, however slow the machine (liveness is not its subject)
    checks = ("--require-similarity", "0.85", "--max-latency-ratio", "1.2", "--max-error-rate", "0.1", "--live-ms", "600000")
    capsys.readouterr()
    assert weir(prefix, "promote", "tiny@2", *checks, "--min-samples", "5") == 2
    assert "0 comparisons, fewer than --min-samples 5" in capsys.readouterr().err
    asyncio.run(_produce(prefix, topics.comparisons, [comparison(i, mirror_ttft=130.0) for i in range(5)]))
    assert weir(prefix, "promote", "tiny@2", *checks, "--min-samples", "5") == 2
    assert "latency ratio 1.300 > --max-latency-ratio 1.2" in capsys.readouterr().err
    assert weir(prefix, "promote", "tiny@2", "--require-similarity", "0.95", "--min-samples", "5", "--force") == 2
    assert "mean similarity 0.900 < --require-similarity 0.95" in capsys.readouterr().err  # --force skips no check
    assert weir(prefix, "promote", "tiny@2", "--max-error-rate", "1.5") == 2
    assert "--max-error-rate must be 0..1" in capsys.readouterr().err
    assert weir(prefix, "promote", "tiny@2", "--min-samples", "3") == 2
    assert "--min-samples needs" in capsys.readouterr().err
    assert asyncio.run(read_registry(_settings(prefix))).routes["tiny"].default_version == "1"  # refused: unchanged

    asyncio.run(_produce(prefix, topics.comparisons, [comparison(i) for i in range(5, 25)]))  # ratio now (5*1.3+20*1.1)/25
    assert weir(prefix, "promote", "tiny@2", *checks) == 0
    out = capsys.readouterr().out
    assert "the comparison tiny@1 -> tiny@2 passes (25 samples)" in out
    assert asyncio.run(read_registry(_settings(prefix))).routes["tiny"].default_version == "2"
