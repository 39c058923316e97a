"""Paged KV cache: fixed-size blocks, block tables per sequence, and the manager that lends them.

The cache is one pair of tensors per layer, k and v: [num_blocks, block_size, kv_heads, head_dim].
A sequence owns a list of block ids (its block table); token i of it lives in slot
block_table[i // block_size] * block_size + i % block_size. Full blocks are shared by content
hash between sequences with the same prompt prefix (prefix caching), reference-counted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Block:
    """One cache block: how many sequences use it, and its content hash when full and cached."""

    block_id: int
    ref_count: int = 0
    content_hash: bytes | None = None


def chain_hash(prev: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block given the hash of the blocks before it: equal prefixes, equal hashes."""
    digest = hashlib.blake2b(prev or b"", digest_size=16)
    digest.update(b",".join(str(t).encode() for t in token_ids))
    return digest.digest()


class BlockManager:
    """Lends cache blocks to sequences. Pure bookkeeping: no tensors.

    Free blocks whose content is still valid stay findable by hash until they are reused
    (least recently freed first), so a later request with the same prefix skips its prefill.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"{num_blocks=} and {block_size=} must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free block ids, in the order they should be reused (oldest freed first)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.num_prefix_queries = 0  # in blocks, every lookup (prefix_hit_rate)
        self.num_prefix_hits = 0
        self.prefix_cache_queries = 0  # in tokens, as vLLM v1 counts them (record_prefix_lookup)
        self.prefix_cache_hits = 0

    @property
    def num_free(self) -> int:
        """Blocks available to allocate (cached-but-free ones included)."""
        return len(self._free)

    @property
    def num_blocks(self) -> int:
        """Total blocks in the cache."""
        return len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """True when `num_blocks` more blocks can be lent now."""
        return num_blocks <= len(self._free)

    def allocate(self) -> int:
        """Lend one free block; raises MemoryError when none is free (callers check can_allocate)."""
        if not self._free:
            raise MemoryError("no free KV-cache block")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.content_hash is not None:  # its cached content is overwritten now
            self._by_hash.pop(block.content_hash, None)
            block.content_hash = None
        block.ref_count = 1
        return block_id

    def free(self, block_table: list[int]) -> None:
        """Return a sequence's blocks; shared blocks stay until their last user frees them."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """Take the cached blocks that hold the longest full-block prefix of `token_ids`.

        Returns (block ids now referenced by the caller, their hashes). At least one prompt token
        is always left uncached so the model computes logits for the last one.
        """
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs if self.enable_prefix_caching else 0
        taken: list[int] = []
        hashes: list[bytes] = []
        prev: bytes | None = None
        for i in range(max_blocks):
            self.num_prefix_queries += 1
            h = chain_hash(prev, token_ids[i * bs : (i + 1) * bs])
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            self.num_prefix_hits += 1
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._free.pop(block_id, None)
            block.ref_count += 1
            taken.append(block_id)
            hashes.append(h)
            prev = h
        return taken, hashes

    def publish(self, block_id: int, content_hash: bytes) -> None:
        """Make a full block findable by its content hash (first writer wins)."""
        if not self.enable_prefix_caching or content_hash in self._by_hash:
            return
        self.blocks[block_id].content_hash = content_hash
        self._by_hash[content_hash] = block_id

    def record_prefix_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count a request's prompt lookup at its first admission, in tokens (vLLM v1's
        prefix_cache_queries/hits); nothing when prefix caching is off, as vLLM."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_cached

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of full prompt blocks found in the cache."""
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Memory one block takes across all layers, k and v."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
