"""Run a real single-node Apache Kafka broker (KRaft, combined roles) from Maven Central jars.

Layout, all under one data dir (default $WEIR_HOME/kafka/broker-<port>), which survives restarts:

    server.properties   rewritten on every start from BrokerConfig
    cluster.id          chosen once; storage is formatted once with it
    logs/               Kafka's log.dirs (topic data and KRaft metadata)
    kafka.pid, kafka.log
    security            "plaintext" or "sasl": how the storage was formatted (secure mode below)

A secure broker (BrokerConfig.secure, `weir kafka up --secure`) takes clients on SASL_PLAINTEXT
with SCRAM-SHA-512 only, authorizes every request with Kafka's StandardAuthorizer (no ACL: denied),
and is formatted with the SCRAM credentials of the deployment's principals, whose passwords are
made once into $WEIR_HOME/secrets/kafka (weir/kafka/security.py; docs/kafka.md, "Secure mode").
A data dir keeps the mode it was formatted with: starting it in the other mode is refused.

A cluster (`cluster_configs(brokers=3)`, `weir kafka up --brokers 3`) is one such node per process,
each a KRaft controller and a broker, with its own data dir ($WEIR_HOME/kafka/cluster-<port>/node-<i>)
and ports (node i: client port+2(i-1), controller port+2(i-1)+1), one static voter list and one
cluster id (cluster-<port>/cluster.id) that every node is formatted with (docs/kafka.md, "A cluster").

The jars live in $WEIR_HOME/kafka/<version>/lib, resolved once with Maven from weir/kafka/pom.xml.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.errors import KafkaError

from schemas.topics import replication_for
from weir.home import weir_home
from weir.kafka import class_cache, security
from weir.kafka.admin import broker_ids, wait_for_broker

KAFKA_VERSION = "4.4.0"  # keep in step with pom.xml and docker-compose.yml
HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
LOG4J2_CONFIG = HERE / "log4j2.properties"
HEAP_OPTS = ("-Xms256m", "-Xmx768m")
# Each node of a cluster: three JVMs share the box, and a node's heap held the deployment's topics
# with room to spare (docs/kafka.md, "A cluster").
CLUSTER_HEAP_OPTS = ("-Xms128m", "-Xmx384m")
# Node counts `cluster_configs` accepts: a static KRaft quorum of n voters survives (n - 1) // 2
# losses, so 2 nodes survive none (no better than 1) and 4 no more than 3.
CLUSTER_SIZES = (1, 3, 5)
# TieredStopAtLevel=1: C1-compiled code only. C2 spent half of the broker's start compiling on a
# 2-core box: from launch to its port open 8.9 CPU s and 8.6-11.1 s without, 4.6-4.9 CPU s and
# 5.2-5.4 s with; and a hop a minute after start (`weir bench hop`, same box and load) was 5.1-5.9
# ms p50 without (C2 still compiling), 4.2 ms with. docs/kafka.md, "Start-up".
JVM_OPTS = (
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:TieredStopAtLevel=1",
    "-Djava.awt.headless=true",
)
MAVEN_COPY = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies"


class BrokerError(RuntimeError):
    """The broker could not be resolved, formatted, started or reached; the message says why."""


@dataclass(frozen=True)
class BrokerConfig:
    """Where one local broker listens and keeps its data."""

    port: int = 9092
    controller_port: int = 0  # 0: port + 1
    host: str = "127.0.0.1"
    data_dir: Path | None = None  # None: $WEIR_HOME/kafka/broker-<port>
    version: str = KAFKA_VERSION
    overrides: dict[str, str] = field(default_factory=dict)  # extra server.properties entries
    secure: bool = False  # SASL/SCRAM and ACLs (module docstring)
    secrets_dir: Path | None = None  # None: $WEIR_HOME/secrets/kafka
    node_id: int = 1
    voters: tuple[str, ...] = ()  # "<id>@<host>:<controller port>" of every node; (): this node alone
    cluster_home: Path | None = None  # a cluster's shared dir (its cluster.id); None: a single broker
    heap_opts: tuple[str, ...] = HEAP_OPTS

    def __post_init__(self) -> None:
        if not self.controller_port:
            object.__setattr__(self, "controller_port", self.port + 1)

    @classmethod
    def from_env(cls, **given: object) -> BrokerConfig:
        """Build from WEIR_KAFKA_PORT, WEIR_KAFKA_CONTROLLER_PORT, WEIR_KAFKA_DATA_DIR; `given` wins."""
        env = os.environ
        values: dict[str, object] = {}
        if "WEIR_KAFKA_PORT" in env:
            values["port"] = int(env["WEIR_KAFKA_PORT"])
        if "WEIR_KAFKA_CONTROLLER_PORT" in env:
            values["controller_port"] = int(env["WEIR_KAFKA_CONTROLLER_PORT"])
        if "WEIR_KAFKA_DATA_DIR" in env:
            values["data_dir"] = Path(env["WEIR_KAFKA_DATA_DIR"])
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]  # values from env and arguments, of the fields' types

    @property
    def bootstrap(self) -> str:
        """host:port for clients."""
        return f"{self.host}:{self.port}"

    @property
    def home(self) -> Path:
        """The data dir, resolved."""
        return (self.data_dir or weir_home() / "kafka" / f"broker-{self.port}").resolve()

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    @property
    def quorum(self) -> tuple[str, ...]:
        """The controller quorum's voters: the cluster's, else this node alone."""
        return self.voters or (f"{self.node_id}@{self.host}:{self.controller_port}",)

    @property
    def cluster_id_file(self) -> Path:
        """Where the id every node of the cluster is formatted with is kept (made once)."""
        return (self.cluster_home.resolve() if self.cluster_home else self.home) / "cluster.id"

    @property
    def pid_file(self) -> Path:
        return self.home / "kafka.pid"

    @property
    def log_file(self) -> Path:
        return self.home / "kafka.log"

    @property
    def properties_file(self) -> Path:
        return self.home / "server.properties"

    @property
    def security_file(self) -> Path:
        return self.home / "security"

    @property
    def secrets(self) -> Path:
        """Where the principals' password files are."""
        return (self.secrets_dir or security.secrets_dir()).resolve()

    def admin_options(self) -> dict[str, str]:
        """aiokafka keyword arguments of this broker's super user ({} for a plaintext broker);
        KafkaSecurityError when its password file is not there (start() makes it)."""
        if not self.secure:
            return {}
        password = security.read_password(security.password_path(security.ADMIN, self.secrets))
        return security.Credentials(security.ADMIN, password).client_options()


