"""`weir up`: the local Kafka broker (or with --brokers 3 a cluster of three, weir/kafka/launcher.py:
cluster_configs) and all four services on one machine, as plain processes.

A service that exits by itself (a kill -9, a crash) is restarted, as docker-compose.yml's
`restart: unless-stopped` does (weir/supervision.py); Ctrl-C, SIGTERM or SIGHUP stops everything.

Also the process supervisor that end-to-end and fault tests use: a Stack starts each service as
`python -m weir.cli <service>` with its environment, can kill any of them (kill -9 included), and
stops all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.model_repo import ModelRepoError, load_model_repo
from schemas.topics import DEFAULT_PREFIX, Topics
from weir import deployment
from weir.audit_key import AuditKeyError, checkpoint_key_file, ensure_key_file, key_file, read_key_file
from weir.home import weir_home
from weir.models.gguf_file import GGUFError
from weir.models.sources import prepare_models
from weir.readiness import Probe, ReadinessBoard, probe, wait_all_ready
from weir.service import HTTP_FD_ENV
from weir.supervision import Supervisor, describe_exit

SERVICES = ("auditor", "worker", "batcher", "gateway")
# Services `weir up` may run several of (--workers, --gateways; docs/design.md "Scale-out and
# failover"). Not the auditor (its SQLite ledger and checkpoint chain are one instance's) nor the
# batcher (one is all `weir up` has been tested with).
SCALABLE = ("worker", "gateway")
MAX_INSTANCES = 8
# Each service's HTTP port (/healthz, /readyz, /metrics; the gateway's is its API) and its setting.
HTTP_PORT_ENV = {
    "gateway": "WEIR_GATEWAY_PORT",
    "auditor": "WEIR_AUDIT_API_PORT",
    "batcher": "WEIR_BATCHER_HTTP_PORT",
    "worker": "WEIR_WORKER_HTTP_PORT",
}
# The address each service's HTTP endpoint listens on (weir/bus.py: http_host; the gateway's own).
HTTP_HOST_ENV = {
    "gateway": "WEIR_GATEWAY_HOST",
    "auditor": "WEIR_HTTP_HOST",
    "batcher": "WEIR_HTTP_HOST",
    "worker": "WEIR_HTTP_HOST",
}
DEFAULT_HTTP_PORTS = {"gateway": 8000, "auditor": 8100, "batcher": 8110, "worker": 8120}


def free_ports(n: int = 1) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1. Every socket stays bound until all are picked:
    two one-port picks in a row may get the same port back."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


@dataclass
class Stack:
    """Weir's services as child processes sharing one environment."""

    env: dict[str, str]
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    http_ports: dict[str, int] = field(default_factory=dict)  # name -> its HTTP port, kept across restarts
    # name -> settings of that instance alone (its Kafka principal, instance id), kept across restarts
    own_env: dict[str, dict[str, str]] = field(default_factory=dict)
    services: dict[str, str] = field(default_factory=dict)  # name -> the service it runs, kept across restarts
    # name -> the listening socket of its HTTP port, held here for the stack's life and passed to
    # each start of that name (weir/service.py: HTTP_FD_ENV). The port is never released between
    # its pick and its bind, nor while the service restarts, so no other service of this machine
    # can be handed it (a pick-then-release port once went to the worker while the gateway, given
    # the same port, was still starting). Connections that arrive while the service restarts wait
    # in the socket's backlog for the next start, as with systemd's socket activation.
    listeners: dict[str, socket.socket] = field(default_factory=dict)

    def start(self, name: str, service: str | None = None, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `service` (default: the one `name` ran before, else `name`) under `name`; its output
        goes to <log_dir>/<name>.log. Its HTTP port is the one `http_ports` has for `name`, else the
        one `env` or `extra_env` names, else one the kernel picks (see `url`); the stack listens on
        it and hands the socket down (`listeners`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        known = self.services.get(name)
        if service is not None and known is not None and service != known:
            raise ValueError(f"{name} runs {known}, not {service}")
        service = self.services[name] = known or service or name
        env = {**os.environ, **self.env, **self.own_env.get(name, {}), **(extra_env or {})}
        port_env = HTTP_PORT_ENV[service]
        if name not in self.http_ports:
            given = {**self.env, **(extra_env or {})}.get(port_env)
            self.http_ports[name] = int(given) if given else 0
        listener = self._listener(name, env.get(HTTP_HOST_ENV[service]) or "127.0.0.1")
        env[port_env] = str(self.http_ports[name])
        env.pop(HTTP_FD_ENV, None)
        if listener is not None:
            env[HTTP_FD_ENV] = str(listener.fileno())
        with open(self.log_path(name), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "weir.cli", service],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=() if listener is None else (listener.fileno(),),
            )
        self.procs[name] = proc
        return proc

    def _listener(self, name: str, host: str) -> socket.socket | None:
        """The socket held for `name`'s HTTP port, made on first use: port 0 (none given) becomes the
        one the kernel bound, which `http_ports` then keeps. None when a given port cannot be bound
        here (taken): the service then binds it itself and says why it cannot (EXIT_CONFIG)."""
        if name not in self.listeners:
            try:
                self.listeners[name] = socket.create_server((host, self.http_ports[name]))
            except OSError:
                if not self.http_ports[name]:
                    raise
                return None
            self.http_ports[name] = int(self.listeners[name].getsockname()[1])
        return self.listeners[name]

    def url(self, name: str) -> str:
        """http://host:port of a started service (its /healthz, /readyz, /metrics)."""
        return f"http://127.0.0.1:{self.http_ports[name]}"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, num_bytes: int = 3000) -> str:
        try:
            return self.log_path(name).read_bytes()[-num_bytes:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one service (SIGKILL: the kill -9 of fault tests) and reap it."""
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(30)

    def dead(self) -> list[str]:
        """Services that exited on their own."""
        return [name for name, proc in self.procs.items() if proc.poll() is not None]

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every service (gateway first, so no new work arrives), SIGKILL the stragglers."""
        order = sorted(self.procs, key=lambda n: 0 if n.startswith("gateway") else 1)
        for name in order:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in order:
            try:
                self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.procs[name].kill()
                self.procs[name].wait()
        self.procs.clear()
        for listener in self.listeners.values():
            listener.close()
        self.listeners.clear()


def wait_http_ok(url: str, timeout_s: float, stack: Stack | None = None) -> None:
    """Poll `url` until it answers 200; raises RuntimeError (with the dead service's log) or TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stack is not None and (dead := stack.dead()):
            raise RuntimeError(f"{dead[0]} exited during startup:\n{stack.log_tail(dead[0])}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir up", description=main.__doc__)
    parser.add_argument("--host", default=os.environ.get("WEIR_GATEWAY_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("WEIR_GATEWAY_PORT", "8000")))
    parser.add_argument("--kafka-port", type=int, default=int(os.environ.get("WEIR_KAFKA_PORT", "9092")))
    parser.add_argument(
        "--brokers",
        type=int,
        default=int(os.environ.get("WEIR_KAFKA_BROKERS", "1")),
        help="Kafka nodes: 1, or a KRaft cluster of 3 or 5 from --kafka-port on (env "
        "WEIR_KAFKA_BROKERS; default 1); docs/kafka.md, 'A cluster'",
    )
    parser.add_argument("--topic-prefix", default=os.environ.get("WEIR_TOPIC_PREFIX", DEFAULT_PREFIX))
    parser.add_argument("--model-repo", default=os.environ.get("WEIR_MODEL_REPO", "models.toml"))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait until ready")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=os.environ.get("WEIR_LOG_DIR"),
        help="where each service's log goes (env WEIR_LOG_DIR; default $WEIR_HOME/logs)",
    )
    parser.add_argument(
        "--auth",
        choices=("open", "required"),
        default="open",
        help="gateway auth mode: open (no credentials, local use; default) or required "
        "(API keys from `weir keys create`, or JWTs with WEIR_JWT_KEYS)",
    )
    parser.add_argument(
        "--workers",
        type=instance_count,
        default=1,
        metavar="N",
        help=f"worker instances (1..{MAX_INSTANCES}; default 1): each its own HTTP port and "
        "instance id (WEIR_WORKER_INSTANCE=worker-<i>); they share each model's batch topic",
    )
    parser.add_argument(
        "--gateways",
        type=instance_count,
        default=1,
        metavar="M",
        help=f"gateway instances (1..{MAX_INSTANCES}; default 1): the first on --port, the next "
        "on --port+1, ... where free (the banner lists them), each with its own reply topic",
    )
    parser.add_argument(
        "--secure",
        action="store_true",
        default=os.environ.get("WEIR_KAFKA_SECURITY") == "sasl",
        help="Kafka with SASL/SCRAM and ACLs: each service logs in as its own principal "
        "(default: on when WEIR_KAFKA_SECURITY=sasl); docs/kafka.md, 'Secure mode'",
    )
    return parser


def instance_count(text: str) -> int:
    """An argparse type: a number of instances, 1..MAX_INSTANCES."""
    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_INSTANCES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of instances from 1 to {MAX_INSTANCES}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """`weir up`: start Kafka and the four services, print where to point a client, stop all on Ctrl-C."""
    args = build_parser().parse_args(argv)
    began_s = time.monotonic()
    from weir.kafka import launcher

    try:
        repo = load_model_repo(args.model_repo)
        prepare_gguf_models(repo, os.environ.get("WEIR_MODELS", ""))
        print(prepare_audit_key(), flush=True)
        print(prepare_admin_token(), flush=True)
        ports = service_ports(args.port, counts={"worker": args.workers, "gateway": args.gateways})
    except (
        ModelRepoError,
        GGUFError,
        OSError,
        AuditKeyError,
        ValueError,
    ) as exc:  # a bad entry, key, GGUF source or port
        print(f"weir up: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C during an import: its temporary directory is already removed
        print("\nstopped", flush=True)
        return 0
    try:
        brokers = broker_configs(args)
        broker = brokers[0]  # the one a secure deployment has
        was_running = any(launcher.running_pid(b) is not None or launcher.port_open(b.host, b.port) for b in brokers)
        for node in brokers:
            spawn_broker(node)
    except launcher.BrokerError as exc:
        print(f"weir up: {exc}", file=sys.stderr)
        return 1
    stack = Stack(
        service_env(args, launcher.bootstrap_of(brokers)),
        Path(args.log_dir) if args.log_dir else weir_home() / "logs",
        http_ports=dict(ports),
        own_env=instance_envs(ports, broker),
        services={name: service_of(name) for name in ports},
    )
    # SIGTERM (kill, systemd, docker) and SIGHUP (a closed terminal) stop everything as Ctrl-C does;
    # by default they ended this process alone and left the four services running. SIGINT too, even
    # where it was inherited ignored (a shell's background job): a Ctrl-C to the process group
    # stops the services themselves, and this process must stop with them, not restart them.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    gateway_urls = [f"http://{args.host}:{ports[name]}" for name in instance_names("gateway", args.gateways)]
    bootstrap = launcher.bootstrap_of(brokers)
    try:
        # Other commands of this $WEIR_HOME find this deployment (weir/deployment.py) from now until it
        # stops: "starting" before any service starts (a start takes a minute or more), "up" once ready.
        deployment.record(bootstrap, args.topic_prefix, broker.secure, gateway_urls, state=deployment.STARTING)
        deadline_s = began_s + args.timeout
        kafka = BrokerReadiness(brokers, Topics(args.topic_prefix), repo, deadline_s)
        if broker.secure:  # the services' ACLs must exist before they connect: no overlap here
            _say("Kafka (secure): waiting for the broker, then creating the topics and each service's ACLs ...")
            kafka.wait(deadline_s)
        supervisor = start_stack(stack, args.auth)
        board = ReadinessBoard(["kafka", *stack.services], began_s)
        wait_all_ready(
            board,
            lambda name: kafka.probe() if name == "kafka" else probe(f"{stack.url(name)}/readyz"),
            stack.dead,
            stack.log_tail,
            deadline_s,
            _say,
        )
        deployment.record(bootstrap, args.topic_prefix, broker.secure, gateway_urls, state=deployment.UP)
        models = registered_versions(
            bootstrap, args.topic_prefix, broker, os.environ.get("WEIR_MODELS", "")
        ) or served_versions(repo, os.environ.get("WEIR_MODELS", ""))
        _print_banner(
            gateway_urls,
            broker,
            Topics(args.topic_prefix),
            models,
            args.auth,
            stack,
            time.monotonic() - began_s,
            bootstrap,
        )
        return supervise(stack, supervisor)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:  # launcher.BrokerError is a RuntimeError
        print(f"weir up: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        deployment.forget()
        stack.stop_all()
        if not was_running:
            launcher.stop_cluster(brokers)
        print("stopped", flush=True)


def served_versions(repo: Any, selection: str) -> list[str]:
    """name@version of the models.toml entries the worker serves (WEIR_MODELS, else all); a quantized
    one with its quantization and the bytes its weights hold (services/worker/memory.py)."""
    names = [n.strip() for n in selection.split(",") if n.strip()] or list(repo.models)
    return [_served_text(repo.models[n]) for n in names if n in repo.models]


def _served_text(config: Any) -> str:
    if getattr(config, "quantization", "none") == "none":
        return config.served_id
    try:
        from weir.models.sources import quantized_weight_bytes

        weight_bytes = quantized_weight_bytes(config)
        size = f", {weight_bytes / 1e6:.0f} MB resident weights" if weight_bytes is not None else ""
    except (OSError, ValueError):
        size = ""
    return f"{config.served_id} ({config.quantization}{size})"


def registered_versions(bootstrap: str, prefix: str, broker: Any, selection: str) -> list[str]:
    """name@version of every version the registry holds for the names the worker serves (WEIR_MODELS,
    else all), not retired, the default of each marked `*`: models.toml's and those pushed since
    (`weir models push`). [] when the registry cannot be read (the banner then names models.toml's)."""
    from weir.bus import BusSettings
    from weir.registry import read_registry

    login: dict[str, Any] = {}
    if broker.secure:  # as the operator (the admin super user), like `weir models list`
        from weir.kafka import security

        login = {
            "kafka_security": "sasl",
            "kafka_user": security.ADMIN,
            "kafka_password_file": security.password_path(security.ADMIN, broker.secrets),
        }
    try:
        state = asyncio.run(
            asyncio.wait_for(read_registry(BusSettings(kafka_bootstrap=bootstrap, topic_prefix=prefix, **login)), 20)
        )
    except Exception as exc:  # noqa: BLE001 - the banner names models.toml's versions instead
        _say(f"(the model registry could not be read for the banner: {exc!r})")
        return []
    wanted = [n.strip() for n in selection.split(",") if n.strip()] or state.names()
    found = []
    for name in wanted:
        default = state.default_version(name)
        found += [
            f"{r.served_id}{'*' if r.manifest.version == default else ''}"
            for r in state.versions_of(name)
            if r.desired != "retired"
        ]
    return found


def prepare_gguf_models(repo: Any, selection: str) -> None:
    """Import the GGUF source of each model the worker will serve (WEIR_MODELS, else all) once,
    before the services start, so the worker finds it ready; an import done before is reused."""
    names = [n.strip() for n in selection.split(",") if n.strip()] or list(repo.models)
    prepare_models(repo, [n for n in names if n in repo.models], _say)


def _say(line: str) -> None:
    print(line, flush=True)


def prepare_audit_key() -> str:
    """Make sure the deployment's audit keys exist before any service starts (so they all read
    one key): the fingerprint key and the auditor's checkpoint key; returns the lines that say
    where they are."""
    lines = []
    for variable, path, users in (
        ("WEIR_AUDIT_HMAC_KEY", key_file(), "workers, auditor and `weir audit lookup` use it"),
        ("WEIR_AUDIT_CHECKPOINT_KEY", checkpoint_key_file(), "the auditor and `weir audit verify` use it"),
    ):
        what = "audit key" if variable == "WEIR_AUDIT_HMAC_KEY" else "checkpoint key"
        if os.environ.get(variable):
            lines.append(f"{what}: {variable}, from the environment")
            continue
        made = ensure_key_file(path)
        read_key_file(path, what)  # unsafe or malformed: refused now, with the fix, rather than by each service
        lines.append(f"{what}: {path} ({'made now' if made else 'kept'}; {users})")
    return "\n".join(lines)


ADMIN_TOKEN_FILE = Path("secrets") / "gateway-admin.token"  # under $WEIR_HOME


def prepare_admin_token() -> str:
    """The gateway's admin token (its admin API and /dashboard): WEIR_GATEWAY_ADMIN_TOKEN when set,
    else made once into $WEIR_HOME/secrets/gateway-admin.token (0600, like the audit keys) and put
    in the environment the services inherit; returns the line that says where it is."""
    if os.environ.get("WEIR_GATEWAY_ADMIN_TOKEN"):
        return "admin token: WEIR_GATEWAY_ADMIN_TOKEN, from the environment"
    path = weir_home() / ADMIN_TOKEN_FILE
    made = ensure_key_file(path)
    os.environ["WEIR_GATEWAY_ADMIN_TOKEN"] = read_key_file(path, "gateway admin token").hex()
    return f"admin token: {path} ({'made now' if made else 'kept'}; the admin API and /dashboard take it)"


def broker_configs(args: argparse.Namespace) -> list[Any]:
    """The local broker of `weir up`, or the nodes of its cluster (--brokers); BrokerError for a
    count or mode that cannot run."""
    from weir.kafka import launcher

    base = launcher.BrokerConfig.from_env(port=args.kafka_port, secure=args.secure)
    if args.brokers == 1:
        return [base]
    return launcher.cluster_configs(base.port, args.brokers, host=base.host, data_dir=base.data_dir, secure=args.secure)


def spawn_broker(broker: Any) -> None:
    """Start the local broker's JVM without waiting for it (or find one running): the services
    start while it boots, and wait for it themselves (WEIR_KAFKA_WAIT_S)."""
    from weir.kafka import launcher

    broker.home.mkdir(parents=True, exist_ok=True)
    if launcher.running_pid(broker) is None and launcher.port_open(broker.host, broker.port):
        _say(f"Kafka: using the broker that answers at {broker.bootstrap}")
        return
    if not launcher.jars_resolved(broker.version):
        _say(
            f"Kafka: resolving the {broker.version} jars with Maven into {launcher.lib_dir(broker.version)} "
            "(first start only; a minute or two) ..."
        )
        launcher.resolve_jars(broker.version)
    _say(f"Kafka: starting the broker at {broker.bootstrap} (data in {broker.home}) ...")
    launcher.start(broker)


class BrokerReadiness:
    """Waits, on a thread of its own, until the broker (every node of a cluster) answers, then
    creates the deployment's topics (idempotent); `probe` says how far it got, as a service's
    /readyz would."""

    def __init__(self, brokers: list[Any], topics: Topics, repo: Any, deadline_s: float) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(brokers, topics, repo, deadline_s), daemon=True)
        self._thread.start()

    def wait(self, deadline_s: float) -> None:
        """Block until the topics (and a secure broker's ACLs) exist; raises what went wrong."""
        self._thread.join(max(0.0, deadline_s - time.monotonic()))
        if not self.probe().is_ready:
            raise TimeoutError("the Kafka broker was not ready (topics, ACLs) within the start-up timeout")

    def probe(self) -> Probe:
        """Ready once the topics exist; re-raises what went wrong (a BrokerError is a RuntimeError)."""
        if self._thread.is_alive():
            return Probe(False, "the broker is booting (JVM, then its KRaft controller and broker)")
        if self._error is not None:
            raise self._error
        return Probe(True, "ready")

    def _run(self, brokers: list[Any], topics: Topics, repo: Any, deadline_s: float) -> None:
        from weir.kafka import launcher
        from weir.kafka.admin import deployment_specs, ensure_topics, grant_deployment_acls

        broker, bootstrap = brokers[0], launcher.bootstrap_of(brokers)
        try:
            if all(launcher.running_pid(b) is not None for b in brokers):
                asyncio.run(launcher.wait_cluster_ready(brokers, max(1.0, deadline_s - time.monotonic())))
            options = broker.admin_options()  # {}: a plaintext broker
            asyncio.run(ensure_topics(bootstrap, deployment_specs(topics, repo), options=options))
            if broker.secure:
                asyncio.run(grant_deployment_acls(broker.bootstrap, topics, options))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread by probe()
            self._error = exc


def service_env(args: argparse.Namespace, bootstrap: str) -> dict[str, str]:
    """The environment every service of `weir up` shares (each instance's own: instance_envs and
    Stack.http_ports). They start while the broker boots, so each waits for it up to the start-up
    timeout."""
    return {
        "WEIR_KAFKA_BOOTSTRAP": bootstrap,
        "WEIR_TOPIC_PREFIX": args.topic_prefix,
        "WEIR_MODEL_REPO": str(Path(args.model_repo).resolve()),
        "WEIR_GATEWAY_HOST": args.host,
        "WEIR_AUTH_MODE": args.auth,
        "PYTHONUNBUFFERED": "1",
        "WEIR_HOME": str(weir_home()),
        "WEIR_KAFKA_WAIT_S": str(args.timeout),
    }


def service_of(name: str) -> str:
    """The service an instance name runs: worker-2 -> worker."""
    return name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name


def instance_envs(ports: Mapping[str, int], broker: Any) -> dict[str, dict[str, str]]:
    """Each instance's own settings, kept across its restarts: its Kafka principal on a secure
    broker (its service's), a gateway's id and a worker's instance name (docs/design.md,
    "Scale-out and failover")."""
    principals = service_principals(broker) if broker.secure else {}
    envs: dict[str, dict[str, str]] = {}
    for name, port in ports.items():
        service = service_of(name)
        env = dict(principals.get(service, {}))
        if service == "gateway":
            # Its own reply topic, the same start after start: with a fresh id per process every
            # `weir up` left a topic behind, and each one lengthens every broker start.
            env["WEIR_GATEWAY_ID"] = f"gateway-up-{port}"
        elif service == "worker":  # stable across restarts: the worker's static group membership
            env["WEIR_WORKER_INSTANCE"] = f"worker-{1 if name == service else name.rsplit('-', 1)[1]}"
        envs[name] = env
    return envs


def service_principals(broker: Any) -> dict[str, dict[str, str]]:
    """Each service's own Kafka login on a secure broker: its principal and password file (made by
    the broker's start, weir/kafka/launcher.py)."""
    from weir.kafka import security

    return {
        name: {
            "WEIR_KAFKA_SECURITY": "sasl",
            "WEIR_KAFKA_USER": name,
            "WEIR_KAFKA_PASSWORD_FILE": str(security.password_path(name, broker.secrets)),
        }
        for name in SERVICES
    }


def start_stack(stack: Stack, auth: str) -> Supervisor:
    """Start every instance `stack.services` names, in SERVICES' order (their readiness is awaited
    by the caller; one that dies meanwhile is a setup error, not restarted)."""
    supervisor = Supervisor()
    names = sorted(stack.services, key=lambda name: SERVICES.index(stack.services[name]))
    for name in names:
        stack.start(name)
        supervisor.on_start(name, time.monotonic())
    _say(
        f"starting {', '.join(names)} (logs in {stack.log_dir}); gateway auth mode: {auth} (WEIR_AUTH_MODE={auth}) ..."
    )
    return supervisor


def instance_names(service: str, count: int) -> list[str]:
    """The names of `count` instances of `service`: the first keeps the service's own name (tests,
    Stack.url and the banner know it by that), the others are service-2, service-3, ..."""
    return [service if i == 1 else f"{service}-{i}" for i in range(1, count + 1)]


def service_ports(
    gateway_port: int, env: Mapping[str, str] | None = None, counts: Mapping[str, int] | None = None
) -> dict[str, int]:
    """The HTTP port of each instance (`counts`: service -> instances, default 1 each). A service's
    first instance: the port its variable names (HTTP_PORT_ENV, as the README says) when set, else
    its default where that is free and not another's, else any free port (so `weir up --port 8100`
    and a second deployment never collide); the gateway's first is `gateway_port`. The n-th instance
    takes the first's port + n-1 when that is free and no one else's, else any free port. Raises
    ValueError for a variable that is not a port, one that names a port another service has, or a
    count `weir up` does not run (a service not in SCALABLE, a number outside 1..MAX_INSTANCES)."""
    env = os.environ if env is None else env
    counts = counts or {}
    for service, count in counts.items():
        if service not in SCALABLE or not 1 <= count <= MAX_INSTANCES:
            raise ValueError(
                f"weir up runs 1 to {MAX_INSTANCES} of {', '.join(SCALABLE)} each, not {count} of {service}"
            )
    ports: dict[str, int] = {}
    for service in ("gateway", *(name for name in SERVICES if name != "gateway")):  # the gateways' ports first
        ports[service] = gateway_port if service == "gateway" else _first_port(service, env, ports)
        for i, name in enumerate(instance_names(service, counts.get(service, 1))[1:], start=1):
            ports[name] = _port_near(ports[service] + i, env, ports)
    return ports


def _first_port(service: str, env: Mapping[str, str], ports: dict[str, int]) -> int:
    if chosen := env.get(HTTP_PORT_ENV[service], "").strip():
        if not chosen.isdigit() or not 0 < int(chosen) < 65536:
            raise ValueError(f"{HTTP_PORT_ENV[service]}={chosen!r} is not a TCP port")
        if int(chosen) in ports.values():
            raise ValueError(f"{HTTP_PORT_ENV[service]}={chosen} is the port of another service")
        return int(chosen)
    return _port_near(DEFAULT_HTTP_PORTS[service], env, ports)


def _port_near(wanted: int, env: Mapping[str, str], ports: dict[str, int]) -> int:
    """`wanted` when it is a port that is free, not assigned yet and no variable names; else a free one."""
    chosen = _chosen_ports(env)
    if 0 < wanted < 65536 and wanted not in ports.values() and wanted not in chosen and not port_taken(wanted):
        return wanted
    return next(p for p in free_ports(4) if p not in ports.values() and p not in chosen)


def _chosen_ports(env: Mapping[str, str]) -> set[int]:
    return {
        int(v) for name, var in HTTP_PORT_ENV.items() if name != "gateway" and (v := env.get(var, "").strip()).isdigit()
    }


def port_taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def supervise(stack: Stack, supervisor: Supervisor, poll_s: float = 0.5) -> int:
    """Restart every service that exits, as the supervisor allows, until one exits too often in a
    row (returns 1, with its log) or this process is interrupted (KeyboardInterrupt)."""
    due: dict[str, float] = {}  # service -> when to start it again
    while True:
        now = time.monotonic()
        for name in stack.dead():
            proc = stack.procs.pop(name)
            delay = supervisor.on_exit(name, now)
            how = describe_exit(proc.returncode)
            if delay is None:
                print(
                    f"weir up: {name} exited ({how}), {supervisor.num_quick_exits(name)} times in a row "
                    f"within {supervisor.policy.healthy_after_s:.0f} s of starting; giving up. Its log "
                    f"({stack.log_path(name)}) ends:\n{stack.log_tail(name)}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            print(
                f"weir up: {name} exited ({how}); restarting it" + (f" in {delay:.0f} s" if delay else ""), flush=True
            )
            due[name] = now + delay
        for name, at in list(due.items()):
            if now >= at:
                del due[name]
                proc = stack.start(name)
                supervisor.on_start(name, now)
                print(f"weir up: {name} restarted (pid {proc.pid})", flush=True)
        time.sleep(poll_s)


def _print_banner(
    urls: list[str],
    broker: Any,
    topics: Topics,
    models: list[str],
    auth: str,
    stack: Stack,
    took_s: float,
    bootstrap: str,
) -> None:
    url = urls[0]
    api_lines = "".join(
        f"\n                         {more}/v1   (gateway-{i}; any gateway serves any model)"
        for i, more in enumerate(urls[1:], start=2)
    )
    if auth == "open":
        auth_line = "OPEN: WEIR_AUTH_MODE=open, no API key needed (local use only; --auth required to change)"
    else:
        auth_line = "required: create a key with `weir keys create --principal P --tenant T`"
    services = "\n".join(f"    {name:<9} {proc.pid:<8} {stack.url(name)}" for name, proc in stack.procs.items())
    replies = ", ".join(
        topics.replies(stack.own_env[name]["WEIR_GATEWAY_ID"])
        for name in stack.procs
        if "WEIR_GATEWAY_ID" in stack.own_env.get(name, {})
    )
    if broker.secure:
        kafka_line = (
            f"{bootstrap}  SASL/SCRAM-SHA-512 + ACLs; log in as `client` (WEIR_KAFKA_SECURITY=sasl "
            f"WEIR_KAFKA_USER=client; passwords in {broker.secrets})"
        )
    else:
        kafka_line = f"{bootstrap}  (no authentication: local use; --secure to change)"
    # Secure: `client` writes only its own request topic, and is served as principal `client`.
    requests_line = f"{topics.producer_requests('client')}  (as client)" if broker.secure else topics.requests
    print(
        f"""
Weir is up.
  OpenAI-compatible API  {url}/v1   (e.g. OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY=local){api_lines}
  gateway auth           {auth_line}
  models                 {", ".join(models)}  (* default version; `weir models list` shows the registry)
  Kafka                  {kafka_line}
  requests topic         {requests_line}
  reply topics           {topics.replies("")}<your-id>  (name yours in reply_to{"; secure: <your-id> = client.<anything>" if broker.secure else ""})
                         the gateways': {replies}
  control / workers      {topics.control} / {topics.workers}
  audit / dead letters   {topics.audit} / {topics.dead_letter}
  model registry         {topics.models}  (weir models list | push | promote; health: {topics.model_health})
  batches                {topics.batches("")}<name>.<version>.<hash>  (one topic per model version)
  dashboard              {url}/dashboard#token={os.environ.get("WEIR_GATEWAY_ADMIN_TOKEN", "<WEIR_GATEWAY_ADMIN_TOKEN>")}
  traces / token usage   {topics.traces} / {topics.token_usage}  (weir trace REQUEST_ID; weir usage)
  weir commands          those of this $WEIR_HOME find this deployment; in another shell or your own code:
                         {deployment.export_line(bootstrap, topics.prefix, broker.secure)}
  services (pid, /healthz /readyz /metrics)
{services}
                         (one that dies is restarted; logs in {stack.log_dir})
Started in {took_s:.1f} s. Press Ctrl-C to stop everything.""",
        flush=True,
    )
