"""The worker's staged rollback (services/worker/versions.py: VersionManager._roll_back), one handler
with in-memory parts (its registry and health events): the previous version wanted loaded first, the route switched only once it
is ready here, or after WEIR_ROLLBACK_WARM_TIMEOUT_S anyway (the Kafka path: test_versions_kafka.py)."""

from __future__ import annotations

from schemas.messages import now_ms
from schemas.model_repo import ModelConfig
from schemas.registry import ModelManifest, ModelRoute, ModelVersionRecord, RegistryState
from services.worker.config import WorkerSettings
from services.worker.versions import ManagerParts, Version, VersionManager
from tests.waiting import stays_false, until
from weir.models.manifest import pack


class FakeRegistry:
    """The manager's registry part: a state the test sets; what the manager writes, recorded."""

    def __init__(self, state: RegistryState) -> None:
        self.state = state
        self.writes: list[list] = []

    async def seed_manifest(self, config: ModelConfig) -> ModelManifest:
        raise AssertionError("nothing is seeded here: every version is registered")

    async def write(self, records: list) -> None:
        self.writes.append(records)


class FakePort:
    """The parts the manager is handed, in memory: the registry, and the health events it emits.
    Nothing here opens an engine or a server (the versions are put in the states the test needs)."""

    def __init__(self, state: RegistryState) -> None:
        self.registry = FakeRegistry(state)
        self.events: list[tuple[str, str, str]] = []

    @property
    def state(self) -> RegistryState:
        return self.registry.state

    @property
    def writes(self) -> list[list]:
        return self.registry.writes

    async def emit(self, served_id: str, event: str, detail: str) -> None:
        self.events.append((served_id, event, detail))

    def parts(self) -> ManagerParts:
        async def no_engine(*_args: object) -> None:
            raise AssertionError("no engine is opened here")

        return ManagerParts(
            worker_id="w1",
            open_engine=no_engine,
            make_server=no_engine,
            registry=self.registry,
            emit=self.emit,
            changed=lambda: None,
        )


def promoted_state() -> RegistryState:
    """echo@2 promoted just now over echo@1, which promote asked to unload."""
    state = RegistryState()
    one, two = (ModelConfig(name="echo", version=v, engine="echo", max_model_len=4096) for v in ("1", "2"))
    for record in (
        ModelVersionRecord(manifest=pack(one), desired="unloaded"),
        ModelVersionRecord(manifest=pack(two)),
        ModelRoute(name="echo", default_version="2", previous_version="1", updated_ms=now_ms()),
    ):
        state.apply(record.key, record)
    return state


async def manager(timeout_s: float) -> tuple[VersionManager, FakePort, Version]:
    port = FakePort(promoted_state())
    settings = WorkerSettings(rollback_warm_timeout_s=timeout_s)

    async def estimate(_config: ModelConfig) -> int:
        return 0

    versions = VersionManager(settings, port.parts(), budget_total=1, trusted_keys={}, estimate=estimate)
    failing = Version("echo@2", None, port.state.versions["echo@2"], state="unhealthy")
    versions.versions["echo@2"] = failing
    return versions, port, failing


# The rollback looks at echo@1's state every 0.05 s while it warms (services/worker/versions.py):
# ten looks without a switch show it waits for readiness, not for a look to happen.
WARMING_S = 0.5


def kinds(records: list) -> list[tuple[str, str]]:
    return [
        (r.served_id, r.desired) if isinstance(r, ModelVersionRecord) else ("route", r.default_version) for r in records
    ]


async def test_the_route_is_switched_back_only_once_the_previous_version_is_ready_here():
    versions, port, failing = await manager(timeout_s=30)
    assert versions._roll_back_if_fresh(failing, "golden departed")
    await until(lambda: port.writes, timeout_s=5, what="echo@1 asked to load")
    await stays_false(
        lambda: len(port.writes) > 1 or port.events,
        for_s=WARMING_S,
        what="the route switched before echo@1 is ready here",
    )
    assert [kinds(w) for w in port.writes] == [[("echo@1", "loaded")]]  # warming: the route not switched yet

    versions.versions["echo@1"] = Version("echo@1", None, port.state.versions["echo@1"], state="ready")
    await until(lambda: len(port.writes) == 2, timeout_s=5, what="the route switched back once echo@1 is ready")
    assert [kinds(w) for w in port.writes] == [[("echo@1", "loaded")], [("route", "1"), ("echo@2", "unloaded")]]
    assert port.events == [
        ("echo@2", "rolled_back", "default of echo back to 1 (echo@1 ready here first): golden departed")
    ]
    await versions.close()


async def test_after_the_warm_timeout_the_route_is_switched_anyway_and_the_event_says_so():
    versions, port, failing = await manager(timeout_s=0.2)
    assert versions._roll_back_if_fresh(failing, "golden departed")
    await until(lambda: port.events, timeout_s=5, what="the rollback event after the warm timeout")
    assert [kinds(w) for w in port.writes] == [[("echo@1", "loaded")], [("route", "1"), ("echo@2", "unloaded")]]
    assert port.events == [
        (
            "echo@2",
            "rolled_back",
            "default of echo back to 1 (switched without echo@1: not ready "
            "here within WEIR_ROLLBACK_WARM_TIMEOUT_S=0.2 s): golden departed",
        )
    ]
    await versions.close()


async def test_a_route_changed_while_warming_is_not_switched_back_and_the_failing_version_is_reloaded():
    versions, port, failing = await manager(timeout_s=30)
    assert versions._roll_back_if_fresh(failing, "golden departed")
    await until(lambda: port.writes, timeout_s=5, what="echo@1 asked to load: the rollback is warming")
    three = ModelConfig(name="echo", version="3", engine="echo", max_model_len=4096)
    for record in (
        ModelVersionRecord(manifest=pack(three)),
        ModelRoute(name="echo", default_version="3", previous_version="2"),
    ):
        port.state.apply(record.key, record)  # an operator promoted echo@3 meanwhile
    versions.versions["echo@1"] = Version("echo@1", None, port.state.versions["echo@1"], state="ready")
    await until(lambda: failing.reloads, timeout_s=5, what="the failing version reloaded")
    assert [kinds(w) for w in port.writes] == [[("echo@1", "loaded")]]  # echo@3's route kept
    assert failing.reloads == 1 and "rolled_back" not in [e for _, e, _ in port.events]
    await versions.close()
