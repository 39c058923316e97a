"""Traffic policies in the batcher (docs/design.md, "Traffic policies"): which version a bare name
of an outside producer goes to, and which mirror copies a live request gets. Pure: the registry
state comes in, requests go out; the choices themselves are schemas/traffic.py's, shared with the
gateway, so a request is assigned alike wherever it is resolved.
"""

from __future__ import annotations

from schemas.messages import EmbedRequest, GenerateRequest
from schemas.registry import RegistryState, served_id_of, split_ref
from schemas.traffic import assign, assignment_key, mirrors

Request = GenerateRequest | EmbedRequest

MIRROR_ID_INFIX = ".mirror."
DEFAULT_MIRROR_MAX_QUEUED = 1000  # mirror copies held at once before new ones are dropped (WEIR_MIRROR_MAX_QUEUED)
_MAX_REQUEST_ID = 128  # GenerateRequest.request_id's bound
_MAX_MIRRORS = 8  # GenerateRequest.mirrors' bound


def assign_version(req: Request, models: RegistryState) -> Request:
    """`req` with its version chosen and recorded (`assignment`), when nobody did yet.

    The gateway assigns its requests (their `assignment` is set): they are left alone. A request
    naming `name@version` is `pinned`. A bare name goes to a canary or the default by the sticky
    hash of its key (`user`, else principal, else request id); a canary chosen but not servable
    here (unregistered, retired) falls back to the default, so the other canaries' users stay put.
    A name without a default version is left as it is: the planner rejects it.
    """
    if req.assignment is not None:
        return req
    name, version = split_ref(req.model)
    if version is not None:
        return req.model_copy(update={"assignment": "pinned"})
    default = models.default_version(name)
    if default is None:
        return req
    route = models.routes.get(name)
    canary = route.canary if route is not None else {}
    chosen, how = assign(name, default, canary, assignment_key(req.user, req.principal, req.request_id))
    if how == "canary" and models.resolve(served_id_of(name, chosen))[0] is None:
        chosen, how = default, "default"
    return req.model_copy(update={"model": served_id_of(name, chosen), "assignment": how})


def mirror_id(request_id: str, version: str) -> str:
    """The request id of the copy of `request_id` for mirror `version`."""
    return f"{request_id}{MIRROR_ID_INFIX}{version}"


def with_mirrors(req: Request, models: RegistryState, shadow_reply_to: str) -> tuple[Request, list[Request]]:
    """(the live request with `mirrors` set, its mirror copies) under its name's route.

    A copy is a request of its own (docs/design.md, "Traffic policies"): id `<live>.mirror.<v>`,
    `shadow_of` the live id, the mirror version, the bulk lane, assignment `mirror`, and its
    replies go to `shadow_reply_to` (the comparison's topic), never to the client. Versions that do
    not resolve here, the version serving the live request itself, and copies whose id would pass
    the request id bound get no copy and are not listed; at most 8 copies (the bound of
    `mirrors`). A copy is never mirrored again, and only generations are mirrored (the comparison
    is of generated text).
    """
    if req.shadow_of is not None or not isinstance(req, GenerateRequest):
        return req, []
    name, live_version = split_ref(req.model)
    route = models.routes.get(name)
    if route is None or not route.mirror:
        return req, []
    if live_version is None:
        live_version = models.default_version(name)
    copies: list[Request] = []
    for version in mirrors(name, route.mirror, req.request_id):
        copy_id = mirror_id(req.request_id, version)
        served_id = served_id_of(name, version)
        if version == live_version or len(copy_id) > _MAX_REQUEST_ID or models.resolve(served_id)[0] is None:
            continue
        if len(copies) == _MAX_MIRRORS:
            break
        copies.append(
            req.model_copy(
                update={
                    "request_id": copy_id,
                    "shadow_of": req.request_id,
                    "model": served_id,
                    "priority": "bulk",
                    "assignment": "mirror",
                    "reply_to": shadow_reply_to,
                    "mirrors": [],
                }
            )
        )
    if not copies:
        return req, []
    live = req.model_copy(update={"mirrors": [split_ref(c.model)[1] for c in copies]})
    return live, copies


def forged_traffic_fields(req: Request, shadow_reply_to: str, from_producer: bool = False) -> str | None:
    """Why a request read from a requests topic is refused for its traffic fields, or None.

    Only the batcher makes mirror copies and lists them (`shadow_of`, `mirrors`, assignment
    `mirror`), in its own queues, and only those reply to the shadow topic: a record that carries
    them, or names that topic, was forged (or misrouted), and would put a made-up answer into the
    comparison. An assignment is recorded with the version it chose (the gateway sends
    `name@version`): one on a bare name was not made by Weir, and would be counted for a version
    that did not serve it. An outside producer (`from_producer`: read from its own request topic)
    never assigns: the batcher does, for its bare names, and its `name@version` is `pinned`.
    """
    if req.assignment is not None and split_ref(req.model)[1] is None:
        return (
            f"assignment={req.assignment!r} on the bare name {req.model!r}: Weir assigns versions; send the "
            "bare name without an assignment, or pin name@version"
        )
    if from_producer and req.assignment is not None:
        return "assignment is set by Weir (the batcher assigns an outside producer's requests); send it without one"
    if req.shadow_of is not None or req.assignment == "mirror":
        return "shadow_of and assignment 'mirror' are set only by the batcher, on its own mirror copies"
    if req.mirrors:
        return "mirrors is set only by the batcher, on the live request it copied"
    if req.reply_to == shadow_reply_to:
        return f"reply_to={shadow_reply_to!r} is the mirror copies' reply topic (the comparison's), not a client's"
    return None
