"""`weir models` actions on the model registry (docs/design.md, "The model registry", invariant 10).

    weir models pack DIR --name N --version V [--engine E] [--from-toml models.toml] [--sign-key KEY] [--out FILE]
    weir models push DIR --name N --version V [pack's options] [--goldens P ...|--no-goldens] [--budget-bytes B]
    weir models list [--json]                      every name: default, versions, desired and live state
    weir models show N | N@V [--json]              manifest, files, digest, signature, goldens, route, workers
    weir models load|unload|retire N@V             what operators want of a version
    weir models promote N@V [--force] [--require-similarity S --max-latency-ratio R --max-error-rate E
                        [--min-samples N]]         make it the default (refused unless a live worker has it ready,
                                                   and, with --require-*/--max-*, unless its shadow comparison passes)
    weir models compare N [--json]                 the shadow comparison's summary per (live, mirror) version pair
    weir models health [N] [--json]                each version's freshness, drift and open alerts (Topics.health)
    weir models route N [--default V] [--canary V=PCT ...] [--mirror V=PCT ...] [--clear-canary] [--clear-mirror]
                                                   set its traffic policy (docs/design.md, "Traffic policies")
    weir models seed [--model-repo models.toml]    register the file's entries whose directories exist
    weir models keygen --private F --public F      an Ed25519 key pair for --sign-key and the workers' trust

Every change goes through weir/registry.py's pure operations and publish() (the gateway's admin
API does the same), and the registry is read from its topic each time: there is no other state.
`show` of a name prints its traffic policy and the auditor's live counts (Topics.traffic: requests
per version and assignment, and errors). Live state comes from the workers' heartbeats (Topics.workers, read to its end): a worker whose
latest heartbeat is older than --live-ms is not live. On a secure cluster run these as the admin
principal (WEIR_KAFKA_SECURITY=sasl WEIR_KAFKA_USER=admin), as `weir keys`.

Recording goldens runs the model, which only the worker's engines can: `push` takes that step as
a function from its caller (services/worker/models_cli.py, what `weir models` runs), since weir/
never imports services/ (docs/design.md, "The floors").
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import inspect
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import orjson
from aiokafka.errors import KafkaError

from schemas.codec import DecodeError, decode
from schemas.messages import VersionStatus, WorkerHeartbeat, now_ms
from schemas.model_repo import Engine, ModelConfig, ModelRepository, Quantization, detect_engine, load_model_repo
from schemas.registry import (
    Desired, GoldenCase, ManifestSignature, ModelManifest, ModelRoute, ModelVersionRecord, RegistryState, TrafficCounts,
    split_ref, version_problem,
)
from weir import registry
from weir.bus import BusSettings, read_topic
from weir.home import served_model_dir
from weir.kafka.admin import ensure_topics, wait_for_broker
from weir.models import compare, health
from weir.models.manifest import manifest_file_name, pack, verify_files, write_manifest_file
from weir.models.signing import generate_keypair, sign

RecordGoldens = Callable[[ModelConfig, list[str], int], Any]  # list[GoldenCase], or an awaitable of it

REGISTRY_ACTIONS = ("pack", "push", "list", "show", "load", "unload", "retire", "promote", "compare", "route", "seed",
                    "keygen", "health")
_KAFKA_ACTIONS = frozenset(REGISTRY_ACTIONS) - {"pack", "keygen"}


class ArgumentError(ValueError):
    """Arguments that do not make sense together; the message says which."""


# --- arguments -----------------------------------------------------------------------------------


def add_actions(actions: argparse._SubParsersAction) -> None:
    """The registry actions' subparsers, on `weir models`' parser."""
    pack_p = actions.add_parser("pack", help="write the manifest (sha256 and size of every file) of a model directory")
    _pack_args(pack_p)
    push = actions.add_parser("push", help="pack, verify, record goldens and register a version")
    _pack_args(push)
    push.add_argument("--goldens", action="append", default=[], metavar="PROMPT",
                      help="a golden prompt (repeatable; default: the entry's warmup prompts)")
    push.add_argument("--no-goldens", action="store_true", help="record no goldens")
    push.add_argument("--golden-max-tokens", type=int, default=8, help="tokens of each golden (default %(default)s)")
    push.add_argument("--budget-bytes", type=int, help="memory the version may take on a worker (default: the worker's)")
    push.add_argument("--budget-fraction", type=float,
                      help="or: the share (0-1] of a worker's device memory it may take (a logical slice of the GPU)")
    _kafka_args(push)
    listing = actions.add_parser("list", help="every model: default version, versions, desired and live state")
    _kafka_args(listing, live=True)
    listing.add_argument("--json", action="store_true", help="one JSON object")
    show = actions.add_parser("show", help="one name's versions, or one version: manifest, signature, workers")
    show.add_argument("ref", help="NAME or NAME@VERSION")
    show.add_argument("--json", action="store_true", help="one JSON object")
    _kafka_args(show, live=True)
    for action, text in (("load", "ask the workers to load a version"), ("unload", "ask the workers to drain and "
                         "unload a version"), ("retire", "unload a version for good (requests for it are refused)")):
        parser = actions.add_parser(action, help=text)
        parser.add_argument("ref", help="NAME@VERSION")
        _kafka_args(parser)
    promote = actions.add_parser("promote", help="make a version its name's default (new requests go to it at once)")
    promote.add_argument("ref", help="NAME@VERSION")
    promote.add_argument("--force", action="store_true", help="promote even if no live worker has it ready")
    promote.add_argument("--require-similarity", type=float, metavar="S",
                         help="refuse unless the mean similarity of (default -> it) comparisons is >= S")
    promote.add_argument("--max-latency-ratio", type=float, metavar="R",
                         help="refuse unless its mean TTFT over the default's is <= R")
    promote.add_argument("--max-error-rate", type=float, metavar="E",
                         help="refuse unless the share of its mirror copies that did not finish is <= E (0-1)")
    promote.add_argument("--min-samples", type=int, metavar="N",
                         help="comparisons the checks need (default 20; only with a --require-*/--max-* check)")
    _kafka_args(promote, live=True)
    compare_p = actions.add_parser("compare", help="the shadow comparison of a name's versions, per version pair")
    compare_p.add_argument("ref", help="NAME")
    compare_p.add_argument("--json", action="store_true", help="one JSON object")
    _kafka_args(compare_p)
    health_p = actions.add_parser("health", help="each version's freshness, output entropy and watermark drift, "
                                  "and the auditor's open health alerts")
    health_p.add_argument("ref", nargs="?", metavar="NAME", help="one model name (default: every version)")
    health_p.add_argument("--json", action="store_true", help="one JSON object")
    _kafka_args(health_p)
    route = actions.add_parser("route", help="set a name's traffic policy: default version, canaries, mirrors")
    route.add_argument("ref", metavar="NAME", help="the model name")
    route.add_argument("--default", metavar="V", help="its default version (unchanged when not given)")
    route.add_argument("--canary", action="append", metavar="V=PCT",
                       help="a canary version and its share of requests, percent, sticky per user (repeatable; the "
                            "ones given replace the current canaries)")
    route.add_argument("--mirror", action="append", metavar="V=PCT",
                       help="a mirror version and the share of requests copied to it, percent (repeatable; the ones "
                            "given replace the current mirrors)")
    route.add_argument("--clear-canary", action="store_true", help="remove every canary")
    route.add_argument("--clear-mirror", action="store_true", help="remove every mirror")
    _kafka_args(route)
    seed = actions.add_parser("seed", help="register a models.toml's entries whose directories exist")
    seed.add_argument("--model-repo", type=Path, default=Path(os.environ.get("WEIR_MODEL_REPO", "models.toml")),
                      help="model repository TOML (env WEIR_MODEL_REPO; default %(default)s)")
    _kafka_args(seed)
    keygen = actions.add_parser("keygen", help="make an Ed25519 key pair (PEM; the private one mode 0600)")
    keygen.add_argument("--private", type=Path, required=True, help="private key file to write (must not exist)")
    keygen.add_argument("--public", type=Path, required=True, help="public key file to write (must not exist)")


def _pack_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, nargs="?", help="the model directory (none for engine echo)")
    parser.add_argument("--name", required=True, help="model name")
    parser.add_argument("--version", required=True, help="version string (letters, digits, '.', '_', '-')")
    parser.add_argument("--engine", choices=get_args(Engine), help="runtime (default: the --from-toml entry's, else auto: onnx for a directory holding "
                        "model.onnx, else torch)")
    parser.add_argument("--from-toml", type=Path, help="take the serving settings from this models.toml's entry --name")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output in tokens")
    parser.add_argument("--max-batch-size", type=int, help="most requests per batch")
    parser.add_argument("--max-num-seqs", type=int, help="most sequences running at once in one engine")
    parser.add_argument("--quantization", choices=get_args(Quantization),
                        help="engine torch on the CPU: int8 / int4 weights quantized at load, none: float32")
    parser.add_argument("--sign-key", type=Path, help="Ed25519 private key (PEM) to sign the manifest with")
    parser.add_argument("--out", type=Path, help="manifest file (default: DIR/../NAME@VERSION.manifest.json)")


def _kafka_args(parser: argparse.ArgumentParser, live: bool = False) -> None:
    """Where the deployment is; `live`: the action reads the workers' heartbeats too."""
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (env WEIR_KAFKA_BOOTSTRAP)")
    parser.add_argument("--topic-prefix", help="topic prefix of the deployment (env WEIR_TOPIC_PREFIX)")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for Kafka (default %(default)s)")
    if live:  # the batcher's worker_timeout_ms: 3 heartbeat intervals
        parser.add_argument("--live-ms", type=int, default=3000,
                            help="a worker is live when its latest heartbeat is this recent (default %(default)s)")


