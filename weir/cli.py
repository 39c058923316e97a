"""The `weir` command line.

weir kafka up|down|status     the local Apache Kafka broker (weir/kafka/launcher.py), or with
                              --brokers 3 a cluster of three (docs/kafka.md, "A cluster"); --secure:
                              SASL/SCRAM and ACLs (weir/kafka/security.py)
weir kafka user add NAME      an outside producer's principal on a secure broker
weir kafka secrets            make a secure deployment's passwords (docker-compose.secure.yml)
weir topics create            create a deployment's topics on any cluster
weir up | gateway | batcher | worker | auditor | audit | keys | batch | replay | models | trace | usage | sbom
                              handed to the owning module's main(argv), imported on use
weir bench NAME ...           runs `python -m bench NAME ...` as its own program (the bench/
                              package sits above weir/, which never imports it)
weir chaos ...                runs `python -m bench.chaos ...` the same way (bench/chaos.py)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.model_repo import ModelRepoError, load_model_repo
from schemas.topics import DEFAULT_PREFIX, Topics, replication_for

if TYPE_CHECKING:
    from weir.kafka.launcher import BrokerConfig

# Subcommands that other modules implement: name -> (module, help). Each module has main(argv) -> int.
DELEGATED: dict[str, tuple[str, str]] = {
    "up": ("weir.stack", "start Kafka and all four services on this machine"),
    "gateway": ("services.gateway.app", "run the gateway service"),
    "batcher": ("services.batcher.app", "run the batcher service"),
    "worker": ("services.worker.app", "run the worker service"),
    "auditor": ("services.auditor.app", "run the auditor service"),
    "audit": ("services.auditor.cli", "query and verify the audit log"),
    "keys": ("services.gateway.keys_cli", "create, revoke and list the gateway's API keys"),
    "batch": ("weir.batch_cli", "submit an OpenAI-format batch file and download its results"),
    "replay": ("weir.replay", "rerun recorded requests on another model and diff the outputs"),
    "trace": ("weir.trace_cli", "print one request's span tree (every service's spans) from the traces topic"),
    "models": (
        "services.worker.models_cli",
        "the model registry (pack, push, list, show, load, unload, retire, "
        "promote, seed, keygen); import a GGUF file as a model directory",
    ),
    "usage": ("weir.usage", "token usage and cost per day, tenant, principal and model version"),
    "sbom": (
        "weir.sbom",
        "a CycloneDX SBOM of this environment (Python packages, Kafka jars), checked against the locks",
    ),
}

# Subcommands that are separate programs: name -> (the `python -m` module, help). Their process
# replaces this one, so exit status and signals are theirs; nothing here imports them.
PROGRAMS: dict[str, tuple[str, str]] = {
    "bench": ("bench", "benchmark a running deployment"),
    "chaos": (
        "bench.chaos",
        "kill -9 services and a broker under load on a stack of its own; exit 1 when a "
        "request was lost, duplicated or differs from its seeded rerun",
    ),
}


def _add_deployment_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--topic-prefix",
        default=os.environ.get("WEIR_TOPIC_PREFIX", DEFAULT_PREFIX),
        help="topic name prefix (env WEIR_TOPIC_PREFIX; default %(default)s)",
    )
    parser.add_argument(
        "--model-repo",
        type=Path,
        default=Path(os.environ.get("WEIR_MODEL_REPO", "models.toml")),
        help="model repository TOML (env WEIR_MODEL_REPO; default %(default)s)",
    )


def _add_broker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, help="client port (env WEIR_KAFKA_PORT; default 9092)")
    parser.add_argument(
        "--controller-port", type=int, help="KRaft controller port (env WEIR_KAFKA_CONTROLLER_PORT; default port + 1)"
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="data dir (env WEIR_KAFKA_DATA_DIR; default $WEIR_HOME/kafka/broker-<port>, "
        "for a cluster $WEIR_HOME/kafka/cluster-<port>, a node-<i> dir per node)",
    )


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    _add_broker_args(parser)
    parser.add_argument(
        "--brokers",
        type=int,
        default=int(os.environ.get("WEIR_KAFKA_BROKERS", "1")),
        help="nodes: 1, or a KRaft cluster of 3 or 5 on ports port..port+2n-1 (env "
        "WEIR_KAFKA_BROKERS; default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser; delegated subcommands take their arguments as they are."""
    parser = argparse.ArgumentParser(prog="weir", description="Weir: LLM inference over Apache Kafka.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    kafka = commands.add_parser("kafka", help="the local Apache Kafka broker (Maven Central jars, KRaft)")
    kafka_actions = kafka.add_subparsers(dest="action", required=True, metavar="ACTION")
    kafka_up = kafka_actions.add_parser("up", help="start (if needed), wait until ready, create topics")
    _add_cluster_args(kafka_up)
    _add_deployment_args(kafka_up)
    kafka_up.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for readiness")
    kafka_up.add_argument("--no-topics", action="store_true", help="do not create the deployment's topics")
    kafka_up.add_argument(
        "--secure",
        action="store_true",
        default=os.environ.get("WEIR_KAFKA_SECURITY") == "sasl",
        help="SASL/SCRAM-SHA-512 and ACLs, deny by default (default: on when "
        "WEIR_KAFKA_SECURITY=sasl); docs/kafka.md, 'Secure mode'",
    )
    for action, text in (("down", "stop the broker (SIGTERM, then SIGKILL)"), ("status", "is it running?")):
        _add_cluster_args(kafka_actions.add_parser(action, help=text))
    kafka_actions.add_parser(
        "secrets",
        help="make the passwords of a secure deployment's principals into "
        "$WEIR_HOME/secrets/kafka (once; existing ones are kept)",
    )
    user = kafka_actions.add_parser("user", help="principals of a secure broker")
    user_actions = user.add_subparsers(dest="user_action", required=True, metavar="ACTION")
    user_add = user_actions.add_parser(
        "add",
        help="make (or keep) NAME's password, its own request topic "
        "<prefix>.requests.NAME and an outside producer's ACLs: write that topic "
        "only, read its own replies. Requests there are served as principal NAME, "
        "tenant `kafka`, and must name a reply topic of NAME's",
    )
    user_add.add_argument(
        "name",
        help="the user (its requests: <prefix>.requests.NAME; its reply topics: <prefix>.replies.NAME.<anything>)",
    )
    _add_broker_args(user_add)
    _add_deployment_args(user_add)

    topics = commands.add_parser("topics", help="Kafka topics of a deployment")
    topic_actions = topics.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = topic_actions.add_parser("create", help="create the missing topics (idempotent)")
    create.add_argument(
        "--bootstrap",
        default=os.environ.get("WEIR_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
        help="Kafka bootstrap servers (env WEIR_KAFKA_BOOTSTRAP; default %(default)s)",
    )
    create.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the broker")
    create.add_argument(
        "--reply",
        action="append",
        default=[],
        metavar="ID",
        help="also create the reply topic <prefix>.replies.ID for a client of your own (repeatable)",
    )
    create.add_argument(
        "--acls",
        action="store_true",
        help="on a secure cluster, also give the services and `client` their ACLs for this prefix "
        "(log in as admin: WEIR_KAFKA_SECURITY=sasl WEIR_KAFKA_USER=admin)",
    )
    _add_deployment_args(create)

    for name, (_module, text) in {**DELEGATED, **PROGRAMS}.items():
        commands.add_parser(name, help=text, add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    return parser


def run_delegated(name: str, argv: list[str]) -> int:
    """Import the module behind `name` and call its main(argv)."""
    module_name = DELEGATED[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"weir {name}: {module_name} is not available ({exc})", file=sys.stderr)
        return 2
    return int(module.main(argv) or 0)


def exec_program(name: str, argv: list[str]) -> int:
    """Replace this process with `python -m <module> ARGV` for `name`; returns only if exec fails."""
    command = [sys.executable, "-m", PROGRAMS[name][0], *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, command)
    except OSError as exc:
        print(f"weir {name}: cannot run {' '.join(command[:3])} ({exc})", file=sys.stderr)
        return 2
    return 0  # not reached: execv returns only by raising (or where a test stands in for it)


async def create_topics(
    bootstrap: str,
    prefix: str,
    model_repo: Path,
    timeout_s: float,
    replies: list[str] | None = None,
    options: dict[str, str] | None = None,
) -> list[str]:
    """Wait for the cluster, then create the core topics, those of every model in the repository,
    and the reply topics named in `replies` (as `options`' principal, else the environment's)."""
    from weir.kafka.admin import deployment_specs, ensure_topics, wait_for_broker

    topics = Topics(prefix)
    specs = deployment_specs(topics, load_model_repo(model_repo)) + [topics.reply_spec(r) for r in replies or []]
    await wait_for_broker(bootstrap, timeout_s, options)
    return await ensure_topics(bootstrap, specs, options=options)


async def add_user(cfg: BrokerConfig, name: str, prefix: str) -> Path:
    """`weir kafka user add`: NAME's password file (made once), its SCRAM credential, its request
    topic, its ACLs."""
    from weir.kafka import security
    from weir.kafka.admin import add_client_user

    security.check_user_name(name)
    options = cfg.admin_options()
    password = security.ensure_password(name, cfg.secrets)
    await add_client_user(cfg.bootstrap, Topics(prefix), name, password, options)
    return security.password_path(name, cfg.secrets)


def _kafka(args: argparse.Namespace) -> int:
    from weir.kafka import launcher, security

    if args.action == "secrets":
        users = [security.ADMIN, security.CONTROLLER, *security.SERVICES, security.DEFAULT_CLIENT]
        for user in users:
            security.ensure_password(user, security.secrets_dir())
        print(f"passwords of {', '.join(users)}: in {security.secrets_dir()} (0600)")
        return 0
    # Users exist on a secure broker only: `user add` speaks to it as one (its admin's login).
    is_secure = args.action == "user" or (args.action == "up" and args.secure)
    if getattr(args, "brokers", 1) != 1:
        return _kafka_cluster(args, is_secure)
    cfg = launcher.BrokerConfig.from_env(
        port=args.port, controller_port=args.controller_port, data_dir=args.data_dir, secure=is_secure
    )
    if args.action == "user":
        path = asyncio.run(add_user(cfg, args.name, args.topic_prefix))
        topics = Topics(args.topic_prefix)
        print(
            f"user {args.name}: password in {path}; it may write {topics.producer_requests(args.name)} (served "
            f"as principal {args.name}) and read {security.client_reply_prefix(topics, args.name)}*"
        )
        print(f"connect with WEIR_KAFKA_SECURITY=sasl WEIR_KAFKA_USER={args.name} WEIR_KAFKA_PASSWORD_FILE={path}")
        return 0
    if args.action == "status":
        state = launcher.status(cfg)
        print(state.describe())
        return 0 if state.pid is not None or state.is_port_open else 1
    if args.action == "down":
        if launcher.stop(cfg):
            print(f"kafka at {cfg.bootstrap}: stopped")
        elif launcher.port_open(cfg.host, cfg.port):
            print(f"kafka at {cfg.bootstrap}: not started from {cfg.home}; left running")
        else:
            print(f"kafka at {cfg.bootstrap}: was not running")
        return 0
    state = asyncio.run(launcher.up(cfg, args.timeout))
    print(state.describe())
    if not args.no_topics:
        created = asyncio.run(
            create_topics(cfg.bootstrap, args.topic_prefix, args.model_repo, args.timeout, options=cfg.admin_options())
        )
        print(f"topics under prefix {args.topic_prefix!r}: {len(created)} created")
    if cfg.secure:
        from weir.kafka.admin import grant_deployment_acls

        count = asyncio.run(grant_deployment_acls(cfg.bootstrap, Topics(args.topic_prefix), cfg.admin_options()))
        print(
            f"secure: SASL_PLAINTEXT/{security.MECHANISM} on {cfg.host} (no TLS), deny by default; {count} ACL "
            f"bindings for prefix {args.topic_prefix!r}; passwords in {cfg.secrets}"
        )
        print(f"connect with WEIR_KAFKA_SECURITY=sasl WEIR_KAFKA_USER=<{'|'.join(security.SERVICES)}|client|admin>")
    print(f"bootstrap servers: {cfg.bootstrap}")
    return 0


def _kafka_cluster(args: argparse.Namespace, is_secure: bool) -> int:
    """`weir kafka up|down|status --brokers N` for N > 1: the nodes of launcher.cluster_configs."""
    from weir.kafka import launcher

    if args.controller_port is not None:
        raise launcher.BrokerError("--controller-port names a single broker's; node i of a cluster has port+2(i-1)+1")
    base = launcher.BrokerConfig.from_env(port=args.port, data_dir=args.data_dir)
    cfgs = launcher.cluster_configs(base.port, args.brokers, host=base.host, data_dir=base.data_dir, secure=is_secure)
    bootstrap = launcher.bootstrap_of(cfgs)
    if args.action == "status":
        states = launcher.cluster_status(cfgs)
        print("\n".join(state.describe() for state in states))
        return 0 if all(state.pid is not None or state.is_port_open for state in states) else 1
    if args.action == "down":
        stopped = launcher.stop_cluster(cfgs)
        print(f"kafka cluster at {bootstrap}: {stopped} of {len(cfgs)} nodes stopped (the others were not running)")
        return 0
    states = asyncio.run(launcher.cluster_up(cfgs, args.timeout))
    print("\n".join(state.describe() for state in states))
    if not args.no_topics:
        created = asyncio.run(create_topics(bootstrap, args.topic_prefix, args.model_repo, args.timeout))
        print(
            f"topics under prefix {args.topic_prefix!r}: {len(created)} created, {replication_for(len(cfgs))} replicas each"
        )
    print(f"bootstrap servers: {bootstrap}")
    return 0


# Commands that talk to a deployment: what `weir up` recorded under $WEIR_HOME fills in the
# bootstrap, prefix and login that no flag or variable gives (weir/deployment.py). Not the services
# (`weir up` and compose set theirs), nor `weir up` and `weir kafka`, which make a deployment.
FINDS_DEPLOYMENT = ("topics", "models", "keys", "usage", "trace", "audit", "replay", "batch")


def find_deployment(argv: list[str]) -> None:
    """Fill in the environment from the deployment `weir up` recorded for $WEIR_HOME, if any, and
    say so on stderr (a command's target is never a silent guess). A command given a bootstrap
    (--bootstrap, --kafka-bootstrap, or --port for `weir kafka user add`) names its cluster itself:
    nothing is filled in. `weir kafka user add` speaks to the recorded broker's port as its admin."""
    adds_user = argv[:3] == ["kafka", "user", "add"]
    if not argv or (argv[0] not in FINDS_DEPLOYMENT and not adds_user):
        return
    named = ("--bootstrap", "--kafka-bootstrap", *(("--port",) if adds_user else ()))
    if any(arg.split("=", 1)[0] in named for arg in argv[1:]):
        return
    from weir import deployment

    recorded = deployment.load()
    if recorded is None:
        return
    filled = deployment.apply(body=recorded)
    if adds_user:
        host, _, port = str(recorded["bootstrap"]).split(",")[0].rpartition(":")
        if host in ("127.0.0.1", "localhost") and port.isdigit() and not os.environ.get("WEIR_KAFKA_PORT"):
            os.environ["WEIR_KAFKA_PORT"] = filled["WEIR_KAFKA_PORT"] = port  # the local broker `weir up` runs
    if filled:
        print(
            f"weir: the deployment of `weir up` ({deployment.path()}): "
            + " ".join(f"{name}={value}" for name, value in filled.items()),
            file=sys.stderr,
        )
    if recorded["state"] == deployment.STARTING:  # its broker may not answer yet, its registry may be empty
        print(
            f"weir: the deployment of `weir up` (pid {recorded.get('pid')}) is still starting; "
            "retry once its banner says it is up if this command finds nothing",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `weir` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    find_deployment(argv)  # before any parser reads its defaults from the environment
    # Delegated commands and programs get their arguments untouched, --help included.
    if argv and argv[0] in DELEGATED:
        return run_delegated(argv[0], argv[1:])
    if argv and argv[0] in PROGRAMS:
        return exec_program(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from aiokafka.errors import KafkaError

    from weir.kafka.launcher import BrokerError
    from weir.kafka.security import KafkaSecurityError

    try:
        if args.command == "kafka":
            return _kafka(args)
        topics = Topics(args.topic_prefix)
        for reply in args.reply:  # the rule the services apply to reply_to (docs/design.md, "Reply topics")
            if (problem := topics.reply_to_problem(topics.replies(reply))) is not None:
                print(f"weir: error: --reply {reply[:40]!r}: {problem}", file=sys.stderr)
                return 2
        created = asyncio.run(
            create_topics(args.bootstrap, args.topic_prefix, args.model_repo, args.timeout, args.reply)
        )
        print(f"topics under prefix {args.topic_prefix!r} on {args.bootstrap}: {len(created)} created")
        if args.acls:
            from weir.kafka.admin import grant_deployment_acls
            from weir.kafka.security import client_options_from_env

            options = client_options_from_env()
            if options.get("sasl_plain_username") != "admin":
                print(
                    "weir: error: --acls needs the admin login (WEIR_KAFKA_SECURITY=sasl WEIR_KAFKA_USER=admin)",
                    file=sys.stderr,
                )
                return 2
            count = asyncio.run(grant_deployment_acls(args.bootstrap, Topics(args.topic_prefix), options))
            print(f"ACLs for prefix {args.topic_prefix!r}: {count} bindings")
        for reply in args.reply:
            print(f"reply topic {topics.replies(reply)} is there: name it in reply_to")
        return 0
    except (BrokerError, KafkaError, ModelRepoError, TimeoutError, KafkaSecurityError) as exc:
        print(f"weir: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
