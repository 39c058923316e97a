"""`weir bench guards` (or `python -m bench.guards`): detection and false positives of the input and
output guards on the multilingual set in tests/data/guards/, beside an older commit's guards.

The set is hand-written (not taken from any data set): input.jsonl holds prompt injections and
benign look-alikes ("How do I enable developer mode on a Pixel phone?", "can I ignore this
warning?") in English, French, Spanish, Portuguese, German, Russian, Chinese, Japanese and Arabic;
output.jsonl holds model outputs with bank cards and IBANs (split by newlines, by filler words, in
2-digit groups, grouped, plain) and benign numbers (dates, prices, order numbers failing Luhn,
years, versions, phone-like numbers). Each row has a split, in the order they were written: "dev"
(rule changes were checked against it), "test" (written with dev; not tuned on, but the families
its dev twins taught were), "fresh" (written after those changes; rules were then added for the
families it missed) and "final" (written after every rule change, measured once, never tuned
on: the held-out figure). The tables give all rows; the summary each split apart. Nothing here
trains: the classifier's weights are unchanged.

Input guard: a prompt counts as detected at level high (what a blocking tenant refuses) and, in the
second column, at level medium or high (what is counted and logged); a benign prompt at that level
is a false positive. Output guard: an output counts as detected when the whole-text redaction
replaced at least one span, and a benign output is a false positive when anything was replaced; each
output is also streamed in deltas of 1-7 characters, which must give the same text as the whole.

The baseline is the guards' code at another commit (default BASELINE, the commit before the
multilingual work), checked out with `git worktree add --detach` in a temporary folder and run in
a subprocess on the same rows; `--baseline none` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TypedDict

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "guards"
BASELINE = "b62188b"  # main before the multilingual guards (issue 35, item 10)


class RowResult(TypedDict, total=False):
    """evaluate()'s answer for one row: the first three keys for an input row, the last three for an output row."""

    level: str
    rules: list[str]
    score: float
    num_redacted: int
    stream_ok: bool
    redacted: str


Results = dict[str, RowResult]


def load(name: str, data: Path = DATA) -> list[dict[str, str]]:
    """The rows of tests/data/guards/<name>.jsonl."""
    with open(data / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def evaluate(data: Path = DATA) -> Results:
    """Per row id: the input guard's level and rules, or the output guard's count of redacted
    spans and whether streaming gave the whole text's answer. Imports only what every commit since
    the guards began has (InjectionDetector, redact, Redactor), so it also runs an older checkout."""
    from services.gateway.guard.injection import InjectionDetector
    from services.gateway.guard.redaction import Redactor, redact

    detector = InjectionDetector()
    out: Results = {}
    for row in load("input", data):
        detection = detector.detect(row["text"])
        out[row["id"]] = {"level": detection.level, "rules": list(detection.rules), "score": round(detection.score, 4)}
    rng = random.Random(0)
    for row in load("output", data):
        text = row["text"]
        whole, num = redact(text)
        redactor, parts, i = Redactor(), [], 0
        while i < len(text):
            step = rng.randint(1, 7)
            parts.append(redactor.feed(text[i : i + step]))
            i += step
        streamed = "".join(parts) + redactor.flush()
        out[row["id"]] = {"num_redacted": num, "stream_ok": streamed == whole, "redacted": whole}
    return out


def evaluate_at(commit: str) -> Results | None:
    """evaluate() on the guards of `commit` (a git worktree of it, in a subprocess); None when this
    is not a git checkout or the commit is unknown."""
    with tempfile.TemporaryDirectory(prefix="weir-guards-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        added = subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), commit],
            capture_output=True,
            text=True,
            check=False,
        )
        if added.returncode != 0:
            print(f"baseline {commit}: no checkout ({added.stderr.strip() or added.stdout.strip()})", file=sys.stderr)
            return None
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            command = [sys.executable, str(Path(__file__).resolve()), "--evaluate-only", "--data", str(DATA)]
            run = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True)
            return json.loads(run.stdout)
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True, check=False
            )


def _pct(hits: int, total: int) -> str:
    return f"{100 * hits / total:.0f}% ({hits}/{total})" if total else "-"