# --- the actions ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, record_goldens: RecordGoldens | None = None) -> int:
    """Run one registry action; exit status 0, or 2 with one line on stderr."""
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # its retries would bury the one line below
    try:
        if getattr(args, "ref", None) is not None:  # before any Kafka: a malformed ref is the user's typo
            _, version = _checked_ref(args.ref, need_version=args.action not in ("show", "compare", "route", "health"))
            if args.action == "route" and version is not None:
                raise ArgumentError(f"{args.ref!r}: give the model name alone; versions go in --default, --canary, --mirror")
            if args.action == "compare" and version is not None:
                raise ArgumentError(f"{args.ref!r}: compare takes a NAME (it prints every version pair of it)")
            if args.action == "health" and version is not None:
                raise ArgumentError(f"{args.ref!r}: health takes a NAME (it prints every version of it)")
        if args.action == "promote":
            _thresholds(args)  # nonsense thresholds are a typo too
        if args.action in _KAFKA_ACTIONS:
            settings = _settings(args)
            return asyncio.run(_with_deadline(settings, args, _ASYNC[args.action](settings, args, record_goldens)))
        return _SYNC[args.action](args)
    except (ValueError, OSError, KafkaError, TimeoutError, RuntimeError) as exc:
        # RegistryError, ManifestError, SigningError, ModelRepoError, ArgumentError are ValueErrors;
        # RuntimeError: a topic that does not exist (weir/bus.py: partitions_of).
        print(f"weir models {args.action}: error: {exc}", file=sys.stderr)
        return 2


