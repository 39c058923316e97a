"""What each service reads, writes and creates on Kafka: the one declaration of every topic and
consumer group a service uses, and why (docs/design.md, invariant 2; docs/kafka.md, "Secure mode").

Names come from `schemas/topics.py` (a `Use` names a member of `Topics`, never a topic string), and
two readers take the declaration as it is:

- a secure deployment's ACLs: `weir/kafka/security.py: service_grants` grants each service exactly
  its uses here (and DESCRIBE on the deployment's core topics), nothing else;
- the services themselves where they make their topics at start (the auditor's
  `AuditorService.start`: `needed_specs`).

tests/schemas/test_access.py reads every service's code and fails when it names a member of
`Topics` that the service's uses here do not declare: a service that starts reading or writing a
new topic, or joins a new group, cannot leave its ACLs behind (issue 35: the auditor's mirror
comparison had no grant, and `weir up --secure` did not start).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.topics import Topics, TopicSpec

SERVICES = ("gateway", "batcher", "worker", "auditor")
OPERATIONS = ("read", "write", "create", "describe")


@dataclass(frozen=True)
class Use:
    """One topic (or topic prefix) or consumer group a service uses, with Kafka's operations.

    member: the `Topics` member that names it: a property (`audit`, `auditor_group`), or a method
        that makes names (`batches`, `replies`), called with `arg`. `prefixed`: the use covers every
        name that starts with that (e.g. `batches("")`: every model version's batch topic).
    """

    member: str
    operations: tuple[str, ...]
    why: str
    arg: str | None = None
    prefixed: bool = False
    group: bool = False  # a consumer group (members ending `_group` are groups anyway)

    def __post_init__(self) -> None:
        unknown = set(self.operations) - set(OPERATIONS)
        if unknown or not self.operations:
            raise ValueError(f"{self.member}: operations are some of {OPERATIONS}, not {self.operations}")
        if not hasattr(Topics, self.member):
            raise ValueError(f"Topics has no member {self.member!r}")

    @property
    def resource(self) -> str:
        """ "topic" or "group": Kafka's resource type of the name."""
        return "group" if self.group or self.member.endswith("_group") else "topic"

    def name(self, topics: Topics) -> str:
        """The topic or group name (or the prefix, when `prefixed`) under `topics`' prefix."""
        value = getattr(topics, self.member)
        if callable(value):
            return value(self.arg or "")
        return value


R, W, C, D = ("read",), ("write",), ("create",), ("describe",)
RW = R + W

# Every Weir name starts with "<prefix>." (Topics.namespace): the lag exporters' DESCRIBE on all of
# the deployment's topics and groups (weir/lag.py).
_LAG = (
    Use(
        "namespace",
        D,
        "exports every group's consumer lag (weir/lag.py): the end offsets of their topics",
        prefixed=True,
    ),
    Use(
        "namespace",
        D,
        "exports every group's consumer lag: lists the groups and reads their offsets",
        prefixed=True,
        group=True,
    ),
)
_TRACES = Use("traces", W, "its own spans (docs/design.md, 'Observability'); reading them is for operators")

USES: dict[str, tuple[Use, ...]] = {
    "gateway": (
        Use("requests", W, "admits requests"),
        Use("control", W, "cancels requests (a client gone, DELETE)"),
        Use("audit", W, "the input guard's review flags"),
        Use("keys", RW, "API keys: it alone writes them (`weir keys` runs as it), every gateway follows them"),
        Use("usage", RW, "rate-limit usage shared between gateways"),
        Use("files", RW, "batch input and output files"),
        Use("jobs", RW, "batch jobs' state"),
        Use("job_commands", W, "runs and cancels batch jobs"),
        Use("dead_letter", W, "what it cannot use"),
        Use("workers", R, "worker heartbeats: routing, admission, `weir models list`"),
        Use(
            "replies",
            R + C,
            "its own reply topic, which it creates (WEIR_GATEWAY_ID starts `gateway-`)",
            arg="gateway-",
            prefixed=True,
        ),
        Use("streams", RW, "resumable streams: registers its own, follows the others' to resume them"),
        Use(
            "batches",
            R,
            "counts the batch records no worker has read (admission from the queue)",
            arg="",
            prefixed=True,
        ),
        Use("worker_group", D, "each model's group offsets, for the same count", arg="", prefixed=True),
        Use("models", RW, "the registry: its admin API writes it, routing follows it"),
        Use("traffic", R, "traffic counts (`weir models show`, run with the gateway's login)"),
        Use("token_usage", R, "token usage and rate cards (GET /v1/usage)"),
        Use("health", R, "health alerts (the dashboard)"),
        _TRACES,
        *_LAG,
    ),
    "batcher": (
        Use("requests", RW, "reads requests as its group; a batch job's lines become requests on it"),
        Use(
            "producer_requests",
            R + D,
            "every outside producer's own request topic, read by pattern",
            arg="",
            prefixed=True,
        ),
        Use("control", RW, "cancellations: follows them, and cancels a cancelled batch job's requests"),
        Use("workers", R, "worker heartbeats: routing"),
        Use("job_commands", R, "batch jobs to run"),
        Use("jobs", RW, "batch jobs' state"),
        Use("files", RW, "batch input files, and the output files it writes"),
        Use("dead_letter", W, "requests it cannot use, with the reason"),
        Use(
            "batches",
            W + C,
            "each model version's batches; it makes the topic of each version registered",
            arg="",
            prefixed=True,
        ),
        Use(
            "reply_namespace",
            W,
            "the terminal reply of a request it ends itself (unknown model, expired)",
            prefixed=True,
        ),
        Use("job_replies", R + C, "a batch job's own reply topic, which it creates and reads", arg="", prefixed=True),
        Use("shadow_replies", W, "names it as the reply_to of mirror copies (docs/design.md, 'Traffic policies')"),
        Use("batcher_group", R, "its consumer group on the request topics"),
        Use("job_runner_group", R, "the job runners' group on job_commands"),
        Use("models", R, "the registry: routes, versions"),
        _TRACES,
        *_LAG,
    ),
    "worker": (
        Use("batches", R, "its model versions' batches", arg="", prefixed=True),
        Use("worker_group", R, "each model version's group of workers", arg="", prefixed=True),
        Use("control", R, "cancellations"),
        Use("reply_namespace", W, "replies, to whichever reply topic of the deployment a request names", prefixed=True),
        Use("audit", W, "one audit event per request"),
        Use("workers", W, "its heartbeats"),
        Use("dead_letter", W, "batches it cannot use"),
        Use("shadow_live", W, "the live answer of each mirrored request, for the comparison"),
        Use("models", RW, "the registry: follows it, and rolls back a promotion whose goldens fail"),
        Use("model_health", W, "loads, failures, golden checks, rollbacks"),
        _TRACES,
    ),
    "auditor": (
        Use("audit", R, "the audit events, as its group"),
        Use("auditor_group", R, "its consumer group on the audit topic"),
        Use("audit_anchors", RW + C, "publishes its checkpoints, reads them back to verify; creates it when missing"),
        Use("dead_letter", W, "what it cannot use"),
        Use("models", RW, "follows the registry; its canary guard writes a failing canary's route"),
        Use("model_health", RW, "reads golden failures (its canary guard), records canary_stopped"),
        Use("canary_guard_group", R, "its canary guard's group on model_health"),
        Use("traffic", W, "traffic counts per version"),
        Use("token_usage", W, "token usage totals and rate cards: it alone keeps them"),
        Use("health", RW, "health alerts: judges and writes them, reads back the latest"),
        Use(
            "shadow_replies",
            R + C + D,
            "the mirror copies' replies, for the comparison; like every reply topic, its reader creates it",
        ),
        Use("shadow_live", R, "the live answers of mirrored requests, for the comparison"),
        Use("comparison_group", R, "its comparison's group on shadow_replies and shadow_live"),
        Use("comparisons", W, "one ModelComparison per mirrored request"),
        _TRACES,
    ),
}


def uses(service: str) -> tuple[Use, ...]:
    """What `service` (gateway, batcher, worker, auditor) uses; KeyError for another name."""
    return USES[service]


def declared_members(service: str) -> set[str]:
    """The `Topics` members `service` declares a use of."""
    return {use.member for use in USES[service]}


def needed_specs(service: str, topics: Topics) -> list[TopicSpec]:
    """The core topics `service` uses (read or written), and the reply topics it creates: what it
    makes sure exist at start, with the grants it has (a secure deployment's admin made them first)."""
    names = {use.name(topics) for use in USES[service] if use.resource == "topic" and not use.prefixed}
    specs = [spec for spec in topics.core_specs() if spec.name in names]
    if topics.shadow_replies in names and any(
        "create" in u.operations for u in USES[service] if u.member == "shadow_replies"
    ):
        specs.append(topics.reply_spec("shadow"))
    return specs
