"""`weir sbom`: a CycloneDX 1.6 JSON SBOM of this environment, and its check against the locks.

    weir sbom [--out FILE] [--check] [--lock FILE ...]

Components: every Python distribution installed in this interpreter's environment (purl
pkg:pypi/NAME@VERSION, its declared license, and as properties the sha256 of each file the lock
accepts for that version), and every file of the Kafka broker's lib dir ($WEIR_HOME/kafka/<version>/lib;
purl pkg:maven/GROUP/ARTIFACT@VERSION from weir/kafka/jars.sha256, and the sha256 of the jar
itself). pip does not record which of a release's files it installed, so a package's own hash is
the lock's accepted set, not one file's.

--check (run by scripts/test.sh, so CI) refuses, exit 1 with each reason, an environment where a
locked package is missing or at another version, or a pinned jar is missing or differs. Schema
validity is tests/test_supply_chain.py's (the official schema, vendored in tests/data/cyclonedx).
docs/supply-chain.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from weir.kafka import launcher

SPEC_VERSION = "1.6"
LOCKED_SHA256 = "weir:locked-sha256"  # a property: one file hash the lock accepts for this version


def normalize(name: str) -> str:
    """PEP 503's normal form of a distribution name (as purls and pip compare them)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """{normalized name: (version, [sha256, ...])} of a `--generate-hashes` requirements file."""
    locked: dict[str, tuple[str, list[str]]] = {}
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip().rstrip("\\").strip()
        if not line:
            continue
        if not raw[0].isspace():  # a requirement starts a line; its hashes follow, indented
            requirement = line.split(";", 1)[0].split()[0]
            if "==" not in requirement:
                raise ValueError(f"{path}: {requirement!r} is not pinned with ==")
            name, version = requirement.split("==", 1)
            current = normalize(name.split("[", 1)[0])
            locked[current] = (version, [])
        for word in line.split():
            if word.startswith("--hash=sha256:") and current:
                locked[current][1].append(word.removeprefix("--hash=sha256:"))
    return locked


def _license(meta: importlib.metadata.PackageMetadata) -> list[dict[str, Any]]:
    """The declared license: an SPDX expression (PEP 639) when given, else its License text or classifier."""
    if expression := meta.get_all("License-Expression"):
        return [{"expression": expression[0].strip()}]
    text = (meta.get_all("License") or [""])[0].strip()
    if text and "\n" not in text and len(text) <= 100:  # some packages paste the whole license here
        return [{"license": {"name": text}}]
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return [{"license": {"name": name}} for name in classifiers]


def python_components(locked: dict[str, tuple[str, list[str]]]) -> list[dict[str, Any]]:
    """One component per distribution installed here (the first on sys.path wins, as imports do)."""
    components: dict[str, dict[str, Any]] = {}
    for dist in importlib.metadata.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if not name or name in components:
            continue
        version = dist.version
        purl = f"pkg:pypi/{name}@{version}"
        component: dict[str, Any] = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl}
        if licenses := _license(dist.metadata):
            component["licenses"] = licenses
        lock_version, hashes = locked.get(name, ("", []))
        if lock_version == version and hashes:
            component["properties"] = [{"name": LOCKED_SHA256, "value": h} for h in hashes]
        components[name] = component
    return sorted(components.values(), key=lambda c: c["name"])


def jar_components(lib: Path, version: str = launcher.KAFKA_VERSION) -> list[dict[str, Any]]:
    """One component per file of the broker's lib dir, with its own sha256; coordinates from the pins."""
    pins = launcher.jar_pins(version)
    components = []
    for jar in sorted(p for p in lib.iterdir() if p.name != ".complete"):
        with open(jar, "rb") as handle:
            sha256 = hashlib.file_digest(handle, "sha256").hexdigest()
        component: dict[str, Any] = {
            "type": "library",
            "bom-ref": f"jar:{jar.name}",
            "name": jar.name,
            "hashes": [{"alg": "SHA-256", "content": sha256}],
        }
        if jar.name in pins:
            group, artifact, jar_version = pins[jar.name][1].split(":")
            purl = f"pkg:maven/{group}/{artifact}@{jar_version}"
            component.update({"bom-ref": purl, "group": group, "name": artifact, "version": jar_version, "purl": purl})
        component["properties"] = [{"name": "weir:file", "value": jar.name}]
        components.append(component)
    return components


