"""`weir bench startup`: how long `weir up` takes until it says "Weir is up", start after start.

Runs `weir up` as a user does (its own broker on a port of its own, the four services, the
repository's models) `--runs` times in a row on the same $WEIR_HOME, so after the first start the
Kafka jars, the broker's formatted storage and the ONNX export are cached: the second and later
starts are what a user waits for every day. Each start is stopped with SIGTERM (as Ctrl-C) once it is up.

For each start it prints the seconds from launch to the banner and when each line of `weir up`'s
own output appeared (its progress lines say which phase ended when), then the median over the
timed starts. The first start is reported apart ("cold" when the caches were empty).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.stats import print_table
from weir.kafka.launcher import port_open

READY_LINE = "Weir is up."


@dataclass
class StartRun:
    """One `weir up`: seconds to the banner (None: it never came) and its output lines, timed."""

    ready_s: float | None
    lines: list[tuple[float, str]] = field(default_factory=list)
    returncode: int | None = None


def launch(cmd: list[str], env: dict[str, str], timeout_s: float, cwd: Path | None = None) -> StartRun:
    """Run `cmd` until it prints READY_LINE (or exits, or `timeout_s`), then stop it and wait."""
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    run = StartRun(ready_s=None)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic() - started
            run.lines.append((now, line.rstrip("\n")))
            if line.strip() == READY_LINE and run.ready_s is None:
                run.ready_s = now
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready.wait(timeout_s)
    # SIGTERM, which `weir up` handles as Ctrl-C: a SIGINT is ignored by a program started in the
    # background of a non-interactive shell (it inherits SIG_IGN, and Python then keeps it).
    proc.send_signal(signal.SIGTERM)
    try:
        run.returncode = proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # weir up and the services it started (its own session)
        run.returncode = proc.wait()
    reader.join(5)
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weir bench startup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="timed starts after the first (default %(default)s)")
    parser.add_argument(
        "--kafka-port",
        type=int,
        default=19392,
        help="port of the broker `weir up` starts; must be free (default %(default)s)",
    )
    parser.add_argument("--port", type=int, default=18000, help="the gateway's port (default %(default)s)")
    parser.add_argument("--model-repo", default=os.environ.get("WEIR_MODEL_REPO", "models.toml"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    parser.add_argument("--show-lines", action="store_true", help="print every start's timed output lines")
    parser.add_argument(
        "--checkout", type=Path, help="run the `weir up` of another checkout of Weir (a before/after comparison)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmd = [
        sys.executable,
        "-m",
        "weir.cli",
        "up",
        "--kafka-port",
        str(args.kafka_port),
        "--port",
        str(args.port),
        "--model-repo",
        args.model_repo,
        "--timeout",
        str(args.timeout),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.checkout is not None:
        env["PYTHONPATH"] = str(args.checkout.resolve())
    runs: list[StartRun] = []
    for index in range(args.runs + 1):
        if port_open("127.0.0.1", args.kafka_port):  # `weir up` would reuse it: no broker start timed
            print(
                f"a broker already answers at port {args.kafka_port} (one a killed `weir up` left?): stop it "
                f"with `weir kafka down --port {args.kafka_port}` so that every start boots its own"
            )
            return 1
        run = launch(cmd, env, args.timeout, cwd=args.checkout)
        runs.append(run)
        label = "first" if index == 0 else f"run {index}"
        print(
            f"{label}: "
            + (f"up in {run.ready_s:.1f} s" if run.ready_s is not None else f"not up (exit {run.returncode})"),
            flush=True,
        )
        if args.show_lines or run.ready_s is None:
            for at, line in run.lines:
                print(f"  {at:6.1f}  {line}")
        if run.ready_s is None:
            return 1
    timed = [r.ready_s for r in runs[1:] if r.ready_s is not None]
    rows = [["first start", f"{runs[0].ready_s:.1f}"]] + [[f"start {i}", f"{s:.1f}"] for i, s in enumerate(timed, 1)]
    rows.append([f"median of {len(timed)}", f"{statistics.median(timed):.1f}" if timed else "-"])
    print()
    print_table(rows, ["weir up", "s to 'Weir is up.'"])
    print(f"\nWEIR_HOME={os.environ.get('WEIR_HOME', '(default)')}  log dir: {Path(_log_dir(runs[-1]))}")
    return 0


def _log_dir(run: StartRun) -> str:
    """Where `weir up` said the services' logs are (for the per-service timestamps)."""
    for _, line in run.lines:
        if "logs in " in line:
            return line.split("logs in ", 1)[1].rstrip(") .")
    return "?"
