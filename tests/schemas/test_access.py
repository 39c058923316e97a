"""schemas/access.py is the one declaration of what each service uses on Kafka, and its ACLs
(weir/kafka/security.py: service_grants) are derived from it. Checked here on the source: every
`Topics` member a service's code names (its own package, and the shared weir/ modules it imports,
which run under its principal) is declared for that service, so a new topic or group cannot be
used without its grant (issue 35: the auditor's mirror comparison had none, and a secure start
failed)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from schemas import access
from schemas.topics import Topics
from weir.kafka import security

REPO = Path(__file__).resolve().parents[2]
TOPICS = Topics("acc")

# Members of Topics that name nothing a service reads or writes (spec lists, checks), or that stand
# for another member's names.
NOT_NAMES = {"prefix", "core_specs", "reply_to_problem", "request_source_problem", "producer_of"}
STANDS_FOR = {
    "reply_spec": "replies",
    "job_reply_spec": "job_replies",
    "model_specs": "batches",
    "producer_requests_spec": "producer_requests",
    "requests_pattern": "producer_requests",
}
MEMBERS = {name for name, _ in inspect.getmembers(Topics) if not name.startswith("_")}
# The reply topics a service writes through the reply namespace: naming one of those members is
# covered by a use of reply_namespace (a request names its reply topic; the worker writes it).
UNDER_REPLIES = {"replies", "shadow_replies", "job_replies", "producer_replies"}
# Where a service names a topic it never touches on Kafka, and why.
NAMED_ONLY = {
    ("gateway", "job_replies"): "routes/batches.py: a placeholder reply_to to check a batch line; never written"
}
# Shared modules that name topics only for the super user: weir/kafka/admin.py's grant_deployment_acls and
# add_client_user run as `admin` (`weir kafka up`, `weir topics create --acls`); the functions a service
# calls there take the topics they are given.
ADMIN_ONLY = {REPO / "weir" / "kafka" / "admin.py", REPO / "weir" / "kafka" / "security.py"}


def topics_members_named(source: str, filename: str = "<source>") -> set[str]:
    """The Topics members `source` reads off an expression whose name ends in `topics`
    (`topics.audit`, `self.topics.batches(...)`, `settings.topics.auditor_group`)."""
    found = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in MEMBERS:
            receiver = node.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            if name.endswith("topics"):
                found.add(STANDS_FOR.get(node.attr, node.attr))
    return found - NOT_NAMES


def service_files(service: str) -> list[Path]:
    """The service's package, and the weir/ modules it imports (Kafka plumbing under its login)."""
    own = sorted((REPO / "services" / service).rglob("*.py"))
    shared: set[Path] = set()
    for path in own:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "weir":
                module = REPO / Path(*node.module.split("."))
                shared |= {p for p in (module.with_suffix(".py"), module / "__init__.py") if p.exists()}
    return own + sorted(shared - ADMIN_ONLY)


def undeclared(service: str, members: set[str]) -> set[str]:
    """The members of `members` that `service` does not declare a use of."""
    declared = access.declared_members(service)
    missing = members - declared - {member for (user, member) in NAMED_ONLY if user == service}
    if "reply_namespace" in declared:
        missing -= UNDER_REPLIES
    return missing


@pytest.mark.parametrize("service", access.SERVICES)
def test_every_topic_and_group_a_service_names_is_declared_and_so_granted(service: str) -> None:
    named: dict[str, list[str]] = {}
    for path in service_files(service):
        for member in topics_members_named(path.read_text(), str(path)):
            named.setdefault(member, []).append(str(path.relative_to(REPO)))
    missing = undeclared(service, set(named))
    assert not missing, (
        f"{service} names {sorted(missing)} ({ {m: named[m] for m in missing} }) but "
        f"schemas/access.py declares no use of them: add one (its ACL follows)"
    )


# Uses a service declares that its own code does not name: the lag exporter's prefixes (weir/lag.py
# builds them from the prefix), and what a command run with the service's login reads.
UNNAMED = {
    ("gateway", "namespace"),
    ("batcher", "namespace"),
    ("batcher", "reply_namespace"),
    ("worker", "reply_namespace"),
    ("gateway", "traffic"),
}


