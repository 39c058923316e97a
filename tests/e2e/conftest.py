"""The whole pipeline as processes (auditor, worker, batcher, gateway) on the real broker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from schemas.model_repo import load_model_repo
from schemas.topics import Topics
from weir.kafka.admin import deployment_specs, ensure_topics
from weir.stack import SERVICES, Stack, wait_http_ok

REPO_ROOT = Path(__file__).resolve().parents[2]
from tests.conftest import BOOTSTRAP  # noqa: E402 - WEIR_KAFKA_BOOTSTRAP, else 127.0.0.1:9092

# The worker of these tests serves every model of models.toml but those imported from a GGUF file
# (SmolLM2: a 540 MB import and a slower model); weir-tiny-py is the fast model of the suite.
TEST_MODELS = ",".join(
    name
    for name, c in load_model_repo(REPO_ROOT / "models.toml").models.items()
    if not (c.engine == "torch" and c.source)
)


@dataclass
class Pipeline:
    stack: Stack
    topics: Topics
    base_url: str
    audit_db: Path
    bootstrap: str = BOOTSTRAP

    def wait_ready(self, timeout_s: float = 180) -> None:
        wait_http_ok(f"{self.base_url}/readyz", timeout_s, self.stack)


def start_pipeline(tmp: Path, bootstrap: str = BOOTSTRAP, **extra_env: str) -> Pipeline:
    """A fresh topic prefix, then the four services on `bootstrap`; waits for /readyz. Each service's
    HTTP port (the gateway's: WEIR_GATEWAY_PORT of `extra_env` when given) is bound by the stack and
    passed down, never picked and released (weir/stack.py: Stack.listeners)."""
    topics = Topics(f"e2e{uuid.uuid4().hex[:8]}")
    model_repo = REPO_ROOT / "models.toml"
    asyncio.run(ensure_topics(bootstrap, deployment_specs(topics, load_model_repo(model_repo))))
    audit_db = tmp / "audit.sqlite"
    env = {
        "WEIR_KAFKA_BOOTSTRAP": bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_MODEL_REPO": str(model_repo),
        "WEIR_AUDIT_DB": str(audit_db),
        "PYTHONUNBUFFERED": "1",
        "WEIR_AUTH_MODE": "open",
        "WEIR_MODELS": TEST_MODELS,
        **extra_env,
    }
    stack = Stack(env, tmp / "logs")
    for name in SERVICES:
        stack.start(name)
    pipeline = Pipeline(stack, topics, stack.url("gateway"), audit_db, bootstrap)
    try:
        pipeline.wait_ready()
    except BaseException:
        for name in SERVICES:
            print(f"--- {name} ---\n{stack.log_tail(name)}")
        stack.stop_all()
        raise
    return pipeline


def weir_models(p: Pipeline, *args: str) -> str:
    """`weir models ARGS` against the pipeline's broker and topics; its output (asserts exit 0)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **p.stack.env}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "weir.cli",
            "models",
            *args,
            "--bootstrap",
            p.bootstrap,
            "--topic-prefix",
            p.topics.prefix,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"weir models {' '.join(args)}: {done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    """One stack shared by every e2e module that does not need its own settings or kill its
    processes (a stack costs about a minute of CI to start)."""
    p = start_pipeline(tmp_path_factory.mktemp("pipeline"))
    yield p
    p.stack.stop_all()


@pytest.fixture(scope="session")
def lifecycle_pipeline(tmp_path_factory):
    """One stack for the model-lifecycle modules (swap, traffic policies): weir-tiny-py and echo, a
    short drain, no fingerprints. They register versions under different names, so they share it."""
    tmp = tmp_path_factory.mktemp("lifecycle")
    p = start_pipeline(
        tmp, WEIR_MODELS="weir-tiny-py,echo", WEIR_AUDIT_FINGERPRINT_MODEL="", WEIR_DRAIN_QUIET_MS="1000"
    )
    yield p
    p.stack.stop_all()
