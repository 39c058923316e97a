"""docker-compose.yml and the broker POM agree with the launcher (no Docker engine needed)."""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from weir.cli import DELEGATED
from weir.kafka import launcher

REPO = Path(__file__).resolve().parents[1]
WEIR_SERVICES = ("gateway", "batcher", "worker", "auditor")
KAFKA_NODES = ("kafka-1", "kafka-2", "kafka-3")


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_kafka_version_is_pinned_once_everywhere() -> None:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    pom = ET.parse(launcher.POM).getroot()
    assert pom.findtext("m:properties/m:kafka.version", namespaces=ns) == launcher.KAFKA_VERSION
    for node in KAFKA_NODES:
        assert _compose()["services"][node]["image"] == f"apache/kafka:{launcher.KAFKA_VERSION}"


def test_each_service_runs_its_weir_subcommand_after_topic_init() -> None:
    services = _compose()["services"]
    for name in WEIR_SERVICES:
        service = services[name]
        assert service["command"][-2:] == ["weir", name] or service["command"][-1].endswith(f"exec weir {name}")
        assert name in DELEGATED
        assert service["environment"]["WEIR_KAFKA_BOOTSTRAP"] == "kafka-1:9092,kafka-2:9092,kafka-3:9092"
        assert all(service["depends_on"][node]["condition"] == "service_healthy" for node in KAFKA_NODES)
        assert service["depends_on"]["topic-init"]["condition"] == "service_completed_successfully"
        assert "healthcheck" in service
    assert services["topic-init"]["command"][:3] == ["weir", "topics", "create"]
    assert services["gateway"]["environment"]["WEIR_GATEWAY_HOST"] == "0.0.0.0"


def test_compose_cluster_id_is_a_kafka_uuid() -> None:
    cluster_id = _compose()["services"]["kafka-1"]["environment"]["CLUSTER_ID"]
    assert len(cluster_id) == 22 and not cluster_id.startswith("-")


def test_compose_kafka_is_a_three_node_cluster_as_the_launcher_makes_one() -> None:
    """The compose cluster's nodes: combined roles, one voter list and cluster id, their own data
    volume and host port, and the replication the launcher gives a local cluster of three."""
    services = _compose()["services"]
    local = dict(
        line.split("=", 1)
        for line in launcher.render_server_properties(
            launcher.cluster_configs(port=19100, brokers=3, data_dir=REPO / "var" / "unused")[0]
        ).splitlines()[1:]
    )
    envs = [services[node]["environment"] for node in KAFKA_NODES]
    assert {env["CLUSTER_ID"] for env in envs} == {envs[0]["CLUSTER_ID"]}
    assert [env["KAFKA_NODE_ID"] for env in envs] == [1, 2, 3]
    for i, (node, env) in enumerate(zip(KAFKA_NODES, envs, strict=True)):
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{node}:9092,EXTERNAL://localhost:{29092 + i}"
        assert services[node]["ports"] == [f"{29092 + i}:{29092 + i}"]
        assert services[node]["volumes"] == [f"{node}-data:/var/lib/kafka/data"]
        for key in (
            "default.replication.factor",
            "min.insync.replicas",
            "offsets.topic.replication.factor",
            "transaction.state.log.replication.factor",
            "transaction.state.log.min.isr",
            "share.coordinator.state.topic.replication.factor",
            "share.coordinator.state.topic.min.isr",
            "broker.session.timeout.ms",
            "broker.heartbeat.interval.ms",
        ):
            assert str(env["KAFKA_" + key.upper().replace(".", "_")]) == local[key], (node, key)


def test_each_service_is_healthy_when_its_own_readyz_says_so() -> None:
    from weir.stack import DEFAULT_HTTP_PORTS

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
    for text in ((REPO / "docker-compose.yml").read_text(), (REPO / "docker-compose.secure.yml").read_text()):
        assert "password=" not in text.replace(" ", "")  # passwords are made per deployment, never written here


def test_secure_compose_runs_each_node_of_the_cluster_securely() -> None:
    """The overlay makes every node of the base file's cluster (and no other broker) a secure node,
    on its own data volume, after the passwords exist, healthy when it answers `admin`."""
    base, secure = _compose()["services"], _compose_secure_services()
    assert {name for name in secure if name.startswith("kafka") and name != "kafka-secrets"} == set(KAFKA_NODES)
    for node in KAFKA_NODES:
        overlay = secure[node]
        assert overlay["user"] == "1000" and overlay["command"] == ["bash", "/opt/weir/secure-kafka.sh"]
        assert overlay["depends_on"]["kafka-secrets"]["condition"] == "service_completed_successfully"
        assert set(base[node]["volumes"]) < set(overlay["volumes"])  # its own data volume, as the base names it
        script = "./scripts/secure-kafka.sh:/opt/weir/secure-kafka.sh:ro"
        assert {"weir-home:/var/lib/weir:ro", script} < set(overlay["volumes"])
        test = overlay["healthcheck"]["test"]
        assert test[test.index("--command-config") + 1] == "/tmp/weir-kafka/admin.properties"


