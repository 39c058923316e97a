"""The wheel the Docker image installs: built from what the Dockerfile copies, it holds every
runtime file of the packages, and a gateway started from it alone (not from this checkout) comes up.

The image once lost services/gateway/guard/injection_model.json (package data left out of the
wheel): its gateway died with FileNotFoundError on every start and compose restarted it forever.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
import zipfile
from pathlib import Path

import pytest

from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "kernels", "services", "weir", "bench")
BOOTSTRAP = os.environ.get("WEIR_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


def dockerfile_build_inputs() -> list[str]:
    """The paths the Dockerfile COPYs into the image before it runs `pip install`."""
    inputs: list[str] = []
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["RUN"] and "pip install" in line:
            return inputs
        if words[:1] == ["COPY"] and not any(w.startswith("--") for w in words):
            inputs += words[1:-1]
    raise AssertionError("the Dockerfile runs no `pip install`")


def tracked_package_files() -> set[str]:
    """Every file git tracks under the packages that go into the wheel."""
    out = subprocess.run(["git", "ls-files", *PACKAGES], cwd=REPO, capture_output=True, text=True, check=True)
    return {line for line in out.stdout.splitlines() if line and (REPO / line).is_file()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of exactly what the Dockerfile copies (nothing else of the checkout)."""
    context = tmp_path_factory.mktemp("docker-context")
    for name in dockerfile_build_inputs():
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, context / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(context), "-w", str(out)],
        check=True,
        cwd=context,
    )
    (found,) = out.glob("weir-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into a folder of its own (its dependencies are this venv's)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True
    )
    return target


def test_the_dockerfile_installs_from_the_hash_locked_requirements() -> None:
    install = next(line for line in (REPO / "Dockerfile").read_text().splitlines() if "pip install" in line)
    assert re.search(r"--require-hashes\s+-r\s+requirements\.lock", install), install
    assert {"requirements.lock", "requirements-nodeps.lock"} <= set(dockerfile_build_inputs())


def test_the_wheel_holds_every_tracked_file_of_the_packages(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = {n for n in archive.namelist() if ".dist-info/" not in n}
    missing = sorted(tracked_package_files() - names)
    assert not missing, f"left out of the wheel (pyproject.toml [tool.setuptools.package-data]): {missing}"
    assert "services/gateway/guard/injection_model.json" in names


def _environment(site: Path, home: Path) -> dict[str, str]:
    """Only the installed wheel and this venv's packages importable: no checkout on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    env.update(
        PYTHONPATH=str(site),
        WEIR_HOME=str(home),
        WEIR_MODEL_REPO=str(REPO / "models.toml"),
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def test_the_installed_wheel_is_what_runs(installed: Path, tmp_path: Path) -> None:
    code = "import services.gateway.guard.injection as m, weir; print(m.DEFAULT_MODEL_PATH); print(weir.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=_environment(installed, tmp_path),
        capture_output=True,
        text=True,
        check=True,
    )
    model_path, weir_init = out.stdout.split()
    assert Path(model_path).is_relative_to(installed) and Path(model_path).is_file()
    assert Path(weir_init).is_relative_to(installed)


def _wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout_s: float) -> re.Match[str]:
    def found() -> re.Match[str] | None:
        text = log.read_text(errors="replace")
        match = re.search(pattern, text)
        assert match or proc.poll() is None, f"no {pattern!r} (exit {proc.poll()}); the log:\n{text[-4000:]}"
        return match

    return wait_until(found, timeout_s=timeout_s, interval_s=0.2, what=f"{pattern!r} in {log.name}")


@pytest.mark.kafka
def test_a_gateway_starts_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    cmd = [
        sys.executable,
        "-m",
        "weir.cli",
        "gateway",
        "--http-port",
        "0",
        "--bootstrap",
        BOOTSTRAP,
        "--topic-prefix",
        f"wheel-{uuid.uuid4().hex[:8]}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=_environment(installed, tmp_path), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        found = _wait_for_line(log, r"gateway serving (http://[\d.]+:\d+)", proc, 120)
        with urllib.request.urlopen(f"{found.group(1)}/healthz", timeout=5) as resp:
            assert resp.status == 200
        with pytest.raises(urllib.error.HTTPError) as not_ready:  # no worker: up, but not ready
            urllib.request.urlopen(f"{found.group(1)}/readyz", timeout=5)
        assert not_ready.value.code == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(60)
    assert returncode == 0, log.read_text(errors="replace")[-4000:]
    assert "FileNotFoundError" not in log.read_text(errors="replace")
