"""Continuous-batching scheduler: which sequences run in the next step, and on which KV blocks.

Each step has a token budget shared by decodes (one token each) and prefill chunks. Running
sequences decode first; what budget remains prefills waiting prompts in chunks, so a long prompt
never stalls the streams already running. When blocks run out the newest running sequence is
preempted: its blocks are freed and it is recomputed later. Pure: no tensors, no clock.

Priority: the waiting queue is ordered by lane (interactive before bulk), first come first
served within a lane. An interactive sequence that finds no free slot or no blocks preempts the
newest running bulk sequence (recomputed later), so a bulk flood the worker already holds never
keeps an interactive request waiting for its first token; bulk never preempts interactive.
With is_prioritized=False (a model whose lane_policy is "fifo") every sequence is one lane.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.worker.engine.kv_cache import BlockManager, chain_hash
from services.worker.engine.sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    """Compute K/V for seq.token_ids[start:end]; sample a token when end == len(token_ids)."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == len(self.seq.token_ids)


@dataclass
class StepPlan:
    """The work of one engine step: prefill chunks first, then decodes."""

    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Waiting and running queues over one BlockManager."""

    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, is_prioritized: bool = True
    ) -> None:
        self.blocks = blocks
        self.is_prioritized = is_prioritized
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence: after every waiting one of its lane or a more urgent one."""
        seq.status = Status.WAITING
        if not self.is_prioritized:
            seq.rank = 0
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].rank > seq.rank:
            index -= 1
        self.waiting.insert(index, seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, cancelled, failed) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def schedule(self) -> StepPlan:
        """Plan the next step."""
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        # 1. decodes and unfinished prefills of running sequences, oldest first
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below while making room for an older sequence
            if budget <= 0:
                break
            take = min(seq.num_pending, budget)
            if not self._reserve(seq, seq.num_computed + take, plan):
                continue
            chunk = ScheduledChunk(seq, seq.num_computed, seq.num_computed + take)
            (plan.decodes if seq.is_decoding else plan.prefills).append(chunk)
            budget -= take
        # 2. admit waiting sequences while budget, sequence slots and blocks allow
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                freed = self._preempt_lower(seq, plan)
                if freed is None:
                    break
                budget += freed
            if not seq.block_table and seq.prompt_logprobs is None:  # a cached prefix has no logits to give
                seq.block_table, seq.block_hashes = self.blocks.match_prefix(seq.token_ids)
                seq.num_computed = len(seq.block_table) * self.blocks.block_size
            take = min(seq.num_pending, budget)
            while not self.blocks.can_allocate(
                self.blocks.blocks_needed(seq.num_computed + take) - len(seq.block_table)
            ):
                freed = self._preempt_lower(seq, plan)
                if freed is None:
                    break
                budget += freed
            else:
                if seq.num_cached_prompt_tokens is None:  # first admission: a preemption's lookups are not counted
                    seq.num_cached_prompt_tokens = seq.num_computed
                    self.blocks.record_prefix_lookup(len(seq.token_ids), seq.num_computed)
                self._grow(seq, seq.num_computed + take)
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                plan.prefills.append(ScheduledChunk(seq, seq.num_computed, seq.num_computed + take))
                budget -= take
                continue
            # Wait for running sequences to free blocks; never preempt for a newcomer of the same
            # lane. Give back the prefix blocks just matched: waiting sequences that pin cached
            # blocks can starve every running one of blocks until nothing runs at all.
            self._release(seq)
            break
        return plan

    def commit(self, plan: StepPlan) -> None:
        """After the model ran `plan`: mark K/V computed and publish newly full blocks for reuse."""
        bs = self.blocks.block_size
        for chunk in plan.prefills + plan.decodes:
            seq = chunk.seq
            seq.num_computed = chunk.end
            while len(seq.block_hashes) < seq.num_computed // bs:
                i = len(seq.block_hashes)
                h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, seq.token_ids[i * bs : (i + 1) * bs])
                seq.block_hashes.append(h)
                self.blocks.publish(seq.block_table[i], h)

    def _reserve(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Ensure `seq` has blocks for `num_tokens`, preempting newer sequences if needed."""
        need = self.blocks.blocks_needed(num_tokens) - len(seq.block_table)
        while not self.blocks.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        self._grow(seq, num_tokens)
        return True

    def _preempt_lower(self, seq: Sequence, plan: StepPlan) -> int | None:
        """Preempt the newest running sequence of a lower lane than `seq`, taking its chunk out
        of `plan`; returns the budget tokens that frees, or None when there is none to preempt."""
        victim = next((r for r in reversed(self.running) if r.rank > seq.rank), None)
        if victim is None:
            return None
        freed = 0
        for chunks in (plan.prefills, plan.decodes):
            for chunk in [c for c in chunks if c.seq is victim]:
                chunks.remove(chunk)
                freed += chunk.end - chunk.start
        self._preempt(victim)
        plan.preempted.append(victim)
        return freed

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) < self.blocks.blocks_needed(num_tokens):
            seq.block_table.append(self.blocks.allocate())

    def _preempt(self, seq: Sequence) -> None:
        # Recompute rather than swap: drop the KV and prefill prompt + output again later.
        self.num_preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        index = 0  # first of its lane: it was admitted before every waiting one of its lane
        while index < len(self.waiting) and self.waiting[index].rank < seq.rank:
            index += 1
        self.waiting.insert(index, seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0
