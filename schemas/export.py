"""Write the JSON Schema of every wire type to schemas/json/<Name>.json.

python -m schemas.export          # rewrite the files after a deliberate contract change
python -m schemas.export --check  # exit 1 if a file differs from the code (CI, golden test)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from schemas.codec import WIRE_TYPES, json_schema

OUT_DIR = Path(__file__).parent / "json"


def rendered() -> dict[str, bytes]:
    """File name -> the bytes that file must hold."""
    return {
        f"{name}.json": orjson.dumps(json_schema(name), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
        for name in WIRE_TYPES
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for name, data in rendered().items():
        path = OUT_DIR / name
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(name)
        else:
            path.write_bytes(data)
    if stale:
        print(f"schemas/json is stale for {stale}: run python -m schemas.export", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
