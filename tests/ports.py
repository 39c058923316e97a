"""Ports for the processes a test starts: bound and held by the test, never picked and released.

A port picked by binding port 0, closing, and handing the number to a process is free for a while
in between: any other process of the machine (another service of the same stack, a client's
outgoing connection) may be given it, and the service then cannot listen (a `make test` once failed
with `cannot listen on 127.0.0.1:39931 (Address already in use)`). A Weir service takes its
listening socket from its launcher instead (weir/service.py: HTTP_FD_ENV; weir/stack.py:
Stack.listeners); `HeldPort` is that launcher's side for a test that starts a service itself.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from weir.service import HTTP_FD_ENV


class HeldPort:
    """A listening socket on a port the kernel chose, to pass to a service by file descriptor:
    `subprocess.Popen(..., env=held.env(base), pass_fds=held.pass_fds)`. The service serves on it
    (give it `port` as its --http-port too: it checks the two agree); close it once the process
    has started (the child keeps its copy) or at the end."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.port = int(self.sock.getsockname()[1])

    @property
    def pass_fds(self) -> tuple[int]:
        return (self.sock.fileno(),)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) with the socket's descriptor under HTTP_FD_ENV."""
        return {**(os.environ if base is None else base), HTTP_FD_ENV: str(self.sock.fileno())}

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> HeldPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeadPort:
    """A port where nothing listens and nothing can start to while this is held: bound, never
    listening, so a connection to it is refused (a Kafka bootstrap that does not answer, a probe
    of a service that is not there)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.port = int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> DeadPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
