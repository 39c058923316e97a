"""Every Kafka topic name, partition count, topic config and consumer group id of Weir.

This is the one module that names them (docs/design.md, invariant 2). A service that needs a topic
or a group asks here; nothing else spells a topic name.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

DEFAULT_PREFIX = "weir"
BATCH_PARTITIONS = 16  # partitions of each model's batch topic: the most workers one model can use

_TOPIC_CHARS = re.compile(r"[^a-zA-Z0-9._-]")
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")  # Kafka's rule for a topic name (and not "." or "..")
MAX_TOPIC_CHARS = 249
# An outside producer's name as a request-topic suffix: a Kafka user name Weir makes (no dot;
# weir/kafka/security.py, check_user_name, holds the same rule).
_PRODUCER_SUFFIX = r"\.[a-z0-9][a-z0-9_-]{0,62}"


def safe_name(name: str) -> str:
    """Return `name` with every character Kafka refuses in a topic name replaced by '_'."""
    return _TOPIC_CHARS.sub("_", name)


def _served_suffix(model: str) -> str:
    """'<safe name>.<safe version>.<8 hex of blake2b(model)>' for 'name@version'; the safe name
    alone for a bare name. Empty for '' (the prefix every such topic starts with: ACLs grant it)."""
    name, at, version = model.rpartition("@")
    if not at:
        return safe_name(model)
    digest = hashlib.blake2b(model.encode(), digest_size=4).hexdigest()
    return f"{safe_name(name)}.{safe_name(version)}.{digest}"


def topic_name_problem(name: object) -> str | None:
    """Why `name` is not a legal Kafka topic name (1-249 characters of ASCII letters, digits, '.',
    '_' and '-', not "." or ".."), or None when it is one."""
    if not isinstance(name, str):
        return f"a topic name is a string, got {type(name).__name__}"
    if not name:
        return "a topic name cannot be empty"
    if len(name) > MAX_TOPIC_CHARS:
        return f"a topic name has at most {MAX_TOPIC_CHARS} characters, this one has {len(name)}"
    if not _TOPIC_NAME.fullmatch(name):
        bad = sorted({c for c in name if not _TOPIC_NAME.fullmatch(c)})
        return f"a topic name holds only ASCII letters, digits, '.', '_' and '-', not {''.join(bad)!r}"
    if name in (".", ".."):
        return f"{name!r} is not a legal topic name"
    return None


MAX_REPLICATION = 3  # replicas of every topic on a cluster of 3 brokers or more


def replication_for(num_brokers: int) -> int:
    """The replication factor of every Weir topic on a cluster of `num_brokers`: min(3, brokers)
    (docs/design.md, "Scale-out and failover")."""
    if num_brokers < 1:
        raise ValueError(f"a cluster has at least one broker, not {num_brokers}")
    return min(MAX_REPLICATION, num_brokers)


@dataclass(frozen=True)
class TopicSpec:
    """A topic the project creates, with the partition count and configs it needs.

    min_insync_replicas: how many replicas must have a record before an acks=all write of it
    succeeds, where the cluster has that many (it is capped at the replication factor, so a
    single broker still takes writes). 2 of 3 by default: one broker may die without losing or
    refusing a write. A topic whose loss is cheap may say 1 and stay writable with one replica.
    """

    name: str
    num_partitions: int
    configs: dict[str, str] = field(default_factory=dict)
    min_insync_replicas: int = 2

    def configs_for(self, replication_factor: int) -> dict[str, str]:
        """The topic's configs on a cluster where it gets `replication_factor` replicas."""
        insync = max(1, min(self.min_insync_replicas, replication_factor))
        return {**self.configs, "min.insync.replicas": str(insync)}