def broker_users(cfg: BrokerConfig) -> dict[str, str]:
    """{user: password} of the principals a secure broker is formatted with (each made once)."""
    users = [security.ADMIN, *security.SERVICES, security.DEFAULT_CLIENT]
    return {user: security.ensure_password(user, cfg.secrets) for user in users}


def render_server_properties(cfg: BrokerConfig, passwords: dict[str, str] | None = None) -> str:
    """server.properties for one node with combined broker+controller roles (alone, or one of
    cfg.voters); a secure one needs the `passwords` of security.ADMIN and security.CONTROLLER.
    A cluster's replication defaults (auto-created and internal topics) follow replication_for:
    docs/design.md, "Scale-out and failover"."""
    replicas = replication_for(len(cfg.quorum))
    insync = str(min(2, replicas))  # as TopicSpec's default: one replica of three may be lost
    props = {
        "process.roles": "broker,controller",
        "node.id": str(cfg.node_id),
        "controller.quorum.voters": ",".join(cfg.quorum),
        "listeners": f"PLAINTEXT://{cfg.host}:{cfg.port},CONTROLLER://{cfg.host}:{cfg.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{cfg.host}:{cfg.port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(cfg.log_dir),
        # Plain clients may name their own reply topic: let the broker create it on first use.
        "auto.create.topics.enable": "true",
        "num.partitions": "1",
        "default.replication.factor": str(replicas),
        "min.insync.replicas": insync,
        "offsets.topic.replication.factor": str(replicas),
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": insync,
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": insync,
        # The default 3000 ms delays every first group join by 3 s.
        "group.initial.rebalance.delay.ms": "0",
        # Lets kill tests use short consumer session timeouts (default minimum 6000 ms).
        "group.min.session.timeout.ms": "1000",
        # A small machine: few threads, a small compaction buffer (taken from the heap).
        "num.io.threads": "2",
        "num.network.threads": "2",
        "num.recovery.threads.per.data.dir": "1",
        "background.threads": "4",
        "log.cleaner.threads": "1",
        "log.cleaner.dedupe.buffer.size": str(32 * 1024 * 1024),
    }
    if len(cfg.quorum) > 1:
        # The controller fences a broker that stopped heartbeating after this long, and only then
        # moves its partitions' leadership: Kafka's 9 s default was the whole write stall of a
        # broker killed under an acks=all producer here (tests/test_kafka_cluster.py).
        props.update({"broker.heartbeat.interval.ms": "500", "broker.session.timeout.ms": "3000"})
    if cfg.secure:
        if not passwords or not {security.ADMIN, security.CONTROLLER} <= passwords.keys():
            raise ValueError("a secure broker's properties need the admin and controller passwords")
        props.update(_secure_properties(cfg, passwords))
    props.update(cfg.overrides)
    lines = ["# Written by weir/kafka/launcher.py on every start; edit BrokerConfig instead."]
    lines += [f"{key}={value}" for key, value in props.items()]
    return "\n".join(lines) + "\n"


