"""The global pool of KV-cache blocks and every sequence's block table.

Blocks are shared by reference count: a forked sequence (parallel sampling, a
beam) shares all of its parent's blocks, and full blocks are shared across
requests of one cache salt through the prefix cache. A shared block is never
written: the first write into a shared, partly filled block copies it first
(copy-on-write).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from hashlib import sha256

BlockKey = bytes  # sha256 digest of (the parent block's key, this block's token ids as little-endian int64)

_UNSALTED_ROOT: BlockKey = sha256(b"").digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_key(cache_salt: str | None) -> BlockKey:
    """The parent key of a sequence's first block: one fixed root without a salt, the salt's digest with one.

    ``b"salt:"`` keeps every salt, the empty one included, off the unsalted root.
    """
    if cache_salt is None:
        return _UNSALTED_ROOT
    return sha256(b"salt:" + cache_salt.encode()).digest()


class BlockPool:
    """Physical block ids ``0 .. num_blocks-1`` with reference counts.

    Free blocks wait in LRU order: allocation takes the least recently freed
    first, so a freed block that is still in the prefix cache survives as long
    as possible. With ``enable_caching`` a full block may carry a key; a free
    keyed block can be revived by a cache hit until it is reallocated.
    Invariant: a block is in the free list exactly when its ref count is 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._key_of: dict[int, BlockKey] = {}
        self._cached: dict[BlockKey, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_block_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block_id, None)
            if key is not None:
                del self._cached[key]  # evicted from the prefix cache
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free list's back."""
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count < 1:
                raise RuntimeError(f"double free of block {block_id}")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def release_unused(self, block_ids: list[int]) -> None:
        """Free blocks of one owner that hold nothing worth keeping (never keyed): they go to the
        front of the free list, in this order, so the next allocation takes them back before it
        evicts any cached block."""
        for block_id in reversed(block_ids):
            if self.ref_counts[block_id] != 1 or block_id in self._key_of:
                raise RuntimeError(f"block {block_id} is shared or cached: it cannot be released as unused")
            self.ref_counts[block_id] = 0
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def lookup(self, key: BlockKey) -> int | None:
        return self._cached.get(key)

    def reset_cache(self) -> bool:
        """Forget every cached block, if no block is in use (False, and nothing changes, otherwise)."""
        if len(self._free) < self.num_blocks:
            return False
        self._key_of.clear()
        self._cached.clear()
        return True

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Key a full block; the first block holding a key keeps it."""
        if key not in self._cached and block_id not in self._key_of:
            self._cached[key] = block_id
            self._key_of[block_id] = key


@dataclass(slots=True)
class BlockTable:
    block_ids: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)  # keys of the leading full blocks, in order
    cache_salt: str | None = None  # the prefix-cache namespace the keys chain from (see ``root_key``)


@dataclass(slots=True)
class Allocation:
    new_block_ids: list[int]
    copies: list[tuple[int, int]]  # (src, dst) block copies to run before this step's writes
    replaced: list[tuple[int, int]]  # (index in the table, new block id): where a copy took a shared block's place


class KVCacheManager:
    """Block tables of sequences over one :class:`BlockPool`.

    ``allocate_slots`` grows a table on demand, copying a shared last block
    before it is written, or returns ``None`` when the pool cannot (the
    scheduler then preempts). ``free`` releases a table at once. With prefix
    caching, ``computed_prefix`` finds the longest run of cached full blocks.

    A full block's key is ``sha256(parent key + its token ids packed as
    little-endian int64)``, the first block's parent being ``root_key`` of the
    sequence's cache salt, so a key stands for the salt and every token up to
    the block's end. Sequences share cached blocks only under the same salt
    (``None`` being one salt of its own). A hit is trusted on the digest alone:
    a sha256 collision is not a practical concern, so no token ids are kept to
    confirm it.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, num_cpu_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self._pack_block = struct.Struct(f"<{block_size}q").pack
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.tables: dict[str, BlockTable] = {}
        self.swapped: dict[str, BlockTable] = {}  # tables of swapped-out sequences, in CPU block ids
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def block_tables(self) -> dict[str, list[int]]:
        return {seq_id: table.block_ids for seq_id, table in self.tables.items()}

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, seq_id: str) -> list[int]:
        table = self.tables.get(seq_id)
        return table.block_ids if table else []

    def _block_keys(
        self, token_ids: list[int], num_blocks: int, known: list[BlockKey], cache_salt: str | None
    ) -> list[BlockKey]:
        """``known`` extended to the keys of the first ``num_blocks`` blocks of ``token_ids``."""
        keys = list(known)
        key = keys[-1] if keys else root_key(cache_salt)
        bs = self.block_size
        for i in range(len(keys), num_blocks):
            key = sha256(key + self._pack_block(*token_ids[i * bs : (i + 1) * bs])).digest()
            keys.append(key)
        return keys

    def computed_prefix(
        self, seq_id: str, token_ids: list[int], cache_salt: str | None = None, max_tokens: int | None = None
    ) -> int:
        """Start a new sequence's table with the longest cached run of its full blocks under ``cache_salt``
        (at most ``max_tokens`` tokens of them: the positions whose outputs the caller needs anyway).

        Returns the number of tokens they hold (at least one token is always left
        to compute, so a fully cached prompt still yields logits). The table
        remembers the salt: later ``cache_blocks`` calls extend the same chain.
        """
        if not self.enable_prefix_caching or seq_id in self.tables:
            return 0
        keys, hits = self._cached_run(token_ids, cache_salt)
        if max_tokens is not None:
            hits = hits[: max_tokens // self.block_size]
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(hits) * self.block_size
        self.pool.incref(hits)
        self.tables[seq_id] = BlockTable(hits, keys[: len(hits)], cache_salt)
        return len(hits) * self.block_size

    def _cached_run(self, token_ids: list[int], cache_salt: str | None) -> tuple[list[BlockKey], list[int]]:
        """Keys of the full blocks a prefix hit may cover, and the cached blocks of the leading run."""
        num_full = (len(token_ids) - 1) // self.block_size
        keys = self._block_keys(token_ids, num_full, [], cache_salt)
        hits = []
        for key in keys:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return keys, hits

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; only when no sequence holds blocks (vLLM's ``reset_prefix_cache``)."""
        return self.pool.reset_cache() if not (self.tables or self.swapped) else False

    def cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
        """The blocks ``computed_prefix`` would attach to a new sequence of these tokens (changes nothing)."""
        return self._cached_run(token_ids, cache_salt)[1] if self.enable_prefix_caching else []

    def allocate_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> Allocation | None:
        """Make room for tokens ``num_computed .. num_computed+num_new`` of a sequence.

        Returns the blocks added (and copies to run), or ``None`` with nothing
        changed if the pool is short.
        """
        table = self.tables.get(seq_id) or BlockTable()
        bs = self.block_size
        total = num_computed_tokens + num_new_tokens
        num_needed = self.num_blocks_for(total) - len(table.block_ids)
        write_index = num_computed_tokens // bs
        cow = (
            num_computed_tokens % bs != 0
            and write_index < len(table.block_ids)
            and self.pool.ref_counts[table.block_ids[write_index]] > 1
        )
        if max(num_needed, 0) + cow > self.pool.num_free_blocks:
            return None
        self.tables[seq_id] = table
        allocation = Allocation([], [], [])
        if cow:
            [dst] = self.pool.allocate(1)
            src = table.block_ids[write_index]
            self.pool.free([src])
            table.block_ids[write_index] = dst
            allocation.copies.append((src, dst))
            allocation.replaced.append((write_index, dst))
        if num_needed > 0:
            allocation.new_block_ids = self.pool.allocate(num_needed)
            table.block_ids.extend(allocation.new_block_ids)
        return allocation

    def trim(self, seq_id: str, num_tokens: int) -> int:
        """Free the blocks past the first ``num_tokens`` tokens' (the slots of rejected draft tokens);
        returns the table's length after. Those blocks were the sequence's own and never cached."""
        table = self.tables[seq_id]
        keep = self.num_blocks_for(num_tokens)
        if len(table.block_ids) > keep:
            self.pool.release_unused(table.block_ids[keep:])
            del table.block_ids[keep:]
        return len(table.block_ids)

    def cache_blocks(
        self, seq_id: str, prompt_token_ids: list[int], output_token_ids: list[int], num_computed_tokens: int
    ) -> None:
        """Offer the sequence's full, computed blocks to the prefix cache."""
        table = self.tables.get(seq_id)
        num_full = num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or table is None or num_full <= len(table.keys):
            return
        start = len(table.keys)
        table.keys = self._block_keys(prompt_token_ids + output_token_ids, num_full, table.keys, table.cache_salt)
        for i in range(start, num_full):
            self.pool.cache(table.block_ids[i], table.keys[i])

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref count +1 each) and its cache salt."""
        parent = self.tables.get(parent_id) or BlockTable()
        self.pool.incref(parent.block_ids)
        self.tables[child_id] = BlockTable(list(parent.block_ids), list(parent.keys), parent.cache_salt)

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks, last block first (evicted first); swapped ones too."""
        table = self.tables.pop(seq_id, None)
        if table:
            self.pool.free(table.block_ids[::-1])
        swapped = self.swapped.pop(seq_id, None)
        if swapped:
            assert self.cpu_pool is not None, "swapped tables hold CPU blocks"
            self.cpu_pool.free(swapped.block_ids)

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks if self.cpu_pool else 0

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks if self.cpu_pool else 0

    def swap_out(self, seq_ids: list[str]) -> list[tuple[int, int]] | None:
        """Move the sequences' blocks to CPU, keeping blocks they share shared.

        Returns the (device block, cpu block) copies to run, or ``None`` with
        nothing changed if the CPU pool is too small.
        """
        return _move_tables(self.tables, self.swapped, self.pool, self.cpu_pool, seq_ids)

    def swap_in(self, seq_ids: list[str]) -> list[tuple[int, int]] | None:
        """Bring swapped sequences back; returns (cpu block, device block) copies or ``None``."""
        assert self.cpu_pool is not None, "only sequences swapped out to the CPU pool come back"
        return _move_tables(self.swapped, self.tables, self.cpu_pool, self.pool, seq_ids)

    def num_blocks_to_swap_in(self, plan: list[tuple[str, int, int]]) -> int:
        """Device blocks that swapping a group in and then writing its next tokens takes.

        ``plan`` holds ``(seq_id, num_computed_tokens, num_new_tokens)`` of every
        swapped sequence of the group, in the order they are scheduled: shared
        blocks come back once, and a shared, partly filled block is copied by
        every writer but the last (as ``allocate_slots`` does).
        """
        tables = [self.swapped[seq_id] for seq_id, _, _ in plan]
        refs: dict[int, int] = {}
        for table in tables:
            for block_id in table.block_ids:
                refs[block_id] = refs.get(block_id, 0) + 1
        total = len(refs)
        for (_, num_computed, num_new), table in zip(plan, tables):
            if num_new == 0:
                continue
            total += max(self.num_blocks_for(num_computed + num_new) - len(table.block_ids), 0)
            write_index = num_computed // self.block_size
            if num_computed % self.block_size and write_index < len(table.block_ids):
                block_id = table.block_ids[write_index]
                if refs[block_id] > 1:
                    refs[block_id] -= 1
                    total += 1
        return total

    def num_blocks_to_hold(
        self, held_seq_ids: list[str], token_ids: list[list[int]], cache_salt: str | None = None
    ) -> int:
        """Device blocks that some sequences' tables plus others recomputed from scratch take.

        The held tables count once per distinct block; each recomputed sequence
        (all of one request, so of one ``cache_salt``) needs a block per
        ``block_size`` tokens, less the leading blocks its prefix-cache hit finds
        among the held ones (an upper bound: it does not count on the recomputed
        sequences sharing blocks with each other).
        """
        held = {b for seq_id in held_seq_ids for b in self.get_block_ids(seq_id)}
        total = len(held)
        for ids in token_ids:
            hits = self.cached_prefix_blocks(ids, cache_salt)
            total += self.num_blocks_for(len(ids)) - sum(1 for block_id in hits if block_id in held)
        return total

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if ref counts disagree with the block tables (device and CPU)."""
        _check_pool(self.pool, self.tables)
        if self.cpu_pool:
            _check_pool(self.cpu_pool, self.swapped)


def _check_pool(pool: BlockPool, tables: dict[str, BlockTable]) -> None:
    expected = [0] * pool.num_blocks
    for table in tables.values():
        for block_id in table.block_ids:
            expected[block_id] += 1
    assert expected == pool.ref_counts, "ref counts disagree with block tables"
    free_ids = pool.free_block_ids
    assert sorted(free_ids) == [b for b, c in enumerate(expected) if c == 0], "free list != unreferenced blocks"


def _move_tables(
    src_tables: dict[str, BlockTable],
    dst_tables: dict[str, BlockTable],
    src_pool: BlockPool,
    dst_pool: BlockPool | None,
    seq_ids: list[str],
) -> list[tuple[int, int]] | None:
    """Re-home tables from one pool to another; a block shared within them stays one block."""
    distinct = list(dict.fromkeys(b for seq_id in seq_ids for b in src_tables[seq_id].block_ids))
    if dst_pool is None or len(distinct) > dst_pool.num_free_blocks:
        return None
    mapping = dict(zip(distinct, dst_pool.allocate(len(distinct))))
    for seq_id in seq_ids:
        table = src_tables.pop(seq_id)
        moved = [mapping[b] for b in table.block_ids]
        dst_tables[seq_id] = BlockTable(moved, table.keys, table.cache_salt)
        src_pool.free(table.block_ids[::-1])
    for dst in mapping.values():
        dst_pool.ref_counts[dst] = 0
    for seq_id in seq_ids:
        for dst in dst_tables[seq_id].block_ids:
            dst_pool.ref_counts[dst] += 1
    return list(mapping.items())