def _settings(args: argparse.Namespace) -> BusSettings:
    overrides = {"kafka_bootstrap": args.bootstrap, "topic_prefix": args.topic_prefix}
    return BusSettings(**{k: v for k, v in overrides.items() if v is not None})


async def _with_deadline(settings: BusSettings, args: argparse.Namespace, action: Any) -> int:
    """Wait for the broker (--timeout), make sure the registry's and heartbeats' topics exist, then
    run `action`, bounded too: an unreachable or stuck cluster is an error, never a hang. (push
    bounds its Kafka steps itself: recording goldens in between may take minutes.)"""
    try:
        await wait_for_broker(settings.kafka_bootstrap, args.timeout, settings.kafka_options())
        wanted = {settings.topics.models, settings.topics.workers, settings.topics.comparisons, settings.topics.traffic,
                  settings.topics.health}
        await ensure_topics(settings.kafka_bootstrap, [s for s in settings.topics.core_specs() if s.name in wanted],
                            options=settings.kafka_options())
        return await (action if args.action == "push" else _bounded(args, action))
    finally:
        if inspect.iscoroutine(action) and inspect.getcoroutinestate(action) == inspect.CORO_CREATED:
            action.close()  # the broker never answered: the action never started


async def _bounded(args: argparse.Namespace, step: Any) -> Any:
    """`step` (Kafka work), or TimeoutError once it takes longer than --timeout plus a minute."""
    try:
        return await asyncio.wait_for(step, timeout=args.timeout + 60)
    except TimeoutError:
        raise TimeoutError(f"Kafka did not finish within {args.timeout + 60:.0f} s") from None


def _by() -> str:
    return f"{getpass.getuser()} (weir models)"


