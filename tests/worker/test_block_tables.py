"""The runner's persistent block tables: exact rows, slots and padded tables, as arrays and as lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import raypaged.worker.model_runner as model_runner
from raypaged.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from raypaged.sampling_params import SamplingParams
from raypaged.worker.block_tables import BlockTables
from raypaged.worker.model_runner import ModelRunner

BLOCK_SIZE = 4


def test_rows_are_reused_lowest_first_and_the_array_grows_in_both_directions():
    tables = BlockTables(rows=2, cols=2)
    assert [tables.add([7]), tables.add([3, 4])] == [0, 1]
    assert tables.add([9, 8, 5]) == 2  # a third row and a third column
    assert tables.array.shape == (4, 4)
    assert tables.array[:3].tolist() == [[7, 0, 0, 0], [3, 4, 0, 0], [9, 8, 5, 0]]
    tables.release(1)
    assert tables.add([6]) == 1
    assert tables.array[1].tolist() == [6, 4, 0, 0]  # only the entries written are the new table's


def test_decode_inputs_as_arrays_and_as_lists_give_the_same_slots_and_zero_padded_tables():
    tables = BlockTables(rows=4, cols=2)
    rows = [tables.add([5, 2, 9]), tables.add([11]), tables.add([1, 3])]
    tables.write(rows[1], 1, [8])  # an entry past this decode's last block: padded to 0 below
    positions = [9, 2, 6]  # blocks 2, 0 and 1 of their tables
    slots, padded, max_blocks = tables.decode_inputs(np.array(rows), np.array(positions), BLOCK_SIZE)
    assert max_blocks == 3
    assert slots.tolist() == [9 * 4 + 1, 11 * 4 + 2, 3 * 4 + 2]
    assert padded.tolist() == [[5, 2, 9], [11, 0, 0], [1, 3, 0]]
    assert tables.decode_inputs_list(rows, positions, BLOCK_SIZE) == (slots.tolist(), padded.ravel().tolist(), 3)
    assert tables.array[rows[1], :2].tolist() == [11, 8]  # reading pads a copy, never the rows
    assert tables.decode_inputs_list([], [], BLOCK_SIZE) == ([], [], 0)


def _runner_after_two_steps(max_list_decodes: int, monkeypatch) -> tuple[ModelRunner, SchedulerOutput]:
    monkeypatch.setattr(model_runner, "_LIST_INPUTS_MAX_DECODES", max_list_decodes)
    runner = ModelRunner(None, None, BLOCK_SIZE, eos_token_id=None, seed=0, device=torch.device("cpu"))
    params = SamplingParams(temperature=0)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7], "c": list(range(10, 19))}
    blocks = {"a": [4, 1], "b": [0], "c": [7, 2, 6]}
    runner.update_states(
        SchedulerOutput(
            num_scheduled_tokens={rid: len(p) for rid, p in prompts.items()},
            new_requests=[NewRequestData(rid, prompts[rid], [], params, blocks[rid], 0) for rid in prompts],
        )
    )
    # each sampled one token; "b" gets a block its decode does not reach yet (padded to 0), "c" has its
    # last block replaced (copy on write)
    so = SchedulerOutput(
        num_scheduled_tokens={"a": 1, "b": 1, "c": 1},
        cached_requests=[
            CachedRequestData("a", [40], [], 5),
            CachedRequestData("b", [41], [3], 2),
            CachedRequestData("c", [42], [], 9, replaced_block_ids=[(2, 5)]),
        ],
    )
    runner.update_states(so)
    return runner, so


@pytest.mark.parametrize("max_list_decodes", [0, 4], ids=["arrays", "lists"])
def test_a_decode_step_has_the_exact_inputs_either_way(max_list_decodes, monkeypatch):
    runner, so = _runner_after_two_steps(max_list_decodes, monkeypatch)
    step = runner.prepare_inputs(so)
    assert step.input_ids.tolist() == [40, 41, 42]
    assert step.positions.tolist() == [5, 2, 9]
    assert step.meta.slot_mapping.tolist() == [1 * 4 + 1, 0 * 4 + 2, 5 * 4 + 1]
    assert step.meta.decode_context_lens.tolist() == [6, 3, 10]
    assert step.meta.decode_block_tables.tolist() == [[4, 1, 0], [0, 0, 0], [7, 2, 5]]
    assert step.sample_indices.tolist() == [0, 1, 2]
    assert step.sampled_request_ids == ["a", "b", "c"]
    assert step.meta.prefills == []
    assert all(t.dtype == torch.int64 for t in (step.input_ids, step.positions, step.meta.slot_mapping))


def test_each_request_keeps_only_its_table_length_beside_its_row(monkeypatch):
    """The row is the one copy of the ids: appends, copy-on-write replacements and the freeing of
    rejected drafts' blocks (a shorter table, then new blocks after it) leave exact rows and lengths."""
    runner, _ = _runner_after_two_steps(0, monkeypatch)
    state = {rid: runner.requests[rid] for rid in "abc"}
    assert {rid: s.num_blocks for rid, s in state.items()} == {"a": 2, "b": 2, "c": 3}
    row = lambda rid: runner.block_tables.array[state[rid].row, : state[rid].num_blocks].tolist()  # noqa: E731
    assert (row("a"), row("b"), row("c")) == ([4, 1], [0, 3], [7, 2, 5])
    runner.update_states(
        SchedulerOutput(
            num_scheduled_tokens={"a": 1, "c": 1},
            cached_requests=[
                CachedRequestData("a", [50], [8, 9], 6),  # two lookahead blocks
                CachedRequestData("c", [51], [11], 10, replaced_block_ids=[(0, 10)], num_block_ids=3),
            ],
        )
    )
    assert (row("a"), row("c")) == ([4, 1, 8, 9], [10, 2, 11])  # c: its third block freed, block 11 after the second
    assert (state["a"].num_blocks, state["c"].num_blocks) == (4, 3)
