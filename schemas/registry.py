"""The model registry's wire types and its pure state: versions, manifests, routes, health.

A model *version* is `name@version` (docs/design.md, invariant 10). The registry's state is the
compacted topic `<prefix>.models` (Topics.models), one record per key:

    version:<name>@<version>   ModelVersionRecord: its manifest (sha256 and size of every file,
                               engine, format, where it is stored, how it is served), an optional
                               Ed25519 signature, its golden requests, and what the operators
                               want of it (desired: loaded, unloaded, retired)
    route:<name>               ModelRoute: which version of the name serves requests that do not
                               pin one (`model: "name"`), and the one before it (for rollback)

A null value (tombstone) deletes a key. There is no other database: every service folds the topic
from its beginning into a `RegistryState` and keeps following it. What workers *do* with a version
(verifying, loading, ready, failed, unhealthy, draining) is not registry state: each worker says it
for itself in its heartbeat (WorkerHeartbeat.versions) and, for events, on `<prefix>.models.health`.

`models.toml` seeds a local deployment: each of its entries is a version registered as loaded
and, when its name has no route yet, the name's default (weir/registry.py: seed_records).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.messages import _Wire, now_ms
from schemas.model_repo import VERSION_RE, ModelConfig, ModelRepository

VERSION_KEY = "version:"
ROUTE_KEY = "route:"

Desired = Literal["loaded", "unloaded", "retired"]


def served_id_of(name: str, version: str) -> str:
    """`name@version`: how replies, heartbeats, audit records and batches name a model version."""
    return f"{name}@{version}"


def split_ref(ref: str) -> tuple[str, str | None]:
    """('name', 'version') of `name@version`, ('name', None) of a bare name. A name never holds '@'
    (schemas/model_repo.py refuses it), so the last '@' splits."""
    name, at, version = ref.rpartition("@")
    return (name, version) if at else (ref, None)


def version_problem(version: object) -> str | None:
    """Why `version` cannot be a model version string, or None when it can."""
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        return (
            f"version {version!r} must be 1-64 characters of letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return None


class ManifestFile(BaseModel):
    """One file of a model version: its path inside the model directory, sha256 and size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, max_length=1024, description="Relative POSIX path inside the model directory.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the file's bytes, hex.")
    size_bytes: int = Field(ge=0, description="Size of the file in bytes.")

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        parts = value.split("/")
        if value.startswith("/") or "\\" in value or any(p in ("", ".", "..") for p in parts):
            raise ValueError("must be a relative path inside the model directory, without '.', '..' or '\\'")
        return value


class ModelManifest(BaseModel):
    """What a version is: every file with its digest, how it runs, where it is stored.

    `serving` holds the model repository entry's fields (schemas/model_repo.py: ModelConfig,
    without name, version and path): engine, batch bounds, max_model_len, warmup... `location`
    is the directory that holds the files on the workers' storage. The manifest's own digest
    (`digest()`, over its canonical JSON) is what a signature signs and what
    `x-weir-model-version` shows a prefix of.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, description="Model name.")
    version: str = Field(description="Version string.")
    format: Literal["safetensors", "onnx", "echo", "package"] = Field(description="How the weights are stored.")
    location: str = Field(description="Directory holding the files ('' for engine echo).")
    files: list[ManifestFile] = Field(default_factory=list, description="Every file, sorted by path.")
    serving: dict = Field(default_factory=dict, description="ModelConfig fields besides name, version, path.")
    created_ms: int = Field(default_factory=now_ms, description="When it was packed, epoch ms.")

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        problem = version_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if "@" in value or any(ch.isspace() for ch in value):
            raise ValueError("must not contain '@' or whitespace")
        return value

    def canonical(self) -> bytes:
        """The bytes a signature covers: sorted-key JSON of every field."""
        return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)

    def digest(self) -> str:
        """sha256 (hex) of canonical(): the identity of this exact version."""
        return hashlib.sha256(self.canonical()).hexdigest()

    @property
    def served_id(self) -> str:
        return served_id_of(self.name, self.version)

    def config(self) -> ModelConfig:
        """The model repository entry this manifest serves (path = location)."""
        extra = {"path": self.location} if self.location else {}
        return ModelConfig(name=self.name, version=self.version, **extra, **self.serving)

    @property
    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)


class ManifestSignature(BaseModel):
    """An Ed25519 signature over ModelManifest.canonical(), by the key `key_id` names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Literal["ed25519"] = "ed25519"
    key_id: str = Field(min_length=1, max_length=128, description="Which trusted public key verifies it.")
    signature_hex: str = Field(pattern=r"^[0-9a-f]{128}$", description="The 64-byte signature, hex.")