def _config(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig to pack: the --from-toml entry's serving settings (else the defaults), with
    the name, version and directory given and the options the user set."""
    base: dict[str, Any] = {}
    if args.from_toml is not None:
        entry = load_model_repo(args.from_toml).get(args.name)
        if entry is None:
            raise ArgumentError(f"--from-toml {args.from_toml} has no entry [models.{args.name}]")
        # The files are DIR's: the entry's own path and GGUF/ONNX source do not apply.
        base = entry.model_dump(exclude={"name", "version", "path", "source"})
    for field in ("engine", "max_model_len", "max_batch_size", "max_num_seqs", "quantization"):
        if getattr(args, field) is not None:
            base[field] = getattr(args, field)
    engine = base.get("engine", "auto")
    if engine == "auto" and args.dir is not None:  # as load_model_repo resolves it: the manifest names the runtime
        engine = base["engine"] = detect_engine(args.dir, None)
    if engine == "echo" and args.dir is not None:
        raise ArgumentError("engine echo has no files: give no DIR")
    if engine != "echo" and args.dir is None:
        raise ArgumentError(f"engine {engine} needs the model directory DIR")
    path = {"path": args.dir.resolve()} if args.dir is not None else {}
    try:
        return ModelConfig(name=args.name, version=args.version, **path, **base)
    except ValueError as exc:  # pydantic's ValidationError
        raise ArgumentError(f"invalid model settings: {_first_error(exc)}") from exc


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors())
    return str(exc)


def _pack(args: argparse.Namespace) -> tuple[ModelConfig, ModelManifest, ManifestSignature | None, Path]:
    """Pack (and sign), write the manifest file; returns what push registers and where the file is."""
    config = _config(args)
    manifest = pack(config, config.path)
    signature = sign(manifest, args.sign_key) if args.sign_key is not None else None
    out = args.out
    if out is None:
        if args.dir is None:
            raise ArgumentError("engine echo has no directory to write next to: give --out")
        out = args.dir.resolve().parent / manifest_file_name(manifest)
    write_manifest_file(out, manifest, signature)
    return config, manifest, signature, out


def _describe_pack(manifest: ModelManifest, signature: ManifestSignature | None, out: Path) -> str:
    signed = f"signed by key {signature.key_id}" if signature else "unsigned"
    return (f"{manifest.served_id}: {len(manifest.files)} files, {manifest.total_bytes} bytes, "
            f"digest {manifest.digest()[:16]}, {signed}; manifest in {out}")


def _pack_action(args: argparse.Namespace) -> int:
    _config_, manifest, signature, out = _pack(args)
    print(_describe_pack(manifest, signature, out))
    return 0


def _keygen(args: argparse.Namespace) -> int:
    kid = generate_keypair(args.private, args.public)
    print(f"key {kid}: private key in {args.private} (0600, keep it secret), public key in {args.public} "
          "(copy it into the workers' WEIR_MODEL_TRUSTED_KEYS directory)")
    return 0


async def _goldens(args: argparse.Namespace, config: ModelConfig, record_goldens: RecordGoldens | None) -> list[GoldenCase]:
    if args.no_goldens:
        if args.goldens:
            raise ArgumentError("--goldens and --no-goldens contradict each other")
        return []
    if args.golden_max_tokens < 1:
        raise ArgumentError("--golden-max-tokens must be >= 1")
    if record_goldens is None:
        raise ArgumentError("recording goldens needs the worker's engines: run `weir models push` (or pass --no-goldens)")
    prompts = args.goldens or list(config.warmup)
    if not prompts:
        raise ArgumentError("no golden prompts: give --goldens PROMPT, or --no-goldens")
    cases = record_goldens(config, prompts, args.golden_max_tokens)
    return list(await cases if inspect.isawaitable(cases) else cases)


def _check_new(state: RegistryState, manifest: ModelManifest) -> None:
    """Refuse to push a version again with the same files and settings (only its packing time
    differs, so register() would call them other files): a registered version is immutable, and
    this push's goldens, budget or signature would not replace the registered ones."""
    known = state.versions.get(manifest.served_id)
    if known is not None and known.manifest.model_copy(update={"created_ms": manifest.created_ms}) == manifest:
        raise registry.RegistryError(f"{manifest.served_id} is registered already with these files and settings "
                                     f"(manifest {known.manifest.digest()[:12]}); push a new version to change it")


async def _push(settings: BusSettings, args: argparse.Namespace, record_goldens: RecordGoldens | None) -> int:
    if args.budget_bytes is not None and args.budget_bytes < 1:
        raise ArgumentError("--budget-bytes must be >= 1")
    if args.budget_fraction is not None and not 0 < args.budget_fraction <= 1:
        raise ArgumentError("--budget-fraction must be in (0, 1]")
    if args.budget_fraction is not None and args.budget_bytes is not None:
        raise ArgumentError("give --budget-bytes or --budget-fraction, not both")
    config, manifest, signature, out = _pack(args)
    verify_files(manifest, config.path)  # the files as they are now, after packing: nothing moved under us
    state = await _bounded(args, registry.read_registry(settings))
    _check_new(state, manifest)  # before the goldens, which run the model
    goldens = await _goldens(args, config, record_goldens)
    if goldens:  # that took a while: register against the registry as it is now
        state = await _bounded(args, registry.read_registry(settings))
    record = ModelVersionRecord(manifest=manifest, signature=signature, goldens=goldens, desired="loaded",
                                budget_bytes=args.budget_bytes, budget_fraction=args.budget_fraction,
                                registered_by=_by())
    records = registry.register(state, record)
    await _bounded(args, registry.publish(settings, records))
    print(_describe_pack(manifest, signature, out))
    print(f"registered {manifest.served_id} (desired loaded, {len(goldens)} goldens)"
          + ("; it is the default of its name" if len(records) > 1 else f"; promote it with `weir models promote "
             f"{manifest.served_id}`"))
    return 0


async def read_heartbeats(settings: BusSettings) -> tuple[dict[str, WorkerHeartbeat], int]:
    """The latest heartbeat of every worker (Topics.workers read from its beginning to its end),
    and how many records were not heartbeats (skipped: the topic is written by workers only)."""
    latest: dict[str, WorkerHeartbeat] = {}
    skipped = 0
    for _key, value in await read_topic(settings, settings.topics.workers):
        try:
            hb = decode(WorkerHeartbeat, value)
        except DecodeError:
            skipped += 1
            continue
        known = latest.get(hb.worker_id)
        if known is None or hb.sent_ms >= known.sent_ms:
            latest[hb.worker_id] = hb
    return latest, skipped


async def read_traffic(settings: BusSettings, name: str) -> tuple[TrafficCounts | None, int]:
    """The auditor's latest TrafficCounts of `name` (Topics.traffic, compacted, key = name), and how
    many records of it were skipped (not TrafficCounts, or under another name's key: forged)."""
    latest: TrafficCounts | None = None
    skipped = 0
    for key, value in await read_topic(settings, settings.topics.traffic):
        if key != name.encode():
            continue
        if value is None:  # a tombstone: the counts were deleted
            latest = None
            continue
        try:
            counts = decode(TrafficCounts, value)
        except DecodeError:
            skipped += 1
            continue
        if counts.name != name:
            skipped += 1
            continue
        latest = counts
    return latest, skipped


class _View:
    """The registry and the live workers, read once."""

    def __init__(self, state: RegistryState, skipped: int, heartbeats: dict[str, WorkerHeartbeat],
                 bad_heartbeats: int, live_ms: int) -> None:
        self.state = state
        self.skipped = skipped
        self.bad_heartbeats = bad_heartbeats
        now = now_ms()
        self.live = {w: hb for w, hb in sorted(heartbeats.items()) if now - hb.sent_ms <= live_ms}

    def statuses(self, served_id: str) -> dict[str, VersionStatus]:
        """What each live worker reports of `served_id`."""
        return {w: hb.versions[served_id] for w, hb in self.live.items() if served_id in hb.versions}


async def _view(settings: BusSettings, args: argparse.Namespace) -> _View:
    if args.live_ms < 1:
        raise ArgumentError("--live-ms must be >= 1")
    follower = registry.RegistryFollower(settings, client_id="weir-models")
    await follower.start()
    await follower.stop()
    heartbeats, bad = await read_heartbeats(settings)
    return _View(follower.state, follower.num_skipped, heartbeats, bad, args.live_ms)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=False)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
                     for row in [headers, *rows])


