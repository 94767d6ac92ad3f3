"""Every running sequence's block table, one row each, resident on the device and updated by diffs.

A step's plan names new sequences with their whole table and known ones with the blocks appended
since the last step, so the device copy changes by a few entries per step. ``DeviceBlockTables``
gives each sequence a row when it arrives and takes the row back when it is freed; the changes of
a step are staged on the host and reach the device in one ``non_blocking`` copy (pinned memory on
CUDA) followed by one scatter, never a host sync::

    table (device, int32)   [num_rows, max_blocks_per_seq]
      row 0                  padding: every entry is ``padding_block`` (a step's padded rows)
      row r = row_of(seq)    seq's block ids, then zeros (never read: a kernel stops at the
                             sequence's context length)

Kernels gather the rows of a step's sequences (``gather``): O(step's sequences x columns) on the
device. The table grows (doubling its rows) when every row is taken; ``version`` counts the
reallocations, so a captured CUDA graph that read the old tensor knows to be captured again.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from kv.host_staging import to_device

PADDING_ROW = 0
DEFAULT_NUM_ROWS = 64  # sequences before the table first grows


class DeviceBlockTables:
    """Block tables of the running sequences on ``device``; ``flush`` sends the staged diffs."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device,
                 num_rows: int = DEFAULT_NUM_ROWS,
                 padding_block: int = 0) -> None:
        if max_blocks_per_seq < 1 or num_rows < 1:
            raise ValueError(f"a block table needs at least one column and row, got "
                             f"{max_blocks_per_seq} columns and {num_rows} rows")
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.padding_block = padding_block
        self.version = 0
        self.table = self._new_table(num_rows + 1)  # [rows, max_blocks] int32
        self._free_rows: List[int] = list(range(num_rows, 0, -1))  # pop() gives row 1 first
        self._rows: Dict[int, int] = {}  # seq id -> row
        self._num_blocks: Dict[int, int] = {}  # seq id -> blocks written to its row
        self._staged: Dict[Tuple[int, int], int] = {}  # (row, column) -> block id, last wins

    @property
    def num_seqs(self) -> int:
        return len(self._rows)

    def row_of(self, seq_id: int) -> int:
        return self._rows[seq_id]

    def add(self, seq_id: int, block_ids: Sequence[int]) -> None:
        """Give ``seq_id`` a row holding ``block_ids`` (replacing any row it had)."""
        self.free(seq_id)
        if not self._free_rows:
            self._grow()
        self._rows[seq_id] = self._free_rows.pop()
        self._num_blocks[seq_id] = 0
        self.extend(seq_id, block_ids)

    def extend(self, seq_id: int, block_ids: Sequence[int]) -> None:
        """Append ``block_ids`` to ``seq_id``'s row."""
        row, start = self._rows[seq_id], self._num_blocks[seq_id]
        if start + len(block_ids) > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq_id} would hold {start + len(block_ids)} blocks; a "
                             f"block table row holds {self.max_blocks_per_seq}")
        for i, block in enumerate(block_ids):
            self._staged[row, start + i] = block
        self._num_blocks[seq_id] = start + len(block_ids)

    def free(self, seq_id: int) -> None:
        """Return ``seq_id``'s row (nothing if it has none). Its stale entries stay: they are
        overwritten before the next owner's kernels can read them."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._num_blocks.pop(seq_id)
            self._free_rows.append(row)

    def flush(self) -> None:
        """Send the staged entries to the device: one copy of ``3 x n`` ints and one scatter."""
        if not self._staged:
            return
        # One entry per (row, column): a scatter with repeated indices keeps an arbitrary one.
        entries = [(row, column, block) for (row, column), block in self._staged.items()]
        staged = to_device(torch.tensor(entries, dtype=torch.int64), self.device)  # [n, 3]
        self._staged.clear()
        self.table[staged[:, 0], staged[:, 1]] = staged[:, 2].to(torch.int32)

    def gather(self, rows: torch.Tensor, num_columns: Optional[int] = None) -> torch.Tensor:
        """``[len(rows), num_columns]`` int32 block table of a step (rows on the device; the
        first ``num_columns`` columns, default all)."""
        table = self.table if num_columns is None else self.table[:, :num_columns]
        return table.index_select(0, rows)

    def _new_table(self, num_rows: int) -> torch.Tensor:
        table = torch.zeros(num_rows, self.max_blocks_per_seq, dtype=torch.int32,
                            device=self.device)
        table[PADDING_ROW] = self.padding_block
        return table

    def _grow(self) -> None:
        old = self.table
        self.table = self._new_table(2 * old.shape[0] - 1)
        self.table[:old.shape[0]] = old
        self._free_rows = list(range(self.table.shape[0] - 1, old.shape[0] - 1, -1))
        self.version += 1
