"""`BlockManager`: fixed-size KV blocks, per-sequence block tables, reference counts and a prefix cache.

A block holds the K/V of `block_size` consecutive positions of one sequence. A full block whose K/V
are computed is registered under a chained hash of (previous block's hash, its token ids); a later
sequence with the same token prefix takes that block (ref count + 1) instead of recomputing it.
Freed blocks keep their hash until they are reused, so the prefix cache survives a finished request
(LRU eviction: the least recently freed block is reused first).
Invariant: a block is written only by the one sequence that allocated it, before it is registered.
"""
from __future__ import annotations

from collections import OrderedDict

from moeloop.rollout.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "key")

    def __init__(self, block_id: int):
        self.block_id, self.ref_count = block_id, 0
        self.hash: int | None = None
        self.key: tuple | None = None  # (prev hash, token ids): guards against hash collisions


def block_key(prev_hash: int | None, token_ids: list[int]) -> tuple:
    return (prev_hash, tuple(token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.hashed: set[int] = set()  # ids of blocks whose hash is set (what a reset must clear)
        self.num_prefix_hit_blocks = 0  # counters for tests and metrics
        self.num_allocated_blocks = 0

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, leaving at least one token to compute."""
        hits, prev = [], None
        for i in range((len(seq) - 1) // self.block_size):
            key = block_key(prev, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            bid = self.cached.get(hash(key))
            if bid is None or self.blocks[bid].key != key:
                break
            hits.append(bid)
            prev = self.blocks[bid].hash
        return hits

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> int:
        """Free blocks consumed by giving `seq` K/V room for `num_new_tokens` more tokens."""
        if hits is None:  # on every scheduled sequence every step: arithmetic inline
            return max(0, -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table))
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # cached but sitting in the free list
        total = self.blocks_for(len(hits) * self.block_size + num_new_tokens)
        return total - len(hits) + revived

    def fork_blocks_needed(self, seq: Sequence) -> int:
        """Free blocks a fork of `seq`'s prompt takes: one for the partial last prompt block, if any."""
        return int(seq.num_prompt_tokens % self.block_size != 0)

    # --- mutations -----------------------------------------------------------------------------
    def fork(self, seq: Sequence, leader: Sequence) -> None:
        """Give a fresh follower its leader's prompt K/V (computed in this step): the full prompt blocks by reference
        and a fresh block for the partial last one, whose slots the runner copies from the leader's after the forward."""
        assert not seq.block_table and seq.num_computed_tokens == 0 and leader.num_prompt_tokens == seq.num_prompt_tokens
        num_full = seq.num_prompt_tokens // self.block_size
        for bid in leader.block_table[:num_full]:
            self.blocks[bid].ref_count += 1  # held by the leader: never in the free list
        seq.block_table = leader.block_table[:num_full]
        seq.num_hashed_blocks = 0  # its first commit walks them: hashed by the leader, or (leader preempted first) by it
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.num_prefix_hit_blocks += num_full
        self.grow(seq, 0)

    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Give a sequence with an empty block table its cached prefix blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.num_prefix_hit_blocks += len(hits)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append fresh blocks so positions up to num_computed + num_new_tokens have slots."""
        need = self.new_blocks_needed(seq, num_new_tokens)
        if need > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self.free)} free")
        for _ in range(need):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None and self.cached.get(block.hash) == bid:
                del self.cached[block.hash]  # evict its prefix-cache entry
            block.hash = block.key = None
            self.hashed.discard(bid)
            block.ref_count = 1
            seq.block_table.append(bid)
            self.num_allocated_blocks += 1

    def commit(self, seq: Sequence) -> None:
        """Register the full, computed blocks of `seq` whose token ids are known on the host in the prefix cache
        (call after the forward)."""
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        if num_full <= seq.num_hashed_blocks:  # the common decode step: no block filled
            return
        prev = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else None
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.key = block_key(prev, seq.token_ids[i * bs:(i + 1) * bs])
                block.hash = hash(block.key)
                self.hashed.add(block.block_id)
                self.cached.setdefault(block.hash, block.block_id)  # an equal block may already be cached
            prev = block.hash
            seq.num_hashed_blocks = i + 1

    def free_seq(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):  # tail first: prefix blocks are evicted last
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (the K/V are stale after a weight update or sleep)."""
        if len(self.free) != self.num_blocks:
            raise RuntimeError("reset_prefix_cache needs every block free (no sequence in flight)")
        self.cached.clear()
        for bid in self.hashed:  # not every block: a large cache has tens of thousands
            self.blocks[bid].hash = self.blocks[bid].key = None
        self.hashed.clear()