def _live_text(statuses: dict[str, VersionStatus]) -> str:
    return " ".join(f"{w}:{s.state}" for w, s in statuses.items()) or "-"


def _list_json(view: _View) -> dict[str, Any]:
    models = []
    for name in view.state.names():
        versions = [{"version": r.manifest.version, "model": r.served_id, "desired": r.desired,
                     "digest": r.manifest.digest(), "workers": {w: s.model_dump(mode="json") for w, s in
                                                                view.statuses(r.served_id).items()}}
                    for r in view.state.versions_of(name)]
        models.append({"name": name, "default_version": view.state.default_version(name), "versions": versions})
    return {"models": models, "live_workers": list(view.live), "skipped_records": view.skipped,
            "skipped_heartbeats": view.bad_heartbeats}


async def _list(settings: BusSettings, args: argparse.Namespace, _record: RecordGoldens | None) -> int:
    view = await _view(settings, args)
    if args.json:
        print(orjson.dumps(_list_json(view)).decode())
        return 0
    rows = []
    for name in view.state.names():
        default = view.state.default_version(name)
        for r in view.state.versions_of(name) or []:
            mark = "*" if r.manifest.version == default else ""
            rows.append([name, f"{r.manifest.version}{mark}", r.desired, _live_text(view.statuses(r.served_id))])
        if not view.state.versions_of(name):
            rows.append([name, f"{default}*", "(not registered)", "-"])
    for route in view.state.dangling_routes():
        rows.append([route.name, f"{route.default_version}!", "(route to an unregistered version: disregarded)", "-"])
    print(_table(["NAME", "VERSION", "DESIRED", "LIVE WORKERS"], rows) if rows else "no models registered")
    print(f"* default version; {len(view.live)} live worker(s)"
          + (f"; {view.skipped} malformed registry record(s) skipped" if view.skipped else ""))
    return 0


