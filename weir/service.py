"""One way to be a service: the flags, logging, exit codes, signals and ops endpoint of all four.

Every service's `main(argv)` is `run_service(...)` with a parser from `service_parser` and a
factory that turns the parsed flags into a `Service`. The runner then:

1. configures logging once (`configure_logging`: logger names by module, one format, or JSON lines);
2. builds the service (a bad setting, flag or model repository: exit `EXIT_CONFIG`);
3. binds the service's HTTP port, or takes the listening socket its launcher passed down
   (`HTTP_FD_ENV`; taken or not the configured one: `EXIT_CONFIG`), then `await service.start()` (the Kafka
   cluster cannot be reached: `EXIT_BROKER`);
4. serves `service.http_app()` on that port (every service answers /healthz, /readyz, /metrics
   there) while `await service.run(stop)` does the work;
5. on SIGTERM or SIGINT sets `stop`; `run` returns within `stop_timeout_s` or is cancelled; a
   second signal cancels it at once; then `service.close()`. A clean stop exits `EXIT_OK` and logs
   no traceback. Anything `run` raises is one ERROR line and `EXIT_FAILED`.

The exit codes are documented in the README; `weir up` and the compose file restart a service
that exits non-zero (docs/design.md, "Services").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    KafkaError,
    TopicAuthorizationFailedError,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp

from weir.heap import freeze_heap, freeze_new
from weir.metrics import CONTENT_TYPE

EXIT_OK = 0  # stopped by SIGTERM/SIGINT, cleanly
EXIT_FAILED = 1  # failed while running (its log says why); supervisors restart it
EXIT_CONFIG = 2  # a setting, flag, model repository, ledger or port that cannot work: fix, then start
EXIT_BROKER = 3  # the Kafka cluster could not be reached at start

log = logging.getLogger(__name__)


class ConfigError(Exception):
    """A service cannot start as configured; the message names the setting and the fix."""


class BrokerUnreachable(Exception):
    """The Kafka cluster did not answer while the service started."""


class Service(Protocol):
    """What the runner drives. `start` connects (Kafka clients, ledger), `run` works until `stop`
    is set, `close` releases what `start` opened, even when `start` or `run` failed."""

    name: str

    async def start(self) -> None: ...
    async def run(self, stop: asyncio.Event) -> None: ...
    async def close(self) -> None: ...
    def http_app(self) -> ASGIApp: ...


def service_parser(name: str, description: str, default_http_port: int, http_port_env: str) -> argparse.ArgumentParser:
    """The flags every service takes; a service adds its own. Each flag overrides a WEIR_* setting."""
    parser = argparse.ArgumentParser(prog=f"weir {name}", description=description)
    parser.add_argument(
        "--bootstrap", help="Kafka bootstrap servers (env WEIR_KAFKA_BOOTSTRAP; default 127.0.0.1:9092)"
    )
    parser.add_argument(
        "--topic-prefix", help="prefix of every topic and group id (env WEIR_TOPIC_PREFIX; default weir)"
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("WEIR_LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING or ERROR (env WEIR_LOG_LEVEL; default %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("WEIR_LOG_FORMAT", "text"),
        help="text lines, or one JSON object per line (env WEIR_LOG_FORMAT; default %(default)s)",
    )
    parser.add_argument(
        "--http-host", help="address of the service's HTTP endpoint (env WEIR_HTTP_HOST; default 127.0.0.1)"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        help=f"port of /healthz, /readyz, /metrics (env {http_port_env}; default {default_http_port}; "
        "0: any free port, logged)",
    )
    return parser


def bus_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The common flags that were given, as settings field names (BusSettings and ServiceHttp)."""
    given = {"kafka_bootstrap": args.bootstrap, "topic_prefix": args.topic_prefix, "http_host": args.http_host}
    return {key: value for key, value in given.items() if value is not None}


class JsonLines(logging.Formatter):
    """One JSON object per record: ts (ISO 8601, UTC), level, service, logger, msg, exc."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure_logging(service: str, level: str = "INFO", fmt: str = "text") -> None:
    """The one logging setup of every service: root handler on stderr, loggers named by module."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"log level {level!r} is not one of DEBUG, INFO, WARNING, ERROR")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLines(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # aiokafka logs every retry of a broker that is away at ERROR with a traceback; one line is enough.
    logging.getLogger("aiokafka").setLevel(max(numeric, logging.WARNING))