def _secure_properties(cfg: BrokerConfig, passwords: dict[str, str]) -> dict[str, str]:
    """SASL_PLAINTEXT with SCRAM-SHA-512 for clients and the broker itself (its super user `admin`);
    SASL/PLAIN with a static login for the KRaft controller listener (SCRAM credentials live in the
    metadata that listener serves, so KRaft cannot use SCRAM there); StandardAuthorizer, deny by
    default. No TLS: the listeners are on cfg.host (loopback by default), where nobody can read
    the traffic; a broker reachable from other machines needs SASL_SSL (docs/kafka.md)."""
    admin, controller = passwords[security.ADMIN], passwords[security.CONTROLLER]
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
    plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
    return {
        "listeners": f"SASL_PLAINTEXT://{cfg.host}:{cfg.port},CONTROLLER://{cfg.host}:{cfg.controller_port}",
        "advertised.listeners": f"SASL_PLAINTEXT://{cfg.host}:{cfg.port}",
        "inter.broker.listener.name": "SASL_PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
        "sasl.enabled.mechanisms": security.MECHANISM,
        "sasl.mechanism.inter.broker.protocol": security.MECHANISM,
        "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config": f'{scram} required username="{security.ADMIN}" password="{admin}";',
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": f'{plain} required username="{security.CONTROLLER}" password="{controller}" '
        f'user_{security.CONTROLLER}="{controller}";',
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{security.ADMIN};User:{security.CONTROLLER}",
    }


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (several processes may start or resolve at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def lib_dir(version: str = KAFKA_VERSION) -> Path:
    """Where the jars of `version` are cached."""
    return weir_home() / "kafka" / version / "lib"


def jars_resolved(version: str = KAFKA_VERSION) -> bool:
    """True once resolve_jars(version) has run here (no Maven needed)."""
    return (lib_dir(version) / ".complete").exists()


JAR_PINS = HERE / "jars.sha256"  # made by scripts/pin_kafka_jars.py; docs/supply-chain.md


def jar_pins(version: str = KAFKA_VERSION) -> dict[str, tuple[str, str]]:
    """{jar file name: (sha256, Maven group:artifact:version)} that jars.sha256 pins for `version`."""
    pinned_version, pins = None, {}
    for line in JAR_PINS.read_text().splitlines():
        if line.startswith("# kafka.version "):
            pinned_version = line.split()[-1]
        elif line.strip() and not line.startswith("#"):
            sha256, name, coordinates = line.split()
            pins[name] = (sha256, coordinates)
    if pinned_version != version:
        raise BrokerError(
            f"{JAR_PINS} pins the jars of Kafka {pinned_version}, not {version}: "
            "pin that version's with scripts/pin_kafka_jars.py first"
        )
    return pins


def verify_jars(lib: Path, version: str = KAFKA_VERSION) -> None:
    """Refuse, naming the file, a lib dir whose jars are not exactly the pinned ones: a missing,
    extra (the class path is lib/*) or altered jar. Kafka 4.4.0's 45 jars (43 MB) take 0.05 CPU s
    (0.12-0.15 s on a busy 2-core box), so every start checks them all, with no cache to trust."""
    pins = jar_pins(version)
    present = {p.name for p in lib.iterdir() if p.name != ".complete"}
    if extra := sorted(present - pins.keys()):
        raise BrokerError(f"{lib}: {extra[0]} is not a pinned Kafka {version} jar ({JAR_PINS})")
    if missing := sorted(pins.keys() - present):
        raise BrokerError(f"{lib}: the pinned jar {missing[0]} is missing")
    for name, (sha256, _) in sorted(pins.items()):
        with open(lib / name, "rb") as jar:
            if hashlib.file_digest(jar, "sha256").hexdigest() != sha256:
                raise BrokerError(f"{lib / name}: sha256 differs from the pinned {sha256} ({JAR_PINS})")


def resolve_jars(version: str = KAFKA_VERSION) -> Path:
    """Copy the broker's runtime jars into lib_dir(version) with Maven, once, and check them
    against jars.sha256 then and on every later call (each start); returns that dir."""
    lib = lib_dir(version)
    done = lib / ".complete"
    if done.exists():
        verify_jars(lib, version)
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("mvn not found on PATH; install Maven (apt-get install maven) to fetch Kafka")
    with _locked(lib.parent / ".resolve.lock"):
        if done.exists():
            verify_jars(lib, version)
            return lib
        staging = lib.parent / "lib.partial"
        shutil.rmtree(staging, ignore_errors=True)
        cmd = [
            mvn,
            "-B",
            "-q",
            "-f",
            str(POM),
            MAVEN_COPY,
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging}",
            f"-Dkafka.version={version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BrokerError(f"resolving Kafka {version} jars failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        verify_jars(staging, version)  # before .complete: a refused copy is fetched again next time
        shutil.rmtree(lib, ignore_errors=True)
        staging.rename(lib)
        done.write_text(f"{version}\n")
    return lib


def _java() -> str:
    if home := os.environ.get("JAVA_HOME"):
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise BrokerError("java not found on PATH; install a JDK 17+ (apt-get install openjdk-17-jre-headless)")
    return java


def new_cluster_id() -> str:
    """A random cluster id in Kafka's Uuid text form (URL-safe base64, no padding)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):  # Kafka never makes ids that look like a CLI flag
            return text


def format_storage(cfg: BrokerConfig, lib: Path, scram_users: dict[str, str] | None = None) -> None:
    """Format log.dirs once, with the SCRAM credentials of `scram_users` ({user: password}) for a
    secure broker; an already formatted data dir is left as it is, but must be in cfg's mode."""
    mode = "sasl" if cfg.secure else "plaintext"
    if (cfg.log_dir / "meta.properties").exists():
        formatted = cfg.security_file.read_text().strip() if cfg.security_file.exists() else "plaintext"
        if formatted != mode:
            raise BrokerError(
                f"{cfg.home} was formatted as a {formatted} broker, and cannot be started as a "
                f"{mode} one (its users and ACLs would be {'lost' if formatted == 'sasl' else 'missing'}); "
                "use another --data-dir, or delete this one"
            )
        return
    cluster_id = _cluster_id(cfg.cluster_id_file)
    args = ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(cfg.properties_file)]
    for user, password in (scram_users or {}).items():
        args += ["--add-scram", f"{security.MECHANISM}=[name={user},password={password}]"]
    # The arguments go in a private @argfile, so no password shows in the process list.
    argfile = cfg.home / ".format.args"
    argfile.unlink(missing_ok=True)
    fd = os.open(argfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(f'"{arg}"' for arg in args) + "\n")
    try:
        # (-cp stays outside: the launcher expands no class-path wildcard read from an @argfile)
        cmd = [_java(), "-Xmx256m", f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}", "-cp", f"{lib}/*", f"@{argfile}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        argfile.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise BrokerError(f"formatting {cfg.log_dir} failed:\n{proc.stdout}{proc.stderr}")
    cfg.security_file.write_text(mode + "\n")


def _cluster_id(id_file: Path) -> str:
    """The id in `id_file`, chosen now if it has none (once: the nodes of a cluster may race)."""
    with _locked(id_file.with_name(".cluster-id.lock")):
        if not id_file.exists():
            id_file.write_text(new_cluster_id() + "\n")
        return id_file.read_text().strip()


def _write_private(path: Path, text: str) -> None:
    """Write `path` readable by this user only (a secure broker's properties hold passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def running_pid(cfg: BrokerConfig) -> int | None:
    """The pid of this data dir's broker when it is alive, else None."""
    try:
        pid = int(cfg.pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    if not cmdline:  # empty for a moment during exec, and for a zombie
        return pid if _alive(pid) else None
    # Guard against a reused pid: it must be a Kafka server on this very properties file.
    if b"kafka.Kafka" in cmdline and str(cfg.properties_file).encode() in cmdline:
        return pid
    return None


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def start(cfg: BrokerConfig) -> int:
    """Start the broker as a detached process (own session) unless it runs already; returns its pid."""
    with _locked(cfg.home / ".start.lock"):
        if (pid := running_pid(cfg)) is not None:
            return pid
        if port_open(cfg.host, cfg.port) or port_open(cfg.host, cfg.controller_port):
            raise BrokerError(
                f"port {cfg.port} or {cfg.controller_port} on {cfg.host} is taken by "
                f"another process; stop it or pick other ports"
            )
        lib = resolve_jars(cfg.version)
        users, passwords = {}, {}  # a secure broker's principals, and its own logins besides
        if cfg.secure:
            users = broker_users(cfg)
            passwords = {**users, security.CONTROLLER: security.ensure_password(security.CONTROLLER, cfg.secrets)}
        _write_private(cfg.properties_file, render_server_properties(cfg, passwords))
        format_storage(cfg, lib, users)
        java = _java()
        cmd = [
            java,
            *cfg.heap_opts,
            *JVM_OPTS,
            *class_cache.jvm_options(cfg.home, lib, java),
            f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}",
            "-cp",
            f"{lib}/*",
            "kafka.Kafka",
            str(cfg.properties_file),
        ]
        with open(cfg.log_file, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=cfg.home,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        cfg.pid_file.write_text(f"{proc.pid}\n")
        return proc.pid


def log_tail(cfg: BrokerConfig, num_bytes: int = 4000) -> str:
    """The end of the broker's log file, for error messages."""
    try:
        data = cfg.log_file.read_bytes()
    except FileNotFoundError:
        return ""
    return data[-num_bytes:].decode(errors="replace")


async def wait_ready(cfg: BrokerConfig, timeout_s: float = 60.0) -> None:
    """Return once the port accepts connections and a metadata request succeeds; else BrokerError."""
    deadline = time.monotonic() + timeout_s
    while not port_open(cfg.host, cfg.port):
        if running_pid(cfg) is None:
            raise BrokerError(f"the broker exited during startup; end of {cfg.log_file}:\n{log_tail(cfg)}")
        if time.monotonic() > deadline:
            raise BrokerError(f"the broker did not open {cfg.bootstrap} within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)
    await wait_for_broker(cfg.bootstrap, max(1.0, deadline - time.monotonic()), cfg.admin_options())


def stop(cfg: BrokerConfig, timeout_s: float = 30.0) -> bool:
    """SIGTERM the broker (a clean shutdown), SIGKILL it after `timeout_s`; False if none ran."""
    return stop_cluster([cfg], timeout_s) == 1


def stop_cluster(cfgs: list[BrokerConfig], timeout_s: float = 30.0) -> int:
    """SIGTERM every running node at once, SIGKILL those still alive after `timeout_s`; returns how
    many ran. At once: a node stopped last, after the others, has no controller quorum left to
    acknowledge its controlled shutdown, and would wait for it."""
    running = [(cfg, pid) for cfg in cfgs if (pid := running_pid(cfg)) is not None]
    for cfg in cfgs:
        if running_pid(cfg) is None:
            cfg.pid_file.unlink(missing_ok=True)
    for _cfg, pid in running:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    killed: list[int] = []
    while alive := [pid for cfg, pid in running if running_pid(cfg) is not None and _alive(pid)]:
        if time.monotonic() > deadline:
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            killed += alive
            break
        time.sleep(0.2)
    for cfg, pid in running:
        while _alive(pid):
            time.sleep(0.1)
        cfg.pid_file.unlink(missing_ok=True)
        with contextlib.suppress(BrokerError):  # no java any more: nothing was dumped by one either
            class_cache.keep_archive(cfg.home, lib_dir(cfg.version), _java(), is_clean_exit=pid not in killed)
    return len(running)


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie; reaps it when it is our child."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@dataclass(frozen=True)
class BrokerStatus:
    """What `weir kafka status` prints."""

    bootstrap: str
    data_dir: Path
    version: str
    pid: int | None  # None: not started from this data dir
    is_port_open: bool

    def describe(self) -> str:
        """One human line."""
        if self.pid is not None:
            state = f"running (pid {self.pid})" if self.is_port_open else f"starting (pid {self.pid})"
        elif self.is_port_open:
            state = "port open, but not a broker started from this data dir"
        else:
            state = "stopped"
        return f"kafka {self.version} at {self.bootstrap}: {state}; data dir {self.data_dir}"


def status(cfg: BrokerConfig) -> BrokerStatus:
    """Whether this data dir's broker runs and its port answers."""
    return BrokerStatus(cfg.bootstrap, cfg.home, cfg.version, running_pid(cfg), port_open(cfg.host, cfg.port))


async def up(cfg: BrokerConfig, timeout_s: float = 90.0) -> BrokerStatus:
    """Resolve, format, start and wait until ready; a broker already running is reused."""
    cfg.home.mkdir(parents=True, exist_ok=True)
    if running_pid(cfg) is None and port_open(cfg.host, cfg.port):
        # A broker this data dir did not start (another WEIR_HOME, a container): use it as it is.
        await wait_for_broker(cfg.bootstrap, 10.0, cfg.admin_options())
        return status(cfg)
    await asyncio.to_thread(start, cfg)
    await wait_ready(cfg, timeout_s)
    return status(cfg)


def cluster_configs(
    port: int = 9092,
    brokers: int = 1,
    host: str = "127.0.0.1",
    data_dir: Path | None = None,
    secure: bool = False,
    version: str = KAFKA_VERSION,
    overrides: dict[str, str] | None = None,
) -> list[BrokerConfig]:
    """The nodes of a local cluster of `brokers` (CLUSTER_SIZES), each a controller and a broker.

    One broker is exactly the single BrokerConfig of `weir kafka up` (data dir `data_dir`, else
    $WEIR_HOME/kafka/broker-<port>). More: node i (1-based) listens on port+2(i-1) for clients and
    the next port for its controller, keeps its data in <dir>/node-<i> where <dir> is `data_dir`,
    else $WEIR_HOME/kafka/cluster-<port>, and shares <dir>/cluster.id with the others.
    """
    if brokers not in CLUSTER_SIZES:
        raise BrokerError(
            f"--brokers {brokers}: a local cluster has {', '.join(map(str, CLUSTER_SIZES))} brokers "
            "(a KRaft quorum of n voters survives (n - 1) // 2 losses: 2 survive none, 4 no more "
            "than 3)"
        )
    common = {"host": host, "secure": secure, "version": version, "overrides": dict(overrides or {})}
    if brokers == 1:
        return [BrokerConfig(port=port, data_dir=data_dir, **common)]  # type: ignore[arg-type]  # common's values match the fields named
    if secure:
        raise BrokerError(
            "--secure runs on a single broker only: a secure cluster (SASL between the nodes, "
            "the same SCRAM users formatted into each) is not built yet"
        )
    shared = (data_dir or weir_home() / "kafka" / f"cluster-{port}").resolve()
    ids = range(1, brokers + 1)
    voters = tuple(f"{i}@{host}:{port + 2 * (i - 1) + 1}" for i in ids)
    return [
        BrokerConfig(
            port=port + 2 * (i - 1),
            controller_port=port + 2 * (i - 1) + 1,
            data_dir=shared / f"node-{i}",
            node_id=i,
            voters=voters,
            cluster_home=shared,
            heap_opts=CLUSTER_HEAP_OPTS,
            **common,  # type: ignore[arg-type]  # common's values match the fields named
        )
        for i in ids
    ]


def bootstrap_of(cfgs: list[BrokerConfig]) -> str:
    """Every node's host:port, comma-separated: what clients of the cluster are given, so losing
    the node a client first reached costs a metadata refresh (docs/design.md, "Scale-out and failover")."""
    return ",".join(cfg.bootstrap for cfg in cfgs)


def start_cluster(cfgs: list[BrokerConfig]) -> list[int]:
    """Start every node that is not running (formatting new data dirs); returns their pids. The
    nodes start together: a voter waits for a quorum of the others before it serves."""
    for cfg in cfgs:
        cfg.home.mkdir(parents=True, exist_ok=True)
    return [start(cfg) for cfg in cfgs]


async def wait_cluster_ready(cfgs: list[BrokerConfig], timeout_s: float = 120.0) -> None:
    """Return once every node answers and the cluster's metadata lists them all; else BrokerError."""
    deadline = time.monotonic() + timeout_s
    await asyncio.gather(*(wait_ready(cfg, timeout_s) for cfg in cfgs))
    wanted = {cfg.node_id for cfg in cfgs}
    listed: set[int] = set()
    while time.monotonic() < deadline:
        with contextlib.suppress(KafkaError, OSError):
            listed = set(await broker_ids(bootstrap_of(cfgs), cfgs[0].admin_options()))
            if wanted <= listed:
                return
        await asyncio.sleep(0.3)
    raise BrokerError(
        f"the cluster at {bootstrap_of(cfgs)} listed brokers {sorted(listed)}, not all of "
        f"{sorted(wanted)}, within {timeout_s:.0f} s"
    )


def cluster_status(cfgs: list[BrokerConfig]) -> list[BrokerStatus]:
    """Each node's status."""
    return [status(cfg) for cfg in cfgs]


async def cluster_up(cfgs: list[BrokerConfig], timeout_s: float = 120.0) -> list[BrokerStatus]:
    """Start the nodes that are not running and wait until the cluster lists them all."""
    if len(cfgs) == 1:
        return [await up(cfgs[0], timeout_s)]
    taken = [cfg.bootstrap for cfg in cfgs if running_pid(cfg) is None and port_open(cfg.host, cfg.port)]
    if taken:
        raise BrokerError(f"{', '.join(taken)}: taken by a process this cluster's data dirs did not start")
    await asyncio.to_thread(start_cluster, cfgs)
    await wait_cluster_ready(cfgs, timeout_s)
    return cluster_status(cfgs)
