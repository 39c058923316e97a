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


def _compose_secure_services() -> dict:
    return yaml.safe_load((REPO / "docker-compose.secure.yml").read_text())["services"]


def test_secure_compose_logs_each_service_in_as_its_own_principal() -> None:
    from weir.kafka import security

    base, secure = _compose()["services"], _compose_secure_services()
    assert "WEIR_KAFKA_USER" not in (REPO / "docker-compose.yml").read_text()  # the default stays open
    assert tuple(security.SERVICES) == WEIR_SERVICES
    for name in WEIR_SERVICES:
        assert name in base
        assert secure[name]["environment"] == {"WEIR_KAFKA_SECURITY": "sasl", "WEIR_KAFKA_USER": name}
    init = secure["topic-init"]
    assert init["command"][:3] == ["weir", "topics", "create"] and "--acls" in init["command"]
    assert init["environment"]["WEIR_KAFKA_USER"] == security.ADMIN
    assert secure["kafka-secrets"]["command"] == ["weir", "kafka", "secrets"]
    assert secure["kafka"]["depends_on"]["kafka-secrets"]["condition"] == "service_completed_successfully"
    assert "./scripts/secure-kafka.sh:/opt/weir/secure-kafka.sh:ro" in secure["kafka"]["volumes"]
    assert secure["kafka"]["command"] == ["bash", "/opt/weir/secure-kafka.sh"]
    for text in ((REPO / "docker-compose.yml").read_text(), (REPO / "docker-compose.secure.yml").read_text()):
        assert "password=" not in text.replace(" ", "")  # passwords are made per deployment, never written here


def test_secure_broker_script_matches_the_launchers_secure_settings() -> None:
    """scripts/secure-kafka.sh (the compose broker) sets what `weir kafka up --secure` sets, and
    bootstraps the same principals."""
    from weir.kafka import security

    script = (REPO / "scripts" / "secure-kafka.sh").read_text()
    cfg = launcher.BrokerConfig(secure=True)
    props = launcher._secure_properties(cfg, {security.ADMIN: "A", security.CONTROLLER: "C"})
    for key, value in props.items():
        if key in ("listeners", "advertised.listeners", "listener.security.protocol.map"):
            assert f"{key}=" in script  # its own addresses, plus the host's EXTERNAL listener
            continue
        expected = value.replace('"A"', '"$admin"').replace('"C"', '"$controller"')
        expected = expected.replace("org.apache.kafka.common.security.scram.ScramLoginModule", "$scram")
        expected = expected.replace("org.apache.kafka.common.security.plain.PlainLoginModule", "$plain")
        assert f"{key}={expected}\n" in script, key
    users = [security.ADMIN, *security.SERVICES, security.DEFAULT_CLIENT]
    assert f"for user in {' '.join(users)}; do\n      printf" in script