def _budget_text(info: dict[str, Any]) -> str:
    if info["budget_bytes"] is not None:
        return f"{info['budget_bytes']} bytes"
    if info["budget_fraction"] is not None:
        return f"{info['budget_fraction']:g} of the device"
    return "worker default"


def _version_json(view: _View, record: ModelVersionRecord) -> dict[str, Any]:
    m = record.manifest
    return {"model": record.served_id, "format": m.format, "engine": m.serving.get("engine"),
            "quantization": m.serving.get("quantization", "none"), "location": m.location,
            "files": [f.model_dump(mode="json") for f in m.files], "total_bytes": m.total_bytes,
            "digest": m.digest(), "signature_key_id": record.signature.key_id if record.signature else None,
            "goldens": len(record.goldens), "desired": record.desired, "budget_bytes": record.budget_bytes,
            "budget_fraction": record.budget_fraction,
            "registered_by": record.registered_by, "updated_ms": record.updated_ms,
            "workers": {w: s.model_dump(mode="json") for w, s in view.statuses(record.served_id).items()}}


def _version_text(info: dict[str, Any]) -> str:
    lines = [f"{info['model']}  desired {info['desired']}  digest {info['digest']}",
             f"  format {info['format']}, engine {info['engine']}, quantization {info['quantization']}, "
             f"{info['total_bytes']} bytes in "
             f"{len(info['files'])} files at {info['location'] or '-'}",
             f"  signature: {'key ' + info['signature_key_id'] if info['signature_key_id'] else 'unsigned'}; "
             f"goldens: {info['goldens']}; budget: {_budget_text(info)}; "
             f"registered by {info['registered_by'] or '-'}"]
    lines += [f"    {f['sha256'][:16]}  {f['size_bytes']:>12}  {f['path']}" for f in info["files"]]
    for worker, s in info["workers"].items():
        lines.append(f"  worker {worker}: {s['state']}" + (f" ({s['reason']})" if s["reason"] else "")
                     + f", engine {s['engine'] or '-'}, used {s['used_bytes']} of {s['budget_bytes']} bytes")
    if not info["workers"]:
        lines.append("  no live worker reports it")
    return "\n".join(lines)


async def _show(settings: BusSettings, args: argparse.Namespace, _record: RecordGoldens | None) -> int:
    view = await _view(settings, args)
    name, version = split_ref(args.ref)
    records = view.state.versions_of(name)
    if version is not None:
        records = [r for r in records if r.manifest.version == version]
    if not records:
        raise registry.RegistryError(f"{args.ref!r} is not registered (weir models list)")
    route = view.state.routes.get(name)
    versions = [_version_json(view, r) for r in records]
    traffic, bad_traffic = await read_traffic(settings, name)
    if args.json:
        route_json = route.model_dump(mode="json") if route else None
        traffic_json = traffic.model_dump(mode="json") if traffic else None
        print(orjson.dumps({"name": name, "route": route_json, "versions": versions, "traffic": traffic_json,
                            "skipped_traffic_records": bad_traffic}).decode())
        return 0
    print(_policy_text(route) if route else f"{name}: no route")
    print(_traffic_text(traffic, bad_traffic))
    print("\n".join(_version_text(v) for v in versions))
    return 0


def _shares_text(shares: dict[str, float]) -> str:
    return ", ".join(f"{v} {s:g}%" for v, s in sorted(shares.items())) or "none"


def _policy_text(route: ModelRoute) -> str:
    return (f"{route.name}: default {route.default_version} (previous {route.previous_version or '-'}; {route.reason})"
            f"\n  canary: {_shares_text(route.canary)}; mirror: {_shares_text(route.mirror)}")


def _traffic_text(traffic: TrafficCounts | None, skipped: int) -> str:
    """The auditor's counts per version: requests by assignment, errors."""
    note = f" ({skipped} malformed traffic record(s) skipped)" if skipped else ""
    if traffic is None:
        return f"  traffic: no counts from the auditor yet{note}"
    rows = []
    for served_id, by_assignment in sorted(traffic.counts.items()):
        total = sum(by_assignment.values())
        errors = traffic.errors.get(served_id, 0)
        rows.append([served_id, str(total), " ".join(f"{a}={n}" for a, n in sorted(by_assignment.items())),
                     f"{errors} ({errors / total:.1%})" if total else str(errors)])
    table = _table(["  VERSION", "REQUESTS", "BY ASSIGNMENT", "ERRORS"], [["  " + r[0], *r[1:]] for r in rows])
    return f"{table}\n  traffic as the auditor counted it at {traffic.updated_ms} ms{note}"