class GoldenCase(BaseModel):
    """A golden request and its expected output, recorded at push: greedy, or (temperature > 0)
    sampled with a fixed seed, which every instance must reproduce (the determinism probe). A record
    written before temperature and seed existed reads as greedy, as it was recorded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["generate", "embed"] = "generate"
    prompt: str = Field(min_length=1, max_length=4096, description="The prompt (or the text to embed).")
    max_tokens: int = Field(8, ge=1, le=256, description="generate: tokens to produce.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="generate: sampling temperature; 0 is greedy.")
    seed: int = Field(0, ge=0, lt=2**63, description="generate: the sampling seed (greedy ignores it).")
    expected_token_ids: list[int] = Field(default_factory=list, description="generate: the expected tokens.")
    expected_vector: list[float] = Field(default_factory=list, description="embed: the expected vector.")
    min_cosine: float = Field(0.999, gt=0, le=1, description="embed: least cosine similarity that passes.")


class ModelVersionRecord(_Wire):
    """Registry record `version:<name>@<version>`."""

    kind: Literal["version"] = "version"
    manifest: ModelManifest = Field(description="The version's identity and files.")
    signature: ManifestSignature | None = Field(None, description="Ed25519 signature of the manifest, if signed.")
    goldens: list[GoldenCase] = Field(default_factory=list, description="Golden requests with expected outputs.")
    desired: Desired = Field("loaded", description="What operators want: loaded, unloaded, or retired (never again).")
    budget_bytes: int | None = Field(
        None,
        ge=0,
        description="Memory the version may take on a worker (weights + KV cache); None: the worker's default.",
    )
    budget_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Or: the share of the worker's device memory it may take (a logical slice of a GPU).",
    )
    registered_by: str = Field("", max_length=256, description="Who registered or last changed it.")
    updated_ms: int = Field(default_factory=now_ms, description="When this record was written, epoch ms.")

    @property
    def served_id(self) -> str:
        return self.manifest.served_id

    @property
    def key(self) -> str:
        return VERSION_KEY + self.served_id


class ModelRoute(_Wire):
    """Registry record `route:<name>`: the version that serves a bare `name`."""

    kind: Literal["route"] = "route"
    name: str = Field(min_length=1, max_length=128, description="Model name.")
    default_version: str = Field(description="The version requests for the bare name go to.")
    previous_version: str | None = Field(None, description="The default before the last promotion (rollback target).")
    canary: dict[str, float] = Field(
        default_factory=dict,
        description="Canary versions and the share of requests (percent, sticky per user) each gets; the default "
        'gets the rest (docs/design.md, "Traffic policies"; schemas/traffic.py).',
    )
    mirror: dict[str, float] = Field(
        default_factory=dict,
        description="Mirror versions and the share of requests (percent) each receives a copy of; their answers "
        "are compared, never returned.",
    )
    reason: str = Field(
        "", max_length=1024, description="Why it was last changed (promote, rollback: golden failed...)."
    )
    updated_ms: int = Field(default_factory=now_ms, description="When this record was written, epoch ms.")

    @property
    def key(self) -> str:
        return ROUTE_KEY + self.name

    @model_validator(mode="after")
    def _policy(self) -> ModelRoute:
        for field_name, shares in (("canary", self.canary), ("mirror", self.mirror)):
            for version, share in shares.items():
                if problem := version_problem(version):
                    raise ValueError(f"{field_name}: {problem}")
                if not 0 <= share <= 100:
                    raise ValueError(f"{field_name}: the share of {version!r} must be 0-100 (percent), not {share}")
            if self.default_version in shares:
                raise ValueError(f"{field_name}: the default version {self.default_version!r} cannot be one")
        if sum(self.canary.values()) > 100:
            raise ValueError(f"canary shares add up to {sum(self.canary.values())}%, more than 100%")
        if set(self.canary) & set(self.mirror):
            raise ValueError(
                f"a version cannot be both canary and mirror: {sorted(set(self.canary) & set(self.mirror))}"
            )
        return self


class ModelHealthEvent(_Wire):
    """On `<prefix>.models.health`: something happened to a version on a worker."""

    worker_id: str = Field(description="The worker.")
    model: str = Field(description="name@version.")
    event: Literal[
        "loaded",
        "load_failed",
        "refused",
        "golden_failed",
        "golden_passed",
        "reloaded",
        "unloaded",
        "rolled_back",
        "canary_stopped",
    ] = Field(description="What happened.")
    detail: str = Field("", max_length=4096, description="The reason, for a person.")
    created_ms: int = Field(default_factory=now_ms, description="When, epoch ms.")


class ShadowLive(_Wire):
    """On `<prefix>.shadow.live`, from the worker: the live answer of a request that was mirrored, so
    the comparison can set it against the mirror's (kept an hour, like usage; raw text never goes to
    the audit log: the comparison keeps only its measures)."""

    request_id: str = Field(max_length=128, description="The live request (the mirror copy's shadow_of).")
    model: str = Field(description="name@version that answered it.")
    assignment: str = Field(description="How that version was chosen (default, canary, pinned).")
    text: str = Field(max_length=1_000_000, description="The answer's text.")
    token_ids: list[int] = Field(default_factory=list, description="The answer's tokens.")
    finish_reason: str = Field(description="How it ended.")
    ttft_ms: float | None = Field(None, ge=0, description="Time to first token the worker measured, ms.")
    tokens_per_s: float | None = Field(None, ge=0, description="Decode rate, tokens per second.")
    created_ms: int = Field(default_factory=now_ms, description="When, epoch ms.")


class ModelComparison(_Wire):
    """On `<prefix>.models.comparisons`, from the auditor: one mirrored request, live against mirror."""

    request_id: str = Field(description="The live request.")
    name: str = Field(description="Model name.")
    live: str = Field(description="name@version that answered the client.")
    mirror: str = Field(description="name@version of the mirror copy.")
    exact_match: bool = Field(description="Same text.")
    token_edit_distance: int = Field(ge=0, description="Levenshtein distance between the two token sequences.")
    similarity: float | None = Field(None, description="Cosine similarity of the two texts' embeddings.")
    live_ttft_ms: float | None = Field(None, description="Live time to first token, ms.")
    mirror_ttft_ms: float | None = Field(None, description="Mirror time to first token, ms.")
    live_tokens_per_s: float | None = Field(None, description="Live decode rate.")
    mirror_tokens_per_s: float | None = Field(None, description="Mirror decode rate.")
    mirror_error: str | None = Field(None, max_length=1024, description="Why the mirror copy did not finish, if so.")
    created_ms: int = Field(default_factory=now_ms, description="When, epoch ms.")


class TrafficCounts(_Wire):
    """On the compacted `<prefix>.models.traffic`, key = name, from the auditor: what each version of
    a name served since the auditor's ledger began, by assignment, and errors."""

    name: str = Field(description="Model name.")
    counts: dict[str, dict[str, int]] = Field(description="name@version -> assignment -> requests.")
    errors: dict[str, int] = Field(default_factory=dict, description="name@version -> requests that ended in error.")
    updated_ms: int = Field(default_factory=now_ms, description="When, epoch ms.")


