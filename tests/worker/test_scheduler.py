"""Scheduler: a flood of long sequences on a KV cache that holds a few of them ends every one.

Pure: no model runs; each step appends a made-up token to every sequence that samples.
"""

from __future__ import annotations

import random

from services.worker.engine.kv_cache import BlockManager
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import Sequence

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


def seq_of(request_id: str, priority: str, prompt_len: int = 8, max_tokens: int = 50) -> Sequence:
    first = 1000 * (sum(map(ord, request_id)) % 97)  # distinct prompts: no prefix is shared
    prompt = list(range(first, first + prompt_len))
    return Sequence(make_request(request_id=request_id, priority=priority), "p", prompt, max_tokens, 0)


def step(scheduler: Scheduler) -> None:
    """Run one planned step: commit it and append a made-up token to every sequence that samples."""
    plan = scheduler.schedule()
    scheduler.commit(plan)
    for chunk in plan.prefills + plan.decodes:
        if chunk.samples:
            chunk.seq.token_ids.append(7)


def test_interactive_sequences_wait_ahead_of_bulk_ones() -> None:
    scheduler = Scheduler(BlockManager(64, 8), max_num_seqs=8, max_num_batched_tokens=512)
    for seq in (
        seq_of("b1", "bulk"),
        seq_of("b2", "bulk"),
        seq_of("i1", "interactive"),
        seq_of("b3", "bulk"),
        seq_of("i2", "interactive"),
    ):
        scheduler.add(seq)
    assert [s.request_id for s in scheduler.waiting] == ["i1", "i2", "b1", "b2", "b3"]


def test_an_interactive_newcomer_preempts_the_newest_bulk_sequence_when_slots_are_full() -> None:
    scheduler = Scheduler(BlockManager(64, 8), max_num_seqs=2, max_num_batched_tokens=512)
    bulk = [seq_of("b1", "bulk"), seq_of("b2", "bulk")]
    for seq in bulk:
        scheduler.add(seq)
    step(scheduler)
    scheduler.add(seq_of("i1", "interactive"))
    plan = scheduler.schedule()
    assert [c.seq.request_id for c in plan.prefills] == ["i1"]
    assert [c.seq.request_id for c in plan.decodes] == ["b1"]  # b2's planned decode was taken out
    assert [s.request_id for s in plan.preempted] == ["b2"]
    assert [s.request_id for s in scheduler.running] == ["b1", "i1"]
    assert [s.request_id for s in scheduler.waiting] == ["b2"] and bulk[1].block_table == []


def test_an_interactive_newcomer_preempts_bulk_for_blocks_but_bulk_never_preempts_interactive() -> None:
    # 6 blocks of 8 tokens; after one step i1 holds 2 blocks and b1 holds 3.
    scheduler = Scheduler(BlockManager(6, 8), max_num_seqs=8, max_num_batched_tokens=512)
    scheduler.add(seq_of("i1", "interactive", prompt_len=8))
    scheduler.add(seq_of("b1", "bulk", prompt_len=23))
    step(scheduler)
    scheduler.add(seq_of("i2", "interactive", prompt_len=12))  # needs 2 blocks, 1 is free
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.preempted] == ["b1"]
    assert [c.seq.request_id for c in plan.prefills] == ["i2"]
    scheduler.commit(plan)
    scheduler.add(seq_of("b2", "bulk", prompt_len=24))
    plan = scheduler.schedule()  # neither bulk sequence fits beside i1 and i2: they wait
    assert plan.preempted == [] and [s.request_id for s in scheduler.running] == ["i1", "i2"]
    assert [s.request_id for s in scheduler.waiting] == ["b1", "b2"]


def test_a_mixed_flood_on_a_small_cache_ends_every_sequence() -> None:
    scheduler = Scheduler(BlockManager(128, 8), max_num_seqs=16, max_num_batched_tokens=256)
    arrivals = [
        (i * 3, seq_of(f"s{i}", "interactive" if i % 3 == 0 else "bulk", prompt_len=8 + i % 5, max_tokens=200))
        for i in range(40)
    ]
    assert drive(scheduler, arrivals) == 40


def test_without_priorities_every_sequence_is_one_lane() -> None:
    scheduler = Scheduler(BlockManager(64, 8), max_num_seqs=1, max_num_batched_tokens=512, is_prioritized=False)
    for seq in (seq_of("b1", "bulk"), seq_of("i1", "interactive")):
        scheduler.add(seq)
    assert [s.request_id for s in scheduler.waiting] == ["b1", "i1"]
    step(scheduler)
    assert scheduler.schedule().preempted == [] and [s.request_id for s in scheduler.running] == ["b1"]