def input_table(rows: list[dict[str, str]], results: list[Results | None]) -> list[list[str]]:
    """Per language and in all: detection and false-positive rates at high and at medium-or-high."""
    table = []
    langs = sorted({r["lang"] for r in rows}, key=lambda lang: (lang != "en", lang))
    for lang in [*langs, "all"]:
        mine = [r for r in rows if lang in ("all", r["lang"])]
        pos = [r for r in mine if r["label"] == "injection"]
        neg = [r for r in mine if r["label"] == "benign"]
        line = [lang]
        for wanted in (("high",), ("high", "medium")):
            for group in (pos, neg):
                line.append(
                    " -> ".join(
                        _pct(sum(res[r["id"]]["level"] in wanted for r in group), len(group))
                        if res is not None
                        else "n/a"
                        for res in results
                    )
                )
        table.append(line)
    return table


def output_table(rows: list[dict[str, str]], results: list[Results | None]) -> list[list[str]]:
    """Per language and in all: outputs with a card or IBAN redacted, benign ones changed, streaming
    mismatches."""
    table = []
    langs = sorted({r["lang"] for r in rows}, key=lambda lang: (lang != "en", lang))
    for lang in [*langs, "all"]:
        mine = [r for r in rows if lang in ("all", r["lang"])]
        pos = [r for r in mine if r["label"] == "leak"]
        neg = [r for r in mine if r["label"] == "benign"]
        line = [lang]
        for group in (pos, neg):
            line.append(
                " -> ".join(
                    _pct(sum(int(res[r["id"]]["num_redacted"]) > 0 for r in group), len(group))
                    if res is not None
                    else "n/a"
                    for res in results
                )
            )
        line.append(
            " -> ".join(
                str(sum(not res[r["id"]]["stream_ok"] for r in mine)) if res is not None else "n/a" for res in results
            )
        )
        table.append(line)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench guards", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="commit whose guards are the baseline; 'none': skip")
    parser.add_argument("--split", default="all", help="rows of this split only (dev, test, fresh, final) or all")
    parser.add_argument("--data", type=Path, default=DATA, help=argparse.SUPPRESS)
    parser.add_argument("--evaluate-only", action="store_true", help=argparse.SUPPRESS)  # the baseline's subprocess
    parser.add_argument("--misses", action="store_true", help="list every row the current guards get wrong")
    args = parser.parse_args(argv)
    if args.evaluate_only:
        json.dump(evaluate(args.data), sys.stdout, ensure_ascii=False)
        return 0

    from bench.stats import print_table

    current = evaluate(args.data)
    base = None if args.baseline == "none" else evaluate_at(args.baseline)
    results: list[Results | None] = [base, current] if args.baseline != "none" else [current]
    arrow = f"baseline {args.baseline} -> now" if args.baseline != "none" else "now"
    inputs = [r for r in load("input", args.data) if args.split in ("all", r["split"])]
    outputs = [r for r in load("output", args.data) if args.split in ("all", r["split"])]
    print(f"Input guard, {len(inputs)} prompts ({args.split} split); cells: {arrow}")
    print_table(
        input_table(inputs, results),
        ["lang", "injections: high", "benign: high (FP)", "injections: >= medium", "benign: >= medium (FP)"],
    )
    print(f"\nOutput guard, {len(outputs)} outputs ({args.split} split); cells: {arrow}")
    print_table(
        output_table(outputs, results), ["lang", "cards/IBANs redacted", "benign changed (FP)", "stream != whole"]
    )
    print(
        "\nBy split (dev: rules were checked against it; test: written with dev, not tuned on, but rules for the same"
        " families were; fresh: written after those, then rules were added for its misses; final: written after"
        " every rule change, never tuned on)"
    )
    summary = []
    for split in sorted({r["split"] for r in inputs} | {r["split"] for r in outputs}):
        inp = [r for r in inputs if r["split"] == split]
        outp = [r for r in outputs if r["split"] == split]
        summary.append([split] + input_table(inp, results)[-1][1:3] + output_table(outp, results)[-1][1:3])
    print_table(
        summary, ["split", "injections: high", "benign: high (FP)", "cards/IBANs redacted", "benign changed (FP)"]
    )
    if args.misses:
        print("\nRows the current guards get wrong:")
        for r in inputs:
            level = current[r["id"]]["level"]
            if (r["label"] == "injection") != (level == "high"):
                print(f"  {r['id']} {r['split']} {r['lang']} {r['label']} level={level}: {r['text'][:100]!r}")
        for r in outputs:
            num = int(current[r["id"]]["num_redacted"])
            if (r["label"] == "leak") != (num > 0) or not current[r["id"]]["stream_ok"]:
                print(f"  {r['id']} {r['split']} {r['lang']} {r['label']} redacted={num}: {r['text'][:100]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
