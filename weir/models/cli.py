"""`weir models`: GGUF files into model directories Weir serves, and the model registry.

    weir models import-gguf FILE --name NAME [--out DIR] [--dtype float32|bfloat16|float16] [--force]
    weir models prepare [--model-repo models.toml] [--models a,b]

import-gguf writes a Hugging Face directory (default $WEIR_HOME/models/NAME) and prints the
models.toml entry that serves it; prepare imports every GGUF `source` of a model repository ahead
of time (`weir up` does this itself before it starts the services). The registry's actions (pack,
push, list, show, load, unload, retire, promote, compare, seed, keygen) are weir/models/registry_cli.py's.
Exit status 0, or 2 with one line naming the file and the problem.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from schemas.model_repo import ModelRepoError, load_model_repo
from weir.models import registry_cli
from weir.models.gguf_import import import_gguf
from weir.models.safetensors_writer import DTYPES
from weir.models.sources import default_model_dir, prepare_models


class _OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line, `weir models ACTION: error: ...`, exit status 2, like every
    other error of `weir models` (the usage is in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="weir models", description="GGUF files into model directories Weir serves; "
                                     "the model registry (docs/design.md, 'The model registry').")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    imp = actions.add_parser("import-gguf", help="import a GGUF file as a Hugging Face model directory")
    imp.add_argument("file", type=Path, help="the .gguf file")
    imp.add_argument("--name", required=True, help="the model's name (its models.toml entry)")
    imp.add_argument("--out", type=Path, help="output directory (default $WEIR_HOME/models/NAME)")
    imp.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                     help="dtype of model.safetensors (default %(default)s: the dequantized values exactly)")
    imp.add_argument("--force", action="store_true", help="import again even if OUT holds this import")
    prep = actions.add_parser("prepare", help="import every GGUF source of a model repository (once)")
    prep.add_argument("--model-repo", type=Path, default=Path(os.environ.get("WEIR_MODEL_REPO", "models.toml")),
                      help="model repository TOML (env WEIR_MODEL_REPO; default %(default)s)")
    prep.add_argument("--models", default="", help="comma-separated entries (default: all)")
    registry_cli.add_actions(actions)
    return parser


def main(argv: list[str] | None = None, record_goldens: registry_cli.RecordGoldens | None = None) -> int:
    """Entry point of `weir models`; returns the exit status. `record_goldens` is how `push`
    records golden outputs (services/worker/models_cli.py passes the worker's)."""
    try:
        args, unknown = build_parser().parse_known_args(argv)
    except SystemExit as exc:  # --help (0) or a bad argument (2, its line printed)
        return int(exc.code or 0)
    if unknown:  # named with the action it was given to, like the other bad arguments
        print(f"weir models {args.action}: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    if args.action in registry_cli.REGISTRY_ACTIONS:
        return registry_cli.run(args, record_goldens)
    try:
        if args.action == "import-gguf":
            return _import(args)
        return _prepare(args)
    except (ValueError, OSError) as exc:  # GGUFError, ModelRepoError, a missing file, a full disk
        print(f"weir models {args.action}: error: {exc}", file=sys.stderr)
        return 2


def _progress(line: str) -> None:
    print(line, flush=True)


def _import(args: argparse.Namespace) -> int:
    if not args.name.strip() or any(ch.isspace() or ch == "/" for ch in args.name):
        raise ValueError(f"--name {args.name!r} must be a non-empty name without spaces or '/'")
    out = (args.out or default_model_dir(args.name)).resolve()
    import_gguf(args.file, out, source=str(args.file.resolve()), dtype=args.dtype, force=args.force, progress=_progress)
    # The file's own context length (<arch>.context_length, max_position_embeddings of the config it
    # became): a fixed 2048 overstated a 512-token model's (issue 35).
    context = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    print(f"""
{out} is ready. To serve it, add to your models.toml (WEIR_MODEL_REPO):

[models.{args.name}]
path = "{out}"
engine = "torch"
max_model_len = {context}  # the file's context length; lower it to save KV cache memory
""")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    repo = load_model_repo(args.model_repo)
    names = [n.strip() for n in args.models.split(",") if n.strip()] or list(repo.models)
    unknown = [n for n in names if n not in repo.models]
    if unknown:
        raise ModelRepoError(f"--models names {unknown}, not in {args.model_repo} ({list(repo.models)})")
    done = prepare_models(repo, names, _progress)
    print(f"{len(done)} GGUF model(s) ready" + "".join(f"\n  {p}" for p in done))
    return 0