def _secure_node_properties(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    """The server.properties scripts/secure-kafka.sh writes with `env`: run with a `java` that does
    nothing (no jars needed), so its storage format and its broker are no-ops."""
    from weir.kafka import security

    stub = tmp_path / "bin" / "java"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    for user in (security.ADMIN, security.CONTROLLER, *security.SERVICES, security.DEFAULT_CLIENT):
        security.ensure_password(user, tmp_path / "secrets")
    run_env = {
        "PATH": f"{stub.parent}:/usr/bin:/bin",
        "WEIR_KAFKA_SECRETS": str(tmp_path / "secrets"),
        "KAFKA_DATA_DIR": str(tmp_path / "data"),
        "KAFKA_CONF_DIR": str(tmp_path / "conf"),
        **env,
    }
    subprocess.run(["bash", str(REPO / "scripts" / "secure-kafka.sh")], env=run_env, check=True, timeout=30)
    return _properties((tmp_path / "conf" / "server.properties").read_text())


_NODE_KEYS = (
    "default.replication.factor",
    "min.insync.replicas",
    "offsets.topic.replication.factor",
    "transaction.state.log.replication.factor",
    "transaction.state.log.min.isr",
    "share.coordinator.state.topic.replication.factor",
    "share.coordinator.state.topic.min.isr",
    "broker.session.timeout.ms",
    "broker.heartbeat.interval.ms",
    "group.min.session.timeout.ms",
)


def test_secure_broker_script_makes_each_compose_node_as_the_launcher_makes_a_cluster_node(tmp_path: Path) -> None:
    """With kafka-2's environment (the base file's and the overlay's), the script writes node 2 of
    the base file's voters, its own addresses, and the replication the launcher gives a node of a
    cluster of three; with none (the defaults), the single node of before, as the launcher's one."""
    env = {key: str(value) for key, value in _compose()["services"]["kafka-2"]["environment"].items()}
    env.update(_compose_secure_services()["kafka-2"]["environment"])
    props = _secure_node_properties(tmp_path / "node", env)
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
    assert props["advertised.listeners"] == "SASL_PLAINTEXT://kafka-2:9092,EXTERNAL://localhost:29093"
    assert props["listeners"] == "SASL_PLAINTEXT://:9092,EXTERNAL://:29093,CONTROLLER://:9093"
    cluster = _properties(
        launcher.render_server_properties(
            launcher.cluster_configs(port=19100, brokers=3, data_dir=REPO / "var" / "unused")[1]
        )
    )
    assert {key: props[key] for key in _NODE_KEYS} == {key: cluster[key] for key in _NODE_KEYS}
    assert (tmp_path / "node" / "conf" / "format.args").exists() is False  # the passwords' argfile is gone

    single = _secure_node_properties(tmp_path / "single", {"CLUSTER_ID": "i91_4w3CRKaqx55nxs7NVg"})
    alone = _properties(launcher.render_server_properties(launcher.BrokerConfig()))
    assert (single["node.id"], single["controller.quorum.voters"]) == ("1", "1@kafka:9093")
    assert {key: single.get(key) for key in _NODE_KEYS} == {key: alone.get(key) for key in _NODE_KEYS}


def test_secure_broker_script_refuses_a_node_outside_its_voters(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        _secure_node_properties(
            tmp_path,
            {
                "CLUSTER_ID": "i91_4w3CRKaqx55nxs7NVg",
                "KAFKA_NODE_ID": "4",
                "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@a:9093,2@b:9093,3@c:9093",
            },
        )


def _properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


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


# ---- Prometheus and Grafana --------------------------------------------------------------------

_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def _exported_names() -> set[str]:
    """Every metric name this tree exports: vLLM's (weir/metrics.py VLLM_NAMES) and each name
    written out in the services' and weir/'s source, with the exporter's suffixes."""
    from weir.metrics import VLLM_NAMES

    bases = {f"vllm:{name}" for name in VLLM_NAMES}
    for path in [*(REPO / "services").rglob("*.py"), *(REPO / "weir").rglob("*.py")]:
        text = path.read_text()
        bases |= set(re.findall(r"\b((?:weir|kafka|gen_ai)_[a-z0-9_]+)\b", text))
        # OpenTelemetry's dotted GenAI names, as the exporter writes them: '_' for '.', and
        # '_seconds' for unit "s" ('{token}' adds nothing)
        for name in re.findall(r"\b(gen_ai(?:\.[a-z_]+)+)\b", text):
            bases |= {name.replace(".", "_"), name.replace(".", "_") + "_seconds"}
    return {base + suffix for base in bases for suffix in _SUFFIXES}


def _board_metrics(board: dict) -> set[str]:
    """The metric names in the board's PromQL (identifiers that are not functions, keywords or labels)."""
    words: set[str] = set()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", target["expr"])  # grouping labels
            expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
            words |= {
                w
                for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?![a-zA-Z0-9_:]*\s*\()", expr)
                if w not in {"le", "sum", "max", "rate"}
            }
    return words


def test_prometheus_and_grafana_run_beside_the_services_provisioned_from_files() -> None:
    import json

    services = _compose()["services"]
    assert services["prometheus"]["image"].startswith("prom/prometheus:v")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    mounts = {volume.split(":")[0]: volume.split(":")[1] for volume in services["grafana"]["volumes"]}
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboards_dir = mounts["./docs/grafana/weir.json"].rsplit("/", 1)[0]
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/weir.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == dashboards_dir
    source = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    [datasource] = source["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
    board = json.loads((REPO / "docs/grafana/weir.json").read_text())
    uids = {t["datasource"]["uid"] for p in board["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}


def test_prometheus_scrapes_every_service_on_its_own_port() -> None:
    from weir.stack import DEFAULT_HTTP_PORTS

    config = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"]
        for job in config["scrape_configs"]
        if "static_configs" in job
    }
    # a replicated service: every replica, found by the A records of its name
    targets |= {
        job["job_name"]: [f"{n}:{c['port']}" for c in job["dns_sd_configs"] if c["type"] == "A" for n in c["names"]]
        for job in config["scrape_configs"]
        if "dns_sd_configs" in job
    }
    assert targets == {name: [f"{name}:{DEFAULT_HTTP_PORTS[name]}"] for name in WEIR_SERVICES}
    replicated = {name for name in WEIR_SERVICES if "deploy" in _compose()["services"][name]}
    assert replicated and all(
        "dns_sd_configs" in job for job in config["scrape_configs"] if job["job_name"] in replicated
    )
    services = _compose()["services"]
    assert all(services[name]["environment"]["WEIR_HTTP_HOST"] == "0.0.0.0" for name in WEIR_SERVICES)


def test_the_grafana_board_names_only_metrics_that_are_exported() -> None:
    import json

    board = json.loads((REPO / "docs/grafana/weir.json").read_text())
    used = _board_metrics(board)
    exported = _exported_names()
    assert used - exported == set()
    assert {
        "vllm:kv_cache_usage_perc",
        "kafka_consumergroup_lag",
        "weir_gateway_time_to_first_token_seconds_bucket",
        "weir_model_alert",
        "vllm:prefix_cache_hits_total",
    } <= used


def test_the_board_checker_finds_a_metric_nobody_exports() -> None:
    board = {"panels": [{"targets": [{"expr": "sum by (model_name) (rate(weir_nonexistent_total[5m]))"}]}]}
    assert _board_metrics(board) - _exported_names() == {"weir_nonexistent_total"}


def test_gateways_and_workers_run_as_replicas_each_with_its_own_id() -> None:
    """deploy.replicas of each: every gateway replica its own host port and reply topic, every
    worker its own instance name, both from the container's HOSTNAME unless set (docs/design.md,
    "Scale-out and failover")."""
    from weir.stack import DEFAULT_HTTP_PORTS

    services = _compose()["services"]
    for name, variable in (("gateway", "WEIR_GATEWAY_ID"), ("worker", "WEIR_WORKER_INSTANCE")):
        service = services[name]
        assert service["deploy"]["replicas"] >= 2 and "container_name" not in service and "hostname" not in service
        assert variable not in service["environment"], "one id shared by every replica"
        shell, flag, script = service["command"]
        assert (shell, flag) == ("sh", "-c")
        # compose turns $$ into $: the shell sees ${VAR:-name-$HOSTNAME} and execs the service
        assert script == f"{variable}=$${{{variable}:-{name}-$$HOSTNAME}} exec weir {name}"
    low, high = services["gateway"]["ports"][0].split(":")[0].split("-")
    assert int(high) - int(low) + 1 == services["gateway"]["deploy"]["replicas"]  # a host port for each
    assert services["gateway"]["ports"][0].split(":")[1] == str(DEFAULT_HTTP_PORTS["gateway"])
