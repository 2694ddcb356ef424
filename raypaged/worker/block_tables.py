"""Every request's block table as a row of one persistent array, for the decodes' vectorized inputs.

The scheduler's deltas (new blocks, copy-on-write replacements, blocks of rejected drafts freed)
update a request's row in place; a step's decodes then read their tables, slots and padding
with a few numpy operations over the rows, instead of slicing and padding a list per request.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, rows: int = 64, cols: int = 16) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))  # the lowest row is taken first

    def add(self, block_ids: list[int]) -> int:
        """A row for a new request's table."""
        if not self._free:
            rows = self.array.shape[0]
            self.array = np.concatenate((self.array, np.zeros_like(self.array)))
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free.pop()
        self.write(row, 0, block_ids)
        return row

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Table entries ``start..`` of ``row`` become ``block_ids``."""
        end = start + len(block_ids)
        if end > self.array.shape[1]:
            grown = np.zeros((self.array.shape[0], max(end, 2 * self.array.shape[1])), dtype=np.int64)
            grown[:, : self.array.shape[1]] = self.array
            self.array = grown
        self.array[row, start:end] = block_ids

    def release(self, row: int) -> None:
        self._free.append(row)

    def decode_inputs(
        self, rows: np.ndarray, positions: np.ndarray, block_size: int
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """For decodes at ``positions`` (one token each) on ``rows``: their slots, their tables padded
        with 0 past each one's last block in use (``[len(rows), max_blocks]``), and max_blocks."""
        num_blocks = positions // block_size + 1
        max_blocks = int(num_blocks.max()) if len(num_blocks) else 0
        tables = self.array[rows, :max_blocks]
        tables *= np.arange(max_blocks) < num_blocks[:, None]  # the padding of the tables before: 0
        slots = tables[np.arange(len(rows)), positions // block_size] * block_size + positions % block_size
        return slots, tables, max_blocks

    def decode_inputs_list(
        self, rows: list[int], positions: list[int], block_size: int
    ) -> tuple[list[int], list[int], int]:
        """:meth:`decode_inputs` as Python lists (the tables flattened), for a few decodes: below about
        five, a list per row costs less than the fixed cost of the numpy operations."""
        max_blocks = max(positions) // block_size + 1 if positions else 0
        array = self.array
        slots: list[int] = []
        tables: list[int] = []
        for row, position in zip(rows, positions):
            table = array[row, :max_blocks].tolist()
            if (num_blocks := position // block_size + 1) < max_blocks:
                table[num_blocks:] = [0] * (max_blocks - num_blocks)
            slots.append(table[position // block_size] * block_size + position % block_size)
            tables += table
        return slots, tables, max_blocks