def build_sbom(locks: list[Path], lib: Path | None) -> dict[str, Any]:
    """The SBOM document; `lib` None when the Kafka jars are not resolved here."""
    locked: dict[str, tuple[str, list[str]]] = {}
    for lock in locks:
        locked.update(read_lock(lock))
    components = python_components(locked)
    weir_version = next((c["version"] for c in components if c["name"] == "weir"), "0")
    components = [c for c in components if c["name"] != "weir"]  # the subject, in metadata
    if lib is not None:
        components += jar_components(lib)
    subject = {
        "type": "application",
        "bom-ref": f"pkg:pypi/weir@{weir_version}",
        "name": "weir",
        "version": weir_version,
        "purl": f"pkg:pypi/weir@{weir_version}",
    }
    return {
        "bomFormat": "CycloneDX",
        "specVersion": SPEC_VERSION,
        "serialNumber": f"urn:uuid:{uuid.uuid4()}",
        "version": 1,
        "metadata": {
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "tools": {"components": [{"type": "application", "name": "weir sbom", "version": weir_version}]},
            "component": subject,
            "properties": [{"name": "weir:lock", "value": lock.name} for lock in locks],
        },
        "components": components,
    }


def check_sbom(sbom: dict[str, Any], locks: list[Path], lib: Path | None) -> list[str]:
    """Why `sbom` does not match the locks and the jar pins (empty when it does)."""
    problems = []
    listed = {c["name"]: c.get("version") for c in sbom["components"] if c.get("purl", "").startswith("pkg:pypi/")}
    listed[sbom["metadata"]["component"]["name"]] = sbom["metadata"]["component"]["version"]
    for lock in locks:
        for name, (version, _) in sorted(read_lock(lock).items()):
            if name not in listed:
                problems.append(f"{name}=={version} ({lock.name}) is not installed")
            elif listed[name] != version:
                problems.append(f"{name} is {listed[name]} here, {version} in {lock.name}")
    if lib is None:
        return [*problems, f"the Kafka {launcher.KAFKA_VERSION} jars are not resolved (weir kafka up resolves them)"]
    jars = {p["value"]: c for c in sbom["components"] for p in c.get("properties", []) if p["name"] == "weir:file"}
    for name, (sha256, coordinates) in sorted(launcher.jar_pins().items()):
        if name not in jars:
            problems.append(f"the pinned jar {name} ({coordinates}) is not listed")
        elif jars[name]["hashes"][0]["content"] != sha256:
            problems.append(f"the jar {name} has another sha256 than the pinned {sha256}")
    problems += [
        f"the jar {name} is not pinned in {launcher.JAR_PINS.name}" for name in sorted(jars) if "purl" not in jars[name]
    ]
    return problems


def default_locks() -> list[Path]:
    """The requirements*.lock files of the current directory (a checkout's root, or the image's /app)."""
    return sorted(Path.cwd().glob("requirements*.lock"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir sbom", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the SBOM here (default: standard output)")
    parser.add_argument(
        "--lock",
        type=Path,
        action="append",
        metavar="FILE",
        help="a hash-locked requirements file (repeatable; default ./requirements*.lock)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless every locked package is installed at its version and every pinned "
        "Kafka jar is resolved and listed with its pinned sha256",
    )
    args = parser.parse_args(argv)
    locks = args.lock if args.lock is not None else default_locks()
    if missing := [str(lock) for lock in locks if not lock.is_file()]:
        parser.error(f"no such lock file: {', '.join(missing)}")
    if args.check and not locks:
        parser.error("--check needs a lock file (--lock, or requirements*.lock in this directory)")
    lib = launcher.lib_dir() if launcher.jars_resolved() else None
    try:
        sbom = build_sbom(locks, lib)
    except (ValueError, launcher.BrokerError) as exc:
        print(f"weir sbom: error: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(sbom, indent=1) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        jars = "no Kafka jars (not resolved)" if lib is None else f"the Kafka jars of {lib}"
        print(f"weir sbom: {len(sbom['components'])} components ({jars}) -> {args.out}", file=sys.stderr)
    if args.check:
        if problems := check_sbom(sbom, locks, lib):
            print("weir sbom: check failed:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        print(
            f"weir sbom: check passed against {', '.join(lock.name for lock in locks)} and {launcher.JAR_PINS.name}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