def ops_app(
    readiness: Callable[[], tuple[bool, dict[str, Any]]],
    metrics: Callable[[], str],
    extra_routes: list[BaseRoute] | None = None,
    mount: ASGIApp | None = None,
) -> Starlette:
    """/healthz (the process answers), /readyz (200 or 503 with why), /metrics (Prometheus text);
    `mount` (an app of the service's own, e.g. the auditor's lookup API) answers the other paths."""

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> Response:
        is_ready, body = readiness()
        return JSONResponse({"ready": is_ready, **body}, status_code=200 if is_ready else 503)

    async def render_metrics(_: Request) -> Response:
        return PlainTextResponse(metrics(), media_type=CONTENT_TYPE)

    routes: list[BaseRoute] = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", render_metrics),
        *(extra_routes or []),
    ]
    if mount is not None:
        routes.append(Mount("/", app=mount))
    return Starlette(routes=routes)


# A launcher that holds the service's listening socket (weir/stack.py: Stack) passes it down by
# file descriptor under this variable: the port then never passes through a moment where it is
# free, so no other process can be handed it between the pick and the bind (docs/testing.md, "Ports").
HTTP_FD_ENV = "WEIR_HTTP_FD"


def inherited_socket(host: str, port: int) -> socket.socket | None:
    """The listening socket a launcher passed under HTTP_FD_ENV (the variable is then removed, so the
    service's own children do not take it for theirs), or None. It must listen on `port` (any port
    when 0) and, when `host` is an address, on that address: a socket other than the settings say
    is refused (ConfigError), never served in their place."""
    fd_text = os.environ.pop(HTTP_FD_ENV, None)
    if fd_text is None:
        return None
    try:
        sock = socket.socket(fileno=int(fd_text))
    except (ValueError, OSError) as exc:
        raise ConfigError(
            f"{HTTP_FD_ENV}={fd_text!r} is not an open socket ({exc}); unset it to bind --http-port"
        ) from exc
    sock.set_inheritable(False)  # passed down to this process only, not to the processes it starts
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.close()
        raise ConfigError(f"{HTTP_FD_ENV}={fd_text} is not a listening TCP socket; unset it to bind --http-port")
    got_host, got_port = sock.getsockname()[:2]
    try:
        wrong_host = ipaddress.ip_address(host) != ipaddress.ip_address(got_host)
    except ValueError:  # a host name: the launcher resolved it as the service would have
        wrong_host = False
    if (port and got_port != port) or wrong_host:
        sock.close()
        raise ConfigError(
            f"the socket passed in {HTTP_FD_ENV} listens on {got_host}:{got_port}, not on the configured {host}:{port}"
        )
    return sock


def bind(host: str, port: int) -> socket.socket:
    """The service's listening socket: the one its launcher passed down (inherited_socket), else one
    bound here before anything else starts (taken: ConfigError)."""
    sock = inherited_socket(host, port)
    if sock is not None:
        return sock
    try:
        return socket.create_server((host, port))
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); set --http-port to a free port, or 0 for any"
        ) from exc