RegistryRecord = Annotated[ModelVersionRecord | ModelRoute, Field(discriminator="kind")]


class RegistryState:
    """The registry folded from its topic: versions by served id, routes by name. Pure.

    `seed` (a models.toml) fills in what the topic does not hold yet: a name without a route goes
    to its entry's version, and that version, when unregistered, is served as the entry says. So
    a service knows its file's models before the registry has been seeded, and a registered
    version or route always wins over the file.
    """

    def __init__(self, seed: ModelRepository | None = None) -> None:
        self.versions: dict[str, ModelVersionRecord] = {}
        self.routes: dict[str, ModelRoute] = {}
        self.seed: dict[str, ModelConfig] = dict(seed.models) if seed is not None else {}

    def apply(self, key: str, record: ModelVersionRecord | ModelRoute | None) -> None:
        """Take one record (None: a tombstone of `key`)."""
        if key.startswith(VERSION_KEY):
            if record is None:
                self.versions.pop(key[len(VERSION_KEY) :], None)
            elif isinstance(record, ModelVersionRecord) and record.key == key:
                self.versions[record.served_id] = record
        elif key.startswith(ROUTE_KEY):
            if record is None:
                self.routes.pop(key[len(ROUTE_KEY) :], None)
            elif isinstance(record, ModelRoute) and record.key == key:
                self.routes[record.name] = record

    def names(self) -> list[str]:
        """Every model name the registry or the seed knows."""
        return sorted({r.manifest.name for r in self.versions.values()} | set(self.routes) | set(self.seed))

    def versions_of(self, name: str) -> list[ModelVersionRecord]:
        """The registered versions of `name`, oldest record first."""
        return sorted((r for r in self.versions.values() if r.manifest.name == name), key=lambda r: r.updated_ms)

    def default_version(self, name: str) -> str | None:
        """The version a bare `name` goes to: its route's default, else its seed entry's version. A
        route to a version neither registered nor seeded (a forged or stale record: `promote` only
        routes to registered versions) is disregarded, as the fold cannot refuse it on arrival (a
        compacted topic may hold a route before the newest record of its version)."""
        route = self.routes.get(name)
        seeded = self.seed.get(name)
        if route is not None and self.config_of(served_id_of(name, route.default_version)) is not None:
            return route.default_version
        return seeded.version if seeded is not None else None

    def dangling_routes(self) -> list[ModelRoute]:
        """Routes whose default version is neither registered nor seeded (disregarded by default_version)."""
        return [r for r in self.routes.values() if self.config_of(served_id_of(r.name, r.default_version)) is None]

    def config_of(self, served_id: str) -> ModelConfig | None:
        """How version `served_id` (name@version) is served: its manifest's settings, else its seed entry's."""
        record = self.versions.get(served_id)
        if record is not None:
            return record.manifest.config()
        name, version = split_ref(served_id)
        seeded = self.seed.get(name)
        return seeded if seeded is not None and seeded.version == version else None

    def resolve(self, ref: str) -> tuple[ModelConfig | None, str | None]:
        """(the config of the version `ref` names, None) or (None, why not). `ref` is `name` (its
        default version) or `name@version` (that version, pinned)."""
        name, version = split_ref(ref)
        if version is None:
            version = self.default_version(name)
            if version is None:
                return None, f"model {name!r} does not exist"
        served_id = served_id_of(name, version)
        record = self.versions.get(served_id)
        if record is not None and record.desired == "retired":
            return None, f"model version {served_id!r} is retired"
        config = self.config_of(served_id)
        if config is None:
            return None, f"model version {served_id!r} is not registered"
        return config, None

    def servable(self) -> dict[str, ModelConfig]:
        """Every version requests may name (not retired), by served id: registered ones and the seed's."""
        out = {served_id: r.manifest.config() for served_id, r in self.versions.items() if r.desired != "retired"}
        for config in self.seed.values():
            out.setdefault(config.served_id, config)
        return out

    def wanted_loaded(self) -> list[ModelVersionRecord]:
        """Every registered version operators want loaded."""
        return [r for r in self.versions.values() if r.desired == "loaded"]
