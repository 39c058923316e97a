"""Scheduler: a flood of long sequences on a KV cache that holds a few of them ends every one.

Pure: no model runs; each step appends a made-up token to every sequence that samples.
"""

from __future__ import annotations

import random

from services.worker.kv_cache import BlockManager
from services.worker.scheduler import Scheduler
from services.worker.sequence import Sequence

from .factories import make_request


def drive(scheduler: Scheduler, arrivals: list[tuple[int, Sequence]], max_steps: int = 20_000) -> int:
    """Run steps until every sequence produced max_tokens; returns how many finished."""
    rng, pending, num_done = random.Random(0), list(arrivals), 0
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        plan = scheduler.schedule()
        if plan.is_empty and not pending:
            break  # nothing can run: finished, or stalled
        scheduler.commit(plan)
        for chunk in plan.prefills + plan.decodes:
            if chunk.samples:
                chunk.seq.token_ids.append(rng.randrange(300))
                if chunk.seq.num_output_tokens >= chunk.seq.max_tokens:
                    scheduler.remove(chunk.seq)
                    num_done += 1
    return num_done


def test_waiting_sequences_pin_no_cached_blocks_so_a_flood_never_stalls() -> None:
    # 128 blocks of 8 tokens hold three of these sequences at full length (8 + 300 tokens).
    scheduler = Scheduler(BlockManager(128, 8), max_num_seqs=64, max_num_batched_tokens=512)
    seqs = [Sequence(make_request(request_id=f"s{i}"), "p", [100 + i, *range(7)], 300, 0) for i in range(30)]
    assert drive(scheduler, [(0, s) for s in seqs]) == 30
    assert scheduler.num_unfinished == 0 and scheduler.num_preemptions > 0
    assert scheduler.blocks.num_free == 128
