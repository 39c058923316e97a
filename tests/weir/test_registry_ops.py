"""The registry's pure state and operations (schemas/registry.py, weir/registry.py): what a
sequence of records resolves to, and what each operation refuses. The topic itself is exercised
against the real broker by the CLI, batcher, gateway and worker tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.model_repo import ModelConfig, ModelRepository
from schemas.registry import ModelManifest, ModelRoute, ModelVersionRecord, RegistryState, split_ref
from weir.registry import RegistryError, promote, register, rollback, seed_records, set_desired

ROOT = Path(__file__).resolve().parents[2]


def _echo(version: str, created_ms: int | None = None) -> ModelVersionRecord:
    """An echo version's record; packed now, unless `created_ms` says when."""
    manifest = ModelManifest(
        name="echo", version=version, format="echo", location="", serving={"engine": "echo", "max_model_len": 64}
    )
    if created_ms is not None:
        manifest = manifest.model_copy(update={"created_ms": created_ms})
    return ModelVersionRecord(manifest=manifest)


def _state(*records) -> RegistryState:
    state = RegistryState(ModelRepository(models={"echo": ModelConfig(name="echo", engine="echo", version="1")}))
    for record in records:
        state.apply(record.key, record)
    return state


def _apply(state: RegistryState, records) -> None:
    for record in records:
        state.apply(record.key, record)


def test_the_seed_serves_until_the_topic_says_otherwise():
    state = _state()
    assert state.resolve("echo")[0].served_id == "echo@1"
    assert state.resolve("echo@2") == (None, "model version 'echo@2' is not registered")
    _apply(state, register(state, _echo("2")))  # echo has a seed default: no route is written for it
    assert state.resolve("echo")[0].served_id == "echo@1" and state.resolve("echo@2")[0].max_model_len == 64
    _apply(state, promote(state, "echo@2", "ops"))
    assert state.resolve("echo")[0].served_id == "echo@2"


def test_promote_routes_first_then_drains_the_old_default_and_rollback_undoes_it():
    state = _state()
    _apply(state, [_echo("1"), _echo("2")])
    records = promote(state, "echo@2", "ops")
    assert [r.kind for r in records] == ["route", "version"]
    assert records[0].previous_version == "1" and records[1].served_id == "echo@1" and records[1].desired == "unloaded"
    _apply(state, records)
    with pytest.raises(RegistryError, match="already the default"):
        promote(state, "echo@2", "ops")
    back = rollback(state, "echo@2", "golden 0 departed", "worker-1")
    _apply(state, back)
    assert state.resolve("echo")[0].served_id == "echo@1"
    assert state.versions["echo@1"].desired == "loaded" and state.versions["echo@2"].desired == "unloaded"
    assert "golden 0 departed" in state.routes["echo"].reason
    assert rollback(state, "echo@2", "again", "worker-2") == []  # no longer the default: nothing to undo


def test_operations_refuse_what_would_break_serving():
    state = _state(_echo("1"), _echo("2"))
    with pytest.raises(RegistryError, match="default version"):
        set_desired(state, "echo@1", "unloaded", "ops")
    with pytest.raises(RegistryError, match="names no version"):
        set_desired(state, "echo", "loaded", "ops")
    with pytest.raises(RegistryError, match="not registered"):
        promote(state, "echo@9", "ops")
    _apply(state, set_desired(state, "echo@2", "retired", "ops"))
    assert state.resolve("echo@2") == (None, "model version 'echo@2' is retired")
    with pytest.raises(RegistryError, match="retired"):
        set_desired(state, "echo@2", "loaded", "ops")


def test_a_version_is_immutable_and_a_record_under_another_key_is_ignored():
    state = _state(_echo("2"))
    other = _echo("2").model_copy(
        update={"manifest": _echo("2").manifest.model_copy(update={"serving": {"engine": "echo"}})}
    )
    with pytest.raises(RegistryError, match="registered with other files"):
        register(state, other)
    again = _echo("2", created_ms=state.versions["echo@2"].manifest.created_ms + 60_000)  # packed a minute later
    assert [r.key for r in register(state, again)] == ["version:echo@2"]  # the same files again: allowed
    state.apply("version:echo@3", _echo("2"))  # forged: the key names another version
    state.apply("route:other", ModelRoute(name="echo", default_version="2"))
    assert "echo@3" not in state.versions and "other" not in state.routes
    state.apply("version:echo@2", None)  # tombstone
    assert "echo@2" not in state.versions


def test_a_first_version_of_a_new_name_becomes_its_default():
    state = RegistryState()
    records = register(state, ModelVersionRecord(manifest=_echo("7").manifest.model_copy(update={"name": "fresh"})))
    assert [r.kind for r in records] == ["version", "route"] and records[1].default_version == "7"


def test_seed_records_register_the_files_entries_once():
    repo = ModelRepository(models={"echo": ModelConfig(name="echo", engine="echo", version="3")})
    state = RegistryState(repo)
    records = seed_records(repo, state)
    assert [r.key for r in records] == ["version:echo@3", "route:echo"]
    _apply(state, records)
    assert seed_records(repo, state) == []


@pytest.mark.parametrize("ref,parts", [("a@1", ("a", "1")), ("a", ("a", None)), ("a@", ("a", "")), ("@1", ("", "1"))])
def test_split_ref(ref, parts):
    assert split_ref(ref) == parts


@pytest.mark.parametrize("bad", ["", "1 2", "-1", "a/b", "x" * 65, "v@1"])
def test_bad_versions_are_refused(bad):
    with pytest.raises(ValueError):
        ModelConfig(name="echo", engine="echo", version=bad)
    with pytest.raises(ValueError):
        ModelManifest(name="echo", version=bad, format="echo", location="")


def test_names_with_at_are_refused():
    with pytest.raises(ValueError, match="@"):
        ModelConfig(name="a@b", engine="echo")


def test_a_route_to_a_version_nobody_registered_is_disregarded():
    state = _state(_echo("2"))
    state.apply("route:echo", ModelRoute(name="echo", default_version="doesnotexist"))
    assert state.resolve("echo")[0].served_id == "echo@1"  # the seed's default, not a 404
    assert [r.default_version for r in state.dangling_routes()] == ["doesnotexist"]
    state.apply("route:echo", ModelRoute(name="echo", default_version="2"))
    assert state.resolve("echo")[0].served_id == "echo@2" and state.dangling_routes() == []


def test_a_retired_version_cannot_be_promoted_and_the_error_says_why():
    state = _state(_echo("1"), _echo("2"))
    _apply(state, set_desired(state, "echo@2", "retired", "ops"))
    with pytest.raises(RegistryError, match="echo@2 is retired; push it again under a new version"):
        promote(state, "echo@2", "ops")