# min.insync.replicas of a topic whose records are rewritten soon or recomputed (heartbeats, rate-limit
# usage, spans, mirror samples, traffic counts): a write refused there would stall a live path for
# nothing, while a lost record costs at most a moment's precision.
_CHEAP = 1
_DELETE_7D = {"cleanup.policy": "delete", "retention.ms": str(7 * 24 * 3600 * 1000)}
# Compacted topics keep the latest record per key: the last cancel of a request, the last
# heartbeat of a worker. Short segment/lag settings make compaction actually run on a dev box.
_COMPACT = {
    "cleanup.policy": "compact",
    "segment.ms": str(600_000),
    "min.compaction.lag.ms": str(60_000),
    "delete.retention.ms": str(3_600_000),
}
# Usage records matter for one rate-limit window (a minute); an hour is plenty.
_USAGE = {"cleanup.policy": "delete", "retention.ms": str(3600 * 1000)}
# Spans: compacted (a span exported twice is kept once) and deleted after a day.
_TRACES = {**_COMPACT, "cleanup.policy": "compact,delete", "retention.ms": str(24 * 3600 * 1000)}
_REPLIES = {"cleanup.policy": "delete", "retention.ms": str(24 * 3600 * 1000)}
# A resumable stream's entry matters for its grace and keep time (minutes): compacted, and gone
# after a day whatever happened to its gateway.
_STREAMS = {**_COMPACT, "cleanup.policy": "compact,delete", "retention.ms": str(24 * 3600 * 1000)}
# Batch files and job commands outlive a job's 24 h window: a week, like the requests.
# Audit anchors are kept for good: `weir audit verify` checks the whole ledger against them.
# Not compacted, so a record written over an anchor's key (a forgery, a tombstone) hides nothing.
_ANCHORS = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}
_FILES = {
    "cleanup.policy": "delete",
    "retention.ms": str(7 * 24 * 3600 * 1000),
    "max.message.bytes": str(2 * 1024 * 1024),
}