def run_service(
    name: str,
    argv: list[str] | None,
    parser: argparse.ArgumentParser,
    build: Callable[[argparse.Namespace], tuple[Service, str, int]],
    stop_timeout_s: float = 20.0,
) -> int:
    """Parse `argv`, set up logging, build the service (`build` returns it with the HTTP host and
    port to serve it on), and drive it until a signal; returns the exit code."""
    args = parser.parse_args(argv)
    try:
        configure_logging(name, args.log_level, args.log_format)
        service, host, port = build(args)
        sock = bind(host, port)
    except (ConfigError, ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        log.error("%s cannot start: %s", name, exc)
        return EXIT_CONFIG
    return asyncio.run(_drive(service, sock, stop_timeout_s))


async def _drive(service: Service, sock: socket.socket, stop_timeout_s: float) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    run_task: asyncio.Task[None] | None = None

    def on_signal(signum: int) -> None:
        if stop.is_set() and run_task is not None:  # a second signal: do not wait for a clean stop
            run_task.cancel()
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    http = HttpServer(service.http_app(), sock, getattr(service, "http_options", {}))
    try:
        # The heap built so far (imports, settings, the service's objects) is collected and frozen
        # before its Kafka clients start: a full collection blocks the loop for seconds on a busy
        # box, and a consumer group's session (2 s for workers) expired under it (issue 35). What
        # start() adds is frozen after, without walking this again (weir/heap.py).
        freeze_heap(f"{service.name} built")
        try:
            await _start(service, stop)
        except StartAborted:
            return EXIT_OK
        await http.start()
        host, port = sock.getsockname()[:2]
        log.info("%s serving http://%s:%d (/healthz /readyz /metrics)", service.name, host, port)
        await freeze_new(f"{service.name} started")
        run_task = asyncio.create_task(service.run(stop))
        return await _until_done(run_task, stop, stop_timeout_s)
    except ConfigError as exc:
        log.error("%s cannot start: %s", service.name, exc)
        return EXIT_CONFIG
    except BrokerUnreachable as exc:
        log.error("%s cannot start: %s", service.name, exc)
        return EXIT_BROKER
    except Exception as exc:  # a start that failed otherwise: one line, and a restart
        log.error("%s failed to start: %r", service.name, exc, exc_info=not isinstance(exc, OSError))
        return EXIT_FAILED
    finally:
        await http.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(service.close(), stop_timeout_s)


class StartAborted(Exception):
    """A signal arrived while the service was starting."""


async def _start(service: Service, stop: asyncio.Event) -> None:
    """service.start(), unless a signal comes first; Kafka errors become BrokerUnreachable.

    aiokafka logs every retry at ERROR while a broker boots (`weir up` starts the services beside
    it): start is quiet, and a start that fails says why in one line of its own."""
    kafka_log = logging.getLogger("aiokafka")
    level = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    try:
        start = asyncio.create_task(service.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        kafka_log.setLevel(level)
    stopped.cancel()
    if not start.done():
        start.cancel()
        with contextlib.suppress(BaseException):
            await start
        raise StartAborted
    try:
        start.result()
    except (TopicAuthorizationFailedError, GroupAuthorizationFailedError, ClusterAuthorizationFailedError) as exc:
        # Kafka answered, and refused this principal: its ACLs (schemas/access.py) lack a grant,
        # which no restart gives it (issue 35: this read "Kafka did not answer").
        user = os.environ.get("WEIR_KAFKA_USER") or "this client"
        raise ConfigError(
            f"Kafka refused {user} ({exc!r}): a secure deployment's ACLs do not allow it; "
            "schemas/access.py declares what each service uses, `weir topics create --acls` "
            "grants it"
        ) from exc
    except (KafkaConnectionError, KafkaError, TimeoutError) as exc:
        raise BrokerUnreachable(
            f"Kafka did not answer ({exc!r}); is Kafka up (`weir kafka up`), and is "
            "--bootstrap / WEIR_KAFKA_BOOTSTRAP right?"
        ) from exc


async def _until_done(run_task: asyncio.Task[None], stop: asyncio.Event, stop_timeout_s: float) -> int:
    """Wait for `run_task`; once `stop` is set, give it `stop_timeout_s` before cancelling it."""
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({run_task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not run_task.done():
        done, _ = await asyncio.wait({run_task}, timeout=stop_timeout_s)
        if not done:
            log.warning("did not stop within %.0f s; cancelling", stop_timeout_s)
            run_task.cancel()
    try:
        await run_task
    except asyncio.CancelledError:
        return EXIT_OK
    except ConfigError:
        raise
    except Exception as exc:  # one actionable line, and a supervisor restarts it
        log.error("stopped by an error: %r", exc, exc_info=not isinstance(exc, (KafkaError, OSError)))
        return EXIT_FAILED
    return EXIT_OK


class HttpServer:
    """uvicorn on an already bound socket, without its own signal handling (the runner's)."""

    def __init__(self, app: ASGIApp, sock: socket.socket, options: dict[str, Any]) -> None:
        import uvicorn

        # A service may set other uvicorn options in its `http_options` (the gateway: its WebSocket
        # frame limit and a longer graceful shutdown for open streams).
        config = uvicorn.Config(
            app,
            **{
                "log_level": "warning",
                "access_log": False,
                "lifespan": "on",
                "timeout_graceful_shutdown": 5,
                **options,
            },
        )
        self.server = uvicorn.Server(config)
        self.server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # uvicorn has no option to leave signals to its caller
        # Nagle off for every connection accepted here (Linux copies the option to them). asyncio
        # sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and socket.create_server
        # makes them with proto 0: with Nagle on, each streamed response after the first on a
        # keep-alive connection held its first SSE event until the client's delayed ACK, 27-38 ms
        # (docs/benchmarks.md, "What was tried": the pipeline's c=1 TTFT).
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve in the background; returns once the app's lifespan ran and the socket accepts."""
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():  # the app's lifespan failed: uvicorn says why in its log
                with contextlib.suppress(BaseException):
                    self.task.result()
                raise ConfigError("the HTTP app did not start (its lifespan failed; see the lines above)")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.task is None:
            self.sock.close()
            return
        self.server.should_exit = True
        with contextlib.suppress(BaseException):
            await self.task
        self.task = None
