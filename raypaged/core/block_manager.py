"""The global pool of KV-cache blocks and every request's block table."""

from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Physical block ids ``0 .. num_blocks-1`` with reference counts.

    Allocation takes ids from the front of the free queue; freed ids join its
    back, so a freed block is reused as late as possible.
    Invariant: a block is in the free queue exactly when its ref count is 0.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free_ids):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free_ids)} free")
        block_ids = [self._free_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free."""
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count < 1:
                raise RuntimeError(f"double free of block {block_id}")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free_ids.append(block_id)


class KVCacheManager:
    """Block tables of requests over one :class:`BlockPool`.

    ``allocate_slots`` grows a request's table on demand to cover its computed
    tokens plus the tokens of this step, or returns ``None`` when the pool
    cannot (the scheduler then preempts). ``free`` releases a table at once.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> list[int] | None:
        """Blocks newly added so that the table holds ``num_computed_tokens +
        num_new_tokens`` tokens, or ``None`` (nothing changed) if too few are free."""
        table = self.block_tables.setdefault(request_id, [])
        num_needed = self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(table)
        if num_needed <= 0:
            return []
        if num_needed > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request_id]
            return None
        new_block_ids = self.pool.allocate(num_needed)
        table.extend(new_block_ids)
        return new_block_ids

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (it is reused first)."""
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free(table[::-1])

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if ref counts disagree with the block tables."""
        expected = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                expected[block_id] += 1
        assert expected == self.pool.ref_counts, "ref counts disagree with block tables"
        free_ids = list(self.pool._free_ids)
        assert len(set(free_ids)) == len(free_ids), "a block is free twice"
        assert sorted(free_ids) == [b for b, c in enumerate(expected) if c == 0], "free queue != unreferenced blocks"
