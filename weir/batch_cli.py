"""`weir batch`: run an OpenAI-format batch file through a Weir gateway.

    weir batch submit FILE.jsonl --endpoint /v1/chat/completions [--base-url URL] [--out OUT.jsonl]
    weir batch status BATCH_ID [--base-url URL]
    weir batch cancel BATCH_ID [--base-url URL]

`submit` uploads the file, creates the batch, shows its progress until it ends, then downloads
the output (and the error file, next to it as OUT.errors.jsonl). It talks to the gateway with the
official openai client, as any user would. Exit status: 0 completed, 1 failed/expired/cancelled,
2 usage or connection error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

TERMINAL = ("completed", "failed", "cancelled", "expired")


def _client(args: argparse.Namespace) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=5, timeout=60)


class Progress:
    """A one-line progress display: tqdm when installed, else plain text rewritten with \\r."""

    def __init__(self, stream: Any = sys.stderr) -> None:
        self.stream = stream
        try:
            from tqdm import tqdm

            self.bar: Any = tqdm(total=0, unit="req", file=stream, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def update(self, batch: Any) -> None:
        counts = batch.request_counts
        done = (counts.completed + counts.failed) if counts else 0
        total = counts.total if counts else 0
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.set_description(batch.status)
            self.bar.set_postfix(failed=counts.failed if counts else 0)
            self.bar.refresh()
            return
        width = 30
        filled = width * done // total if total else 0
        self.stream.write(
            f"\r{batch.status:<11} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
            f" failed={counts.failed if counts else 0}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self.stream.write("\n")


def submit(args: argparse.Namespace) -> int:
    client = _client(args)
    with open(args.file, "rb") as fh:
        uploaded = client.files.create(file=fh, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=args.endpoint,
        completion_window="24h",
        metadata={"source": Path(args.file).name},
    )
    print(f"batch {batch.id} (input {uploaded.id})", file=sys.stderr)
    progress = Progress()
    try:
        while batch.status not in TERMINAL:
            progress.update(batch)
            time.sleep(args.poll_s)
            batch = client.batches.retrieve(batch.id)
        progress.update(batch)
    finally:
        progress.close()
    out = Path(args.out or Path(args.file).with_suffix(".output.jsonl"))
    if batch.output_file_id:
        out.write_bytes(client.files.content(batch.output_file_id).content)
        print(f"output: {out}", file=sys.stderr)
    if batch.error_file_id:
        errors = out.with_suffix(".errors.jsonl")
        errors.write_bytes(client.files.content(batch.error_file_id).content)
        print(f"errors: {errors}", file=sys.stderr)
    if batch.errors and batch.errors.data:
        for error in batch.errors.data[:10]:
            print(f"line {error.line}: {error.code}: {error.message}", file=sys.stderr)
    counts = batch.request_counts
    print(
        f"{batch.id} {batch.status}: {counts.completed if counts else 0} completed, "
        f"{counts.failed if counts else 0} failed",
        file=sys.stderr,
    )
    return 0 if batch.status == "completed" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weir batch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base-url",
        default=os.environ.get("WEIR_BASE_URL", "http://127.0.0.1:8000"),
        help="gateway URL (env WEIR_BASE_URL; default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("WEIR_API_KEY", os.environ.get("OPENAI_API_KEY", "none")),
        help="API key (env WEIR_API_KEY or OPENAI_API_KEY)",
    )
    # --base-url and --api-key also after the action (`weir batch submit F --base-url U`, as the docs
    # show it); there SUPPRESS keeps the value given before the action, or the default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--base-url", default=argparse.SUPPRESS, help="gateway URL (as before the action)")
    common.add_argument("--api-key", default=argparse.SUPPRESS, help="API key (as before the action)")
    actions = parser.add_subparsers(dest="action", required=True)
    sub = actions.add_parser("submit", help="upload, create, follow, download", parents=[common])
    sub.add_argument("file", help="JSONL of {custom_id, method, url, body}")
    sub.add_argument("--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"])
    sub.add_argument("--out", help="where the output goes (default FILE.output.jsonl)")
    sub.add_argument("--poll-s", type=float, default=1.0, help="seconds between status polls")
    for action in ("status", "cancel"):
        actions.add_parser(action, help=f"{action} a batch", parents=[common]).add_argument("batch_id")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of `weir batch`; returns the exit status."""
    args = build_parser().parse_args(argv)
    import openai

    try:
        if args.action == "submit":
            return submit(args)
        client = _client(args)
        batch = (
            client.batches.cancel(args.batch_id) if args.action == "cancel" else client.batches.retrieve(args.batch_id)
        )
        print(batch.model_dump_json(indent=2))
        return 0
    except (openai.APIError, OSError) as exc:
        print(f"weir batch: {exc}", file=sys.stderr)
        return 2