@pytest.mark.parametrize("service", access.SERVICES)
def test_a_service_declares_no_use_its_code_does_not_have(service: str) -> None:
    """The other way round: no grant outlives the code that needed it."""
    named = {member for path in service_files(service) for member in topics_members_named(path.read_text())}
    unused = access.declared_members(service) - named - {member for (user, member) in UNNAMED if user == service}
    assert not unused, f"{service} declares {sorted(unused)} in schemas/access.py, but its code names none of them"


def test_the_check_finds_a_use_nobody_declared() -> None:
    """The check above is able to fail: the auditor's comparison code, as it was before its uses
    were declared, is caught."""
    source = (
        "broker.subscriber(settings.topics.shadow_replies, group_id=settings.topics.comparison_group)\n"
        "await broker.publish(value, topic=self.topics.comparisons)\n"
        "ensure_topics(bootstrap, [topics.reply_spec('shadow'), *topics.core_specs()])\n"
    )
    assert topics_members_named(source) == {"shadow_replies", "comparison_group", "comparisons", "replies"}
    assert undeclared("auditor", {"shadow_replies", "comparison_group", "comparisons"}) == set()
    assert undeclared("gateway", {"comparison_group", "comparisons", "keys"}) == {"comparison_group", "comparisons"}
    assert undeclared("worker", {"shadow_replies", "job_replies"}) == set()  # written through the reply namespace
    assert undeclared("auditor", {"replies"}) == {"replies"}


def _covers(grant: security.Grant, resource: str, name: str) -> bool:
    return grant.resource == resource and (
        grant.name == name if grant.pattern == "literal" else name.startswith(grant.name)
    )


@pytest.mark.parametrize("service", access.SERVICES)
def test_each_declared_use_is_exactly_a_grant(service: str) -> None:
    grants = [g for g in security.service_grants(TOPICS) if g.user == service]
    for use in access.uses(service):
        name = use.name(TOPICS)
        allowed = {op for g in grants if _covers(g, use.resource, name) for op in g.operations}
        assert set(use.operations) <= allowed, (service, use)
    # nothing but the declared uses and DESCRIBE on the deployment's core and batch topics
    extra = [
        g
        for g in grants
        if g.operations != ("describe",)
        and not any(
            g.resource == u.resource and g.name == u.name(TOPICS) and g.operations == u.operations
            for u in access.uses(service)
        )
    ]
    assert extra == []


def test_the_mirror_comparison_is_granted_to_the_auditor_and_the_worker() -> None:
    """issue 35's missing grants, by name: the auditor reads (and creates) the mirror copies' reply
    topic and the live answers as its comparison group, and writes the comparisons; a worker writes
    the live answers of mirrored requests."""
    grants = security.service_grants(TOPICS)

    def ops(user: str, resource: str, name: str) -> set[str]:
        return {op for g in grants if g.user == user and _covers(g, resource, name) for op in g.operations}

    assert {"read", "create", "describe"} <= ops("auditor", "topic", TOPICS.shadow_replies)
    assert "read" in ops("auditor", "topic", TOPICS.shadow_live)
    assert "write" in ops("auditor", "topic", TOPICS.comparisons)
    assert "read" in ops("auditor", "group", TOPICS.comparison_group)
    assert "read" in ops("auditor", "group", TOPICS.canary_guard_group)
    assert "write" in ops("worker", "topic", TOPICS.shadow_live)
    assert "write" in ops("worker", "topic", TOPICS.shadow_replies)  # a mirror copy's replies


def test_the_auditor_makes_sure_of_the_topics_it_uses() -> None:
    names = {spec.name for spec in access.needed_specs("auditor", TOPICS)}
    assert {
        TOPICS.shadow_replies,
        TOPICS.shadow_live,
        TOPICS.comparisons,
        TOPICS.audit_anchors,
        TOPICS.traffic,
        TOPICS.token_usage,
        TOPICS.traces,
        TOPICS.models,
        TOPICS.model_health,
    } <= names
    assert TOPICS.keys not in names  # not the auditor's


def test_a_use_names_a_real_member_and_real_operations() -> None:
    with pytest.raises(ValueError, match="no member"):
        access.Use("shadow_topic", ("read",), "a typo")
    with pytest.raises(ValueError, match="operations"):
        access.Use("audit", ("delete",), "not one Weir grants")
