"""What a worker's reply events must be: positions from 0 without a gap or an overlap."""

from __future__ import annotations

from schemas.messages import ReplyDelta, ReplyEnd


def contiguous(events: list[ReplyDelta | ReplyEnd]) -> bool:
    """True when each event starts where the one before ended (a delta's end, from 0) and the
    one terminal comes last, after the last delta's positions."""
    at = 0
    for i, event in enumerate(events):
        if event.seq != at or (isinstance(event, ReplyEnd) and i != len(events) - 1):
            return False
        at = event.end if isinstance(event, ReplyDelta) else at
    return True
