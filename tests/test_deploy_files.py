"""docker-compose.yml and the broker POM agree with the launcher (no Docker engine needed)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from weir.cli import DELEGATED
from weir.kafka import launcher

REPO = Path(__file__).resolve().parents[1]
WEIR_SERVICES = ("gateway", "batcher", "worker", "auditor")


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_kafka_version_is_pinned_once_everywhere() -> None:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    pom = ET.parse(launcher.POM).getroot()
    assert pom.findtext("m:properties/m:kafka.version", namespaces=ns) == launcher.KAFKA_VERSION
    assert _compose()["services"]["kafka"]["image"] == f"apache/kafka:{launcher.KAFKA_VERSION}"


def test_each_service_runs_its_weir_subcommand_after_topic_init() -> None:
    services = _compose()["services"]
    for name in WEIR_SERVICES:
        service = services[name]
        assert service["command"] == ["weir", name] and name in DELEGATED
        assert service["environment"]["WEIR_KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert service["depends_on"]["kafka"]["condition"] == "service_healthy"
        assert service["depends_on"]["topic-init"]["condition"] == "service_completed_successfully"
        assert "healthcheck" in service
    assert services["topic-init"]["command"][:3] == ["weir", "topics", "create"]
    assert services["gateway"]["environment"]["WEIR_GATEWAY_HOST"] == "0.0.0.0"


def test_compose_cluster_id_is_a_kafka_uuid() -> None:
    cluster_id = _compose()["services"]["kafka"]["environment"]["CLUSTER_ID"]
    assert len(cluster_id) == 22 and not cluster_id.startswith("-")


def test_each_service_is_healthy_when_its_own_readyz_says_so() -> None:
    from weir.launcher import DEFAULT_HTTP_PORTS

    services = _compose()["services"]
    for name in WEIR_SERVICES:
        check = " ".join(services[name]["healthcheck"]["test"])
        assert f"http://127.0.0.1:{DEFAULT_HTTP_PORTS[name]}/readyz" in check, name


def test_compose_holds_no_audit_key_and_shares_the_generated_one() -> None:
    """The audit key is made once into $WEIR_HOME on a volume the services share (docs/auditor.md);
    no key is written in the compose file."""
    compose_text = (REPO / "docker-compose.yml").read_text()
    assert "WEIR_AUDIT_HMAC_KEY" not in compose_text
    assert "WEIR_AUDIT_CHECKPOINT_KEY" not in compose_text  # the auditor's checkpoint key: the same volume
    services = _compose()["services"]
    for name in WEIR_SERVICES:
        home = services[name]["environment"]["WEIR_HOME"]
        assert f"weir-home:{home}" in services[name]["volumes"], name
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"chown weir /data {home}" in dockerfile  # the volume takes the folder's owner