@dataclass(frozen=True)
class Topics:
    """Topic names and group ids under one prefix.

    The prefix (default "weir") lets several deployments, or test runs, share one cluster
    without seeing each other's messages.
    """

    prefix: str = DEFAULT_PREFIX

    @property
    def requests(self) -> str:
        """GenerateRequests from the gateway or any producer; keyed by request_id."""
        return f"{self.prefix}.requests"

    @property
    def control(self) -> str:
        """Cancellations, compacted, keyed by request_id."""
        return f"{self.prefix}.control"

    @property
    def workers(self) -> str:
        """Worker heartbeats, compacted, keyed by worker_id."""
        return f"{self.prefix}.workers"

    @property
    def audit(self) -> str:
        """AuditEvents from workers to the auditor."""
        return f"{self.prefix}.audit"

    @property
    def audit_anchors(self) -> str:
        """AuditAnchors: the auditor's keyed checkpoints of its ledger, keyed by "<log>/<chain_id>",
        kept for good (docs/design.md, "The audit chain")."""
        return f"{self.prefix}.audit.anchors"

    @property
    def dead_letter(self) -> str:
        """DeadLetters: messages a consumer could not use, with the reason."""
        return f"{self.prefix}.dlq"

    @property
    def keys(self) -> str:
        """ApiKeyRecords, compacted, keyed by key_id: every gateway reads it whole."""
        return f"{self.prefix}.keys"

    @property
    def usage(self) -> str:
        """UsageRecords: rate-limit consumption each gateway shares with the others."""
        return f"{self.prefix}.usage"

    @property
    def files(self) -> str:
        """FileChunks of batch input and output files, keyed by file_id."""
        return f"{self.prefix}.files"

    @property
    def jobs(self) -> str:
        """BatchJob records, compacted, keyed by job_id: the latest state of every batch job."""
        return f"{self.prefix}.jobs"

    @property
    def job_commands(self) -> str:
        """JobCommands (run, cancel) keyed by job_id; the owner of a partition runs its jobs."""
        return f"{self.prefix}.job_commands"

    def job_replies(self, job_id: str) -> str:
        """The reply topic of one batch job: every ReplyEvent of its requests, kept a week."""
        return f"{self.prefix}.replies.job.{safe_name(job_id)}"

    @property
    def job_runner_group(self) -> str:
        """Consumer group of the job runners (in the batcher processes) on job_commands."""
        return f"{self.prefix}.jobrunner"

    def batches(self, model: str) -> str:
        """Batches of one model version (`name@version`, schemas/registry.py) from the batcher to
        the workers that serve it. The name is readable and, through a short hash of the exact
        served id, unique: 'a_b@1' and 'a.b@1' (same safe_name) never share a topic."""
        return f"{self.prefix}.batches.{_served_suffix(model)}"

    @property
    def models(self) -> str:
        """The model registry (compacted): versions, manifests, routes (schemas/registry.py)."""
        return f"{self.prefix}.models"

    @property
    def shadow_replies(self) -> str:
        """The reply topic of every mirror copy (a reply topic of the deployment): read by the
        comparison (the auditor), never by a client (docs/design.md, "Traffic policies"). Like every
        reply topic it is not a core topic: its reader creates it (reply_spec("shadow"))."""
        return self.replies("shadow")

    @property
    def shadow_live(self) -> str:
        """The live answer of each mirrored request (ShadowLive, from the worker that served it), for the comparison."""
        return f"{self.prefix}.shadow.live"

    @property
    def comparisons(self) -> str:
        """One ModelComparison per mirrored request: live against mirror, no raw text."""
        return f"{self.prefix}.models.comparisons"

    @property
    def traffic(self) -> str:
        """Compacted: per model name, the requests each version served by assignment (TrafficCounts)."""
        return f"{self.prefix}.models.traffic"

    @property
    def traces(self) -> str:
        """SpanRecords keyed `<request_id>/<span_id>` (schemas/telemetry.py): `weir trace` reads it."""
        return f"{self.prefix}.traces"

    @property
    def token_usage(self) -> str:
        """Compacted: UsageTotals and RateCards the auditor folds from the audit stream (schemas/telemetry.py)."""
        return f"{self.prefix}.usage.tokens"

    @property
    def streams(self) -> str:
        """StreamRecords: every gateway's resumable streams, compacted, keyed by request_id, so a
        stream outlives the gateway that accepted it (docs/design.md, "Scale-out and failover")."""
        return f"{self.prefix}.streams"

    @property
    def health(self) -> str:
        """HealthAlerts: drift and staleness of model versions, raised and cleared (schemas/telemetry.py)."""
        return f"{self.prefix}.health"

    @property
    def model_health(self) -> str:
        """What happened to model versions on workers: loads, failures, golden checks, rollbacks."""
        return f"{self.prefix}.models.health"

    def producer_requests(self, producer: str) -> str:
        """The request topic of one outside producer (a Kafka user of a secure deployment, see
        weir/kafka/security.py): only that user may write it, and the batcher binds every request
        read there to it (schemas/producers.py; docs/design.md, "The Kafka trust boundary")."""
        return f"{self.requests}.{safe_name(producer)}"

    def producer_requests_spec(self, producer: str) -> TopicSpec:
        """An outside producer's request topic: the partitions and configs of the requests topic."""
        return TopicSpec(self.producer_requests(producer), 8, _DELETE_7D)

    @property
    def requests_pattern(self) -> str:
        """The regular expression of every topic the batcher reads requests from: the requests
        topic and each outside producer's (`<prefix>.requests.<user>`, a user name has no dot)."""
        return f"^{re.escape(self.requests)}({_PRODUCER_SUFFIX})?$"

    def producer_of(self, topic: str) -> str | None:
        """The outside producer whose request topic `topic` is; None for the requests topic itself.
        ValueError for any other topic (requests_pattern does not match it)."""
        if topic == self.requests:
            return None
        if not re.fullmatch(self.requests_pattern, topic):
            raise ValueError(f"{topic!r} is not a request topic of the deployment {self.prefix!r}")
        return topic[len(self.requests) + 1 :]

    def producer_replies(self, producer: str) -> str:
        """The prefix of an outside producer's reply topics: <prefix>.replies.<user>. (the dot ends
        it, so no user's prefix holds another's)."""
        return self.replies(f"{producer}.")

    def request_source_problem(self, topic: str, reply_to: str) -> str | None:
        """Why a request read from `topic` may not name `reply_to`, or None when it may: a request
        on an outside producer's own topic names one of that producer's reply topics (under
        producer_replies), never another reader's. Requests on the requests topic itself, which only
        trusted principals write in secure mode, are checked by reply_to_problem alone."""
        producer = self.producer_of(topic)
        if producer is None:
            return None
        prefix = self.producer_replies(producer)
        if reply_to.startswith(prefix) and len(reply_to) > len(prefix):
            return None
        return (
            f"reply_to {reply_to!r} is not a reply topic of {producer!r}, whose request topic {topic} this "
            f"record came from: it must be {prefix}<name>"
        )

    def replies(self, instance: str) -> str:
        """The reply topic of one reader (a gateway instance, or any client that names one)."""
        return f"{self.prefix}.replies.{safe_name(instance)}"

    @property
    def batcher_group(self) -> str:
        """Consumer group of all batcher replicas."""
        return f"{self.prefix}.batcher"

    @property
    def auditor_group(self) -> str:
        """Consumer group of all auditor replicas."""
        return f"{self.prefix}.auditor"

    @property
    def canary_guard_group(self) -> str:
        """Consumer group of the auditors' canary guard on model_health (golden failures)."""
        return f"{self.prefix}.auditor.canary-guard"

    @property
    def comparison_group(self) -> str:
        """Consumer group of the auditors' shadow comparison (shadow_replies and shadow_live)."""
        return f"{self.prefix}.auditor.comparison"

    def worker_group(self, model: str) -> str:
        """Consumer group of the workers of one model version (`name@version`): Kafka spreads its
        batches among them."""
        return f"{self.prefix}.worker.{_served_suffix(model)}"

    def core_specs(self) -> list[TopicSpec]:
        """The topics that exist independent of the model repository. Those given _CHEAP stay
        writable with one in-sync replica; why each: docs/kafka.md, "Replication per topic"."""
        return [
            TopicSpec(self.requests, 8, _DELETE_7D),
            TopicSpec(self.control, 4, _COMPACT),
            TopicSpec(self.workers, 1, _COMPACT, min_insync_replicas=_CHEAP),
            TopicSpec(self.audit, 4, _DELETE_7D),
            TopicSpec(self.audit_anchors, 1, _ANCHORS),
            TopicSpec(self.dead_letter, 1, _DELETE_7D),
            TopicSpec(self.keys, 1, _COMPACT),
            TopicSpec(self.usage, 1, _USAGE, min_insync_replicas=_CHEAP),
            TopicSpec(self.files, 4, _FILES),
            TopicSpec(self.jobs, 1, _COMPACT),
            TopicSpec(self.job_commands, 4, _DELETE_7D),
            TopicSpec(self.models, 1, _COMPACT),
            TopicSpec(self.model_health, 1, _DELETE_7D),
            TopicSpec(self.shadow_live, 4, _USAGE, min_insync_replicas=_CHEAP),
            TopicSpec(self.comparisons, 1, _DELETE_7D, min_insync_replicas=_CHEAP),
            TopicSpec(self.traffic, 1, _COMPACT, min_insync_replicas=_CHEAP),
            TopicSpec(self.traces, 4, _TRACES, min_insync_replicas=_CHEAP),
            TopicSpec(self.token_usage, 1, _COMPACT),
            TopicSpec(self.health, 1, _DELETE_7D),
            TopicSpec(self.streams, 4, _STREAMS),
        ]

    def model_specs(self, model: str) -> list[TopicSpec]:
        """The topics one model needs."""
        # 16 partitions: up to 16 workers of a model each own one, and the batcher routes a batch
        # to a partition its chosen worker owns (WorkerHeartbeat.partitions).
        return [TopicSpec(self.batches(model), BATCH_PARTITIONS, _DELETE_7D)]

    def job_reply_spec(self, job_id: str) -> TopicSpec:
        """A batch job's reply topic: one partition, kept as long as the files (a week)."""
        return TopicSpec(self.job_replies(job_id), 1, _DELETE_7D)

    @property
    def namespace(self) -> str:
        """What every topic and group id of this deployment starts with: `<prefix>.`."""
        return f"{self.prefix}."

    @property
    def reply_namespace(self) -> str:
        """What every reply topic of this deployment starts with: `replies()` and `job_replies()`
        make names under it, and a request's `reply_to` must name one (reply_to_problem)."""
        return f"{self.prefix}.replies."

    def reply_to_problem(self, reply_to: object) -> str | None:
        """Why a request may not name `reply_to` as its reply topic, or None when it may.

        The one rule every service applies to a request's `reply_to` where the record enters
        (docs/design.md, "Reply topics"): a legal Kafka topic name, under this deployment's
        reply namespace (`<prefix>.replies.<name>`), never one of its internal topics. Anything
        else could stall the writer (a name the broker refuses) or write replies into a topic
        other services trust (keys, usage, control, audit, the dead-letter topic).
        """
        problem = topic_name_problem(reply_to)
        if problem is not None:
            return f"reply_to {_excerpt(reply_to)} is not a legal Kafka topic name: {problem}"
        assert isinstance(reply_to, str)
        namespace = self.reply_namespace  # no internal topic is under it (tests/schemas/test_reply_to.py)
        if not reply_to.startswith(namespace) or len(reply_to) == len(namespace):
            return (
                f"reply_to {reply_to!r} is not one of this deployment's reply topics: it must be "
                f"{namespace}<name> (weir topics create --reply <name> makes one)"
            )
        return None

    def reply_spec(self, instance: str) -> TopicSpec:
        """A reply topic: one partition keeps one reader's events in order."""
        return TopicSpec(self.replies(instance), 1, _REPLIES)


def _excerpt(value: object, max_chars: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."