def _shares(items: list[str] | None, flag: str) -> dict[str, float] | None:
    """{version: percent} of repeated `--flag V=PCT`, or None when the flag was not given."""
    if items is None:
        return None
    shares: dict[str, float] = {}
    for item in items:
        version, eq, pct = item.partition("=")
        if not eq or (problem := version_problem(version)):
            raise ArgumentError(f"{flag} {item!r}: give VERSION=PERCENT" + (f" ({problem})" if eq else ""))
        try:
            share = float(pct)
        except ValueError:
            raise ArgumentError(f"{flag} {item!r}: {pct!r} is not a number (percent, 0-100)") from None
        if version in shares:
            raise ArgumentError(f"{flag} names {version!r} twice")
        shares[version] = share
    return shares


async def _route(settings: BusSettings, args: argparse.Namespace, _record: RecordGoldens | None) -> int:
    name = args.ref  # a bare name: run() refused NAME@VERSION
    if args.canary and args.clear_canary or args.mirror and args.clear_mirror:
        raise ArgumentError("--canary with --clear-canary (or --mirror with --clear-mirror) contradict each other")
    if args.default is not None and (problem := version_problem(args.default)):
        raise ArgumentError(f"--default: {problem}")
    canary = {} if args.clear_canary else _shares(args.canary, "--canary")
    mirror = {} if args.clear_mirror else _shares(args.mirror, "--mirror")
    if args.default is None and canary is None and mirror is None:
        raise ArgumentError("nothing to change: give --default, --canary, --mirror, --clear-canary or --clear-mirror")
    state = await registry.read_registry(settings)
    records = registry.set_route(state, name, _by(), default=args.default, canary=canary, mirror=mirror)
    await registry.publish(settings, records)
    print("\n".join(_policy_text(r) for r in records if isinstance(r, ModelRoute)))
    return 0


def _checked_ref(ref: str, need_version: bool) -> tuple[str, str | None]:
    """(name, version) of NAME or NAME@VERSION; ArgumentError naming what is malformed."""
    name, version = split_ref(ref)
    if not name or any(ch.isspace() or ch == "@" for ch in name):
        raise ArgumentError(f"{ref!r}: the model name must be non-empty, without spaces or '@'")
    if version is None and need_version:
        raise ArgumentError(f"{ref!r} names no version: use NAME@VERSION")
    if version is not None and (problem := version_problem(version)):
        raise ArgumentError(f"{ref!r}: {problem}")
    return name, version


_DESIRED: dict[str, Desired] = {"load": "loaded", "unload": "unloaded", "retire": "retired"}


async def _set_desired(settings: BusSettings, args: argparse.Namespace, _record: RecordGoldens | None) -> int:
    desired: Desired = _DESIRED[args.action]
    state = await registry.read_registry(settings)
    await registry.publish(settings, registry.set_desired(state, args.ref, desired, _by()))
    print(f"{args.ref}: desired {desired}")
    return 0


def _thresholds(args: argparse.Namespace) -> compare.Thresholds | None:
    """promote's comparison checks, or None when none is asked; ArgumentError for nonsense."""
    thresholds = compare.Thresholds(args.require_similarity, args.max_latency_ratio, args.max_error_rate,
                                    20 if args.min_samples is None else args.min_samples)
    if not thresholds.any:
        if args.min_samples is not None:
            raise ArgumentError("--min-samples needs --require-similarity, --max-latency-ratio or --max-error-rate")
        return None
    return thresholds


async def _check_comparison(settings: BusSettings, view: _View, ref: str, thresholds: compare.Thresholds) -> str:
    """The comparison of (current default -> ref) against `thresholds`: a line saying it passed, or
    RegistryError saying why not (docs/design.md, "Traffic policies")."""
    name, _ = split_ref(ref)
    route = view.state.routes.get(name)
    if route is None:
        raise registry.RegistryError(f"{name!r} has no default version: nothing to compare {ref} with")
    live = f"{name}@{route.default_version}"
    if live == ref:
        raise registry.RegistryError(f"{ref} is already the default of {name!r}")
    comparisons, _skipped = await compare.read_comparisons(settings)
    pair = compare.summarize(comparisons, name).get((live, ref))
    failed = thresholds.failures(pair)
    if failed:
        raise registry.RegistryError(f"the comparison {live} -> {ref} does not pass: " + "; ".join(failed))
    assert pair is not None
    return f"the comparison {live} -> {ref} passes ({pair.samples} samples)"


async def _promote(settings: BusSettings, args: argparse.Namespace, _record: RecordGoldens | None) -> int:
    thresholds = _thresholds(args)
    view = await _view(settings, args)
    statuses = view.statuses(args.ref)
    if not args.force and not any(s.state == "ready" for s in statuses.values()):
        seen = f" (live workers report: {_live_text(statuses)})" if statuses else " (no live worker reports it)"
        raise registry.RegistryError(f"no live worker has {args.ref} ready{seen}; load it and wait, or use --force")
    if thresholds is not None:  # --force skips the readiness check, never a comparison asked for
        print(await _check_comparison(settings, view, args.ref, thresholds))
    records = registry.promote(view.state, args.ref, _by())
    await registry.publish(settings, records)
    unloaded = [r.served_id for r in records if isinstance(r, ModelVersionRecord)]
    print(f"{args.ref} is the default of {split_ref(args.ref)[0]!r}"
          + "".join(f"; {served_id} asked to unload (workers drain it)" for served_id in unloaded))
    return 0


async def _compare(settings: BusSettings, args: argparse.Namespace, _record: RecordGoldens | None) -> int:
    """`weir models compare NAME`: Topics.comparisons (the source of truth) read from its beginning,
    summarised per (live, mirror) version pair."""
    name, _ = split_ref(args.ref)
    comparisons, skipped = await compare.read_comparisons(settings)
    pairs = compare.summarize(comparisons, name)
    if args.json:
        print(orjson.dumps({"name": name, "pairs": compare.summary_json(pairs), "skipped": skipped}).decode())
        return 0
    if not pairs:
        print(f"{name}: no comparisons (mirror a version: weir models route {name} --mirror V=100)")
    else:
        print(_table(*compare.summary_rows(pairs)))
    if skipped:
        print(f"({skipped} records on {settings.topics.comparisons} were no comparison: skipped)", file=sys.stderr)
    return 0


async def _health(settings: BusSettings, args: argparse.Namespace, _record: RecordGoldens | None) -> int:
    """`weir models health [NAME]`: the registry's versions with their age, and the latest health
    alert per signal from Topics.health (weir/models/health.py)."""
    name = split_ref(args.ref)[0] if args.ref else None
    state = await registry.read_registry(settings)
    alerts, skipped = await health.read_alerts(settings)
    view = health.health_view(state, alerts, name, now_ms())
    if args.json:
        print(orjson.dumps({"name": name, "versions": view, "skipped": skipped}).decode())
    else:
        print(health.health_text(view, skipped))
    return 0


def _served_dir(config: ModelConfig) -> Path | None:
    """Where `config`'s files are served from: its path, else where its source is built (a GGUF
    import, weir/home.py; an ONNX export, weir/embedding/onnx_export.py). None for echo."""
    if config.engine == "echo":
        return None
    if config.path is None and config.engine == "onnx":
        from weir.embedding.onnx_export import default_export_dir  # loads torch: only for such an entry

        return default_export_dir(config.name)
    return served_model_dir(config.name, config.path, config.source)


def _seedable(repo: ModelRepository) -> tuple[ModelRepository, dict[str, str]]:
    """The entries whose files exist (each with its directory as `path`), and why each other is skipped."""
    ready: dict[str, ModelConfig] = {}
    skipped: dict[str, str] = {}
    for name, config in repo.models.items():
        where = _served_dir(config)
        if where is not None and not where.is_dir():
            build = "" if config.source is None else " (weir models prepare)" if config.engine == "torch" else " (weir up)"
            skipped[name] = f"directory {where} does not exist; build it first{build}" if build else \
                f"directory {where} does not exist"
        else:
            ready[name] = config if where is None else config.model_copy(update={"path": where})
    return ModelRepository(models=ready), skipped


async def _seed(settings: BusSettings, args: argparse.Namespace, _record: RecordGoldens | None) -> int:
    ready, skipped = _seedable(load_model_repo(args.model_repo))
    state = await registry.read_registry(settings)
    records = registry.seed_records(ready, state, registered_by=str(args.model_repo))
    await registry.publish(settings, records)
    for record in records:
        if isinstance(record, ModelVersionRecord):
            print(f"registered {record.served_id}")
        else:
            print(f"route {record.name} -> {record.default_version}")
    for config in ready.models.values():
        if config.served_id in state.versions:
            print(f"kept {config.served_id}: already registered")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return 0


_SYNC: dict[str, Callable[[argparse.Namespace], int]] = {"pack": _pack_action, "keygen": _keygen}
_ASYNC: dict[str, Callable[..., Any]] = {"push": _push, "list": _list, "show": _show, "load": _set_desired,
                                         "unload": _set_desired, "retire": _set_desired, "promote": _promote,
                                         "compare": _compare, "route": _route, "health": _health,
                                         "seed": _seed}
