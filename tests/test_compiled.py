"""The round step's compiled loops (vtoken/kv/compiled.py) against plain Python written from
their rules, on random layouts. The runtime's own results with them are pinned by the goldens;
the round check is compared with check_plan in tests/test_reclaim.py."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.kv.block_pool import BlockPool
from vtoken.kv.compiled import change_live_counts, hole_fill_plans, hole_fill_round, land_moves, movable_blocks

S = 4
# one request: its blocks' slots, each a live token (True) or a hole (False)
requests = st.lists(st.lists(st.lists(st.booleans(), min_size=S, max_size=S), min_size=1, max_size=8),
                    min_size=1, max_size=5)


def layout(blocks_of: list[list[list[bool]]], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Block ids (shuffled over the pool), the reverse map (a request's live tokens numbered in
    a shuffled order), live counts, and each request's [start, end) among the blocks."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(len(blocks) for blocks in blocks_of)
    block_ids = rng.permutation(num_blocks + 3)[:num_blocks].astype(np.int64)
    token_at = np.full((num_blocks + 3) * S, -1, dtype=np.int64)
    live_counts = np.zeros(num_blocks + 3, dtype=np.int32)
    bounds, position = [], 0
    for blocks in blocks_of:
        ids = iter(rng.permutation(len(blocks) * S).tolist())
        for slots in blocks:
            b = int(block_ids[position])
            for offset, is_live in enumerate(slots):
                if is_live:
                    token_at[b * S + offset] = next(ids)
            live_counts[b] = sum(slots)
            position += 1
        bounds.append((position - len(blocks), position))
    return block_ids, token_at, live_counts, np.array(bounds, dtype=np.int64).reshape(-1, 2)


def reference_plan(blocks: list[int], token_at: np.ndarray, max_src_blocks: int) -> tuple[list[int], list[tuple]]:
    """Sources: the longest run of last blocks whose live tokens fit in the holes before them (at
    most min(B, n - 1)); moves: their live tokens by id, into the kept blocks' holes in order."""
    def live(b):
        return [(int(token_at[b * S + o]), b, o) for o in range(S) if token_at[b * S + o] >= 0]

    def holes(b):
        return [(b, o) for o in range(S) if token_at[b * S + o] < 0]

    n, num_src = len(blocks), 0
    for m in range(1, min(max_src_blocks, n - 1) + 1):
        if sum(len(live(b)) for b in blocks[n - m:]) > sum(len(holes(b)) for b in blocks[: n - m]):
            break
        num_src = m
    if num_src == 0:
        return [], []
    tokens = sorted(t for b in blocks[n - num_src:] for t in live(b))
    targets = [h for b in blocks[: n - num_src] for h in holes(b)][: len(tokens)]
    return sorted(blocks[n - num_src:]), [(t, b, o, db, do) for (t, b, o), (db, do) in zip(tokens, targets)]


@settings(max_examples=300, deadline=None)
@given(blocks_of=requests, seed=st.integers(0, 2**16), max_src_blocks=st.integers(2, 6), data=st.data())
def test_hole_fill_plans_are_the_rules_plans(blocks_of, seed, max_src_blocks, data) -> None:
    """Every request's plan is the rule's; the plans lie end to end in the order given, each
    move and source labelled with its plan's place among those with a plan."""
    block_ids, token_at, live_counts, bounds = layout(blocks_of, seed)
    sizes = bounds[:, 1] - bounds[:, 0]
    ids, counts, starts, ends, num_live, num_reclaimable = movable_blocks(
        block_ids, sizes, np.ones(live_counts.size, np.int32), live_counts, S)
    assert ids.tolist() == block_ids.tolist() and counts.tolist() == live_counts[block_ids].tolist()
    order = np.array(data.draw(st.permutations(range(len(blocks_of)))), dtype=np.int64)
    plan_rows, move_rows, source_rows, deferred = hole_fill_plans(ids, counts, starts, ends, num_reclaimable, order,
                                                                  token_at, S, max_src_blocks, -1)
    assert deferred.size == 0  # no budget: every plan
    plan_requests, move_ends, source_ends = plan_rows
    tokens, src_b, src_o, dst_b, dst_o, move_of = move_rows
    sources, source_of = source_rows
    num_src, num_moves = np.zeros(len(blocks_of), np.int64), np.zeros(len(blocks_of), np.int64)
    num_src[plan_requests] = np.diff(source_ends, prepend=0)
    num_moves[plan_requests] = np.diff(move_ends, prepend=0)
    assert plan_requests.tolist() == [k for k in order.tolist() if num_src[k]]
    first_move = first_src = num_plans = 0
    for k in order.tolist():
        start, end = bounds[k].tolist()
        assert num_live[k] == live_counts[block_ids[start:end]].sum()
        assert num_reclaimable[k] == (end - start) - -(-num_live[k] // S)
        want_sources, want_moves = (reference_plan(block_ids[start:end].tolist(), token_at, max_src_blocks)
                                    if num_reclaimable[k] > 0 else ([], []))
        assert num_src[k] == len(want_sources) and num_moves[k] == len(want_moves)
        got = slice(first_move, first_move + num_moves[k])
        got_sources = slice(first_src, first_src + num_src[k])
        assert sources[got_sources].tolist() == want_sources
        assert list(zip(*(a[got].tolist() for a in (tokens, src_b, src_o, dst_b, dst_o)))) == want_moves
        if want_sources:
            assert set(move_of[got].tolist()) <= {num_plans} and set(source_of[got_sources].tolist()) == {num_plans}
            assert (move_ends[num_plans], source_ends[num_plans]) == (got.stop, got_sources.stop)
            num_plans += 1
        first_move, first_src = got.stop, got_sources.stop
    assert first_move == tokens.size == move_of.size and first_src == sources.size == source_of.size


@settings(max_examples=300, deadline=None)
@given(blocks_of=requests, seed=st.integers(0, 2**16), max_src_blocks=st.integers(2, 6), max_moves=st.integers(0, 24),
       data=st.data())
def test_a_budget_makes_the_first_plans_and_leaves_the_others_unplanned(blocks_of, seed, max_src_blocks, max_moves,
                                                                        data) -> None:
    """With a budget, the plans are the first of the unbudgeted call's, in order, while their
    moves fit in it (the first one whatever it moves), and the requests of the others come back
    unplanned, in order: the reclaimer's cut (reclaim.within_budget), made before any plan past
    it is made."""
    block_ids, token_at, live_counts, bounds = layout(blocks_of, seed)
    ids, counts, starts, ends, _, num_reclaimable = movable_blocks(
        block_ids, bounds[:, 1] - bounds[:, 0], np.ones(live_counts.size, np.int32), live_counts, S)
    order = np.array(data.draw(st.permutations(range(len(blocks_of)))), dtype=np.int64)
    every = hole_fill_plans(ids, counts, starts, ends, num_reclaimable, order, token_at, S, max_src_blocks, -1)
    plan_rows, move_rows, source_rows, deferred = hole_fill_plans(ids, counts, starts, ends, num_reclaimable, order,
                                                                  token_at, S, max_src_blocks, max_moves)
    requests, move_ends = every[0][0].tolist(), every[0][1].tolist()
    num_kept, moved = 0, 0
    for move_end in move_ends:  # the cut, on the whole call's plans
        if num_kept and move_end > max_moves:
            break
        num_kept, moved = num_kept + 1, move_end
    assert plan_rows.tolist() == every[0][:, :num_kept].tolist()
    assert move_rows.tolist() == every[1][:, :moved].tolist()
    assert source_rows.tolist() == every[2][:, : (every[0][2][num_kept - 1] if num_kept else 0)].tolist()
    assert deferred.tolist() == requests[num_kept:]
    if requests:
        assert num_kept >= 1 and (num_kept == 1 or moved <= max_moves)


@settings(max_examples=200, deadline=None)
@given(blocks_of=requests, seed=st.integers(0, 2**16), max_src_blocks=st.integers(2, 6), shared=st.sets(st.integers(0, 39)),
       max_moves=st.integers(-1, 24), data=st.data())
def test_hole_fill_round_is_movable_blocks_then_the_plans_most_reclaimable_first(blocks_of, seed, max_src_blocks, shared,
                                                                                  max_moves, data) -> None:
    """The round's one call: the rows hole_fill_plans gives over movable_blocks' blocks in the
    order most reclaimable first, ties by req_id (req ids drawn apart from the requests' order,
    some blocks shared)."""
    block_ids, token_at, live_counts, bounds = layout(blocks_of, seed)
    sizes = bounds[:, 1] - bounds[:, 0]
    ref_counts = np.ones(live_counts.size, np.int32)
    ref_counts[[b for b in shared if b < ref_counts.size]] = 2
    req_ids = np.array(data.draw(st.lists(st.integers(0, 50), min_size=len(blocks_of), max_size=len(blocks_of), unique=True)),
                       dtype=np.int64)
    ids, counts, starts, ends, _, num_reclaimable = movable_blocks(block_ids, sizes, ref_counts, live_counts, S)
    order = np.array(sorted(range(len(blocks_of)), key=lambda k: (-num_reclaimable[k], req_ids[k])), dtype=np.int64)
    want = hole_fill_plans(ids, counts, starts, ends, num_reclaimable, order, token_at, S, max_src_blocks, max_moves)
    got = hole_fill_round(block_ids, sizes, req_ids, ref_counts, live_counts, token_at, S, max_src_blocks, max_moves)
    for got_rows, want_rows in zip(got, want, strict=True):
        assert got_rows.tolist() == want_rows.tolist()


@settings(max_examples=100, deadline=None)
@given(blocks_of=requests, seed=st.integers(0, 2**16), shared=st.sets(st.integers(0, 39)))
def test_movable_blocks_leave_out_shared_blocks(blocks_of, seed, shared) -> None:
    block_ids, _, live_counts, bounds = layout(blocks_of, seed)
    ref_counts = np.ones(live_counts.size, np.int32)
    ref_counts[[b for b in shared if b < ref_counts.size]] = 2
    ids, counts, starts, ends, num_live, num_reclaimable = movable_blocks(
        block_ids, bounds[:, 1] - bounds[:, 0], ref_counts, live_counts, S)
    for k, (start, end) in enumerate(bounds.tolist()):
        kept = [b for b in block_ids[start:end].tolist() if ref_counts[b] == 1]
        assert ids[starts[k] : ends[k]].tolist() == kept
        assert counts[starts[k] : ends[k]].tolist() == live_counts[kept].tolist()
        assert num_live[k] == live_counts[kept].sum() and num_reclaimable[k] == len(kept) - -(-num_live[k] // S)


def effects(block_size: int) -> np.ndarray:
    """BlockPool._count_effects of a pool of `block_size`: per live count, its histogram bin
    one-hot, whether it is <= S/2, and the count."""
    return BlockPool(1, block_size)._count_effects


@settings(max_examples=200, deadline=None)
@given(changes=st.lists(st.tuples(st.integers(0, 30), st.integers(-3, 3)), max_size=80), seed=st.integers(0, 2**16))
def test_change_live_counts_is_each_change_applied_in_turn(changes, seed) -> None:
    """Against plain Python: (block, delta) pairs, a block repeating; every block's new live
    count, the pool's counts changed by the rows of the effects table, the blocks emptied; or,
    where a count would leave [0, S], the refusal, with nothing written."""
    rng = np.random.default_rng(seed)
    live = rng.integers(0, S + 1, 31).astype(np.int32)
    refs = np.ones(31, np.int32)
    table = effects(S)
    delta, seen = np.full(31, 7, np.int64), np.ones(31, bool)  # scratch: whatever the last caller left
    want = collections.Counter()
    for b, d in changes:
        want[b] += d
    new = live.copy()
    for b, d in want.items():
        new[b] += d
    before = live.copy()
    ids = np.array([b for b, _ in changes], np.int64)
    emptied, counts, reason, block = change_live_counts(ids, np.array([d for _, d in changes], np.int64), live, refs,
                                                        table, delta, seen)
    bad = [b for b in dict.fromkeys(ids.tolist()) if not 0 <= new[b] <= S]
    if bad:
        assert (reason, block) == (3, bad[0])
        assert np.array_equal(live, before)
        return
    assert reason == 0
    assert np.array_equal(live, new)
    assert counts.tolist() == (table[new].sum(axis=0) - table[before].sum(axis=0)).tolist()
    assert emptied.tolist() == sorted(b for b in want if new[b] == 0)


def test_change_live_counts_gives_a_single_delta_to_every_id() -> None:
    """One delta for all ids (a batch eviction's -1 a token) is the same as that delta per id."""
    ids = np.array([3, 1, 3, 7, 3], np.int64)
    results = []
    for deltas in (np.array([-1], np.int64), np.full(ids.size, -1, np.int64)):
        live = np.full(8, 3, np.int32)
        emptied, counts, reason, _ = change_live_counts(ids, deltas, live, np.ones(8, np.int32), effects(S),
                                                        np.zeros(8, np.int64), np.zeros(8, bool))
        results.append((emptied.tolist(), counts.tolist(), reason, live.tolist()))
    assert results[0] == results[1]
    assert results[0][0] == [3] and results[0][3] == [3, 2, 3, 0, 3, 3, 3, 2]


def test_change_live_counts_refuses_a_block_outside_the_pool_or_free_and_writes_nothing() -> None:
    live, refs = np.full(8, 2, np.int32), np.ones(8, np.int32)
    refs[5] = 0
    delta, seen = np.zeros(8, np.int64), np.zeros(8, bool)
    for ids, expected in (([1, 8, 2], (1, 8)), ([1, 2, 3, -1], (1, -1)), ([1, 5], (2, 5))):
        *_, reason, block = change_live_counts(np.array(ids, np.int64), np.array([-1] + [1] * (len(ids) - 1), np.int64),
                                               live, refs, effects(S), delta, seen)
        assert (reason, block) == expected
        assert live.tolist() == [2] * 8


def landing(num_blocks: int = 4) -> dict:
    """A pool of `num_blocks` blocks of S slots, all allocated: block 0 holds tokens 5 and 6 of
    table 0 (6 evicted while its copy was in flight: no longer in the reverse map), block 1 token
    7 of table 1 (evicted too), blocks 2 and 3 hold nothing yet; in the arena, table 0's entries
    start at 0 and table 1's at 1: tokens 5, 6 and 7 are entries 5, 6 and 8."""
    token_at = np.full(num_blocks * S, -1, np.int64)
    token_at[0] = 5
    arena_live, arena_slot = np.zeros(9, bool), np.full(9, -1, np.int64)
    arena_live[5] = True
    arena_slot[[5, 6, 8]] = [0, 1, 4]
    return {"token_at": token_at, "live": np.array([1, 0, 0, 0], np.int32), "refs": np.ones(num_blocks, np.int32),
            "arena_live": arena_live, "arena_slot": arena_slot}


def land(state: dict, dst_blocks: list[int]) -> tuple:
    """Tokens 5, 6 (table 0) and 7 (table 1) moved from slots 0, 1 and 4 into offset 0, 1, 2 of `dst_blocks`."""
    return land_moves(np.array([5, 6, 7], np.int64), np.array([0, 0, 1], np.int64), 2, np.array([0, 1], np.int64),
                      np.array([0, 0, 1], np.int64), np.array([0, 1, 0], np.int64), np.array(dst_blocks, np.int64),
                      np.array([0, 1, 2], np.int64), state["arena_live"], state["arena_slot"], state["token_at"], S,
                      state["live"], state["refs"], effects(S), np.zeros(4, np.int64), np.zeros(4, bool))


def test_land_moves_counts_and_maps_the_live_tokens_and_repoints_every_moved_one() -> None:
    state = landing()
    has_live, _, reason, _ = land(state, [2, 2, 3])
    assert reason == 0
    assert has_live.tolist() == [True, False]  # table 1 moved only a token evicted in flight
    assert state["live"].tolist() == [0, 0, 1, 0]  # only token 5 left block 0 and joined block 2
    expected = np.full(4 * S, -1, np.int64)
    expected[2 * S] = 5  # the evicted tokens take no entry in the reverse map
    assert state["token_at"].tolist() == expected.tolist()
    assert state["arena_slot"][[5, 6, 8]].tolist() == [2 * S, 2 * S + 1, 3 * S + 2]  # every moved token's slot
    assert (np.delete(state["arena_slot"], [5, 6, 8]) == -1).all()  # and no other entry


def test_land_moves_refuses_a_free_destination_and_writes_nothing() -> None:
    state = landing()
    state["refs"][3] = 0
    before = {name: array.copy() for name, array in state.items()}
    has_live, _, reason, block = land(state, [3, 2, 2])
    assert (reason, block) == (2, 3)
    assert all(np.array_equal(state[name], before[name]) for name in state)


# vLLM 0.32's CPU worker scans every module attribute this way at init_worker
# (vllm/triton_utils/dispatcher.py, _rebind_kernels); any value it raises on stops the engine.
KERNEL_SCAN = """
import sys
from vtoken.engine.warmup import warm_compiled_loops
warm_compiled_loops()  # every compiled loop loaded and run
failing = []
for name, module in list(sys.modules.items()):
    namespace = getattr(module, "__dict__", None)
    for attr, value in list((namespace or {}).items()):
        if hasattr(value, "__dict__"):
            try:
                vars(value).get("kernel")
            except Exception as error:
                failing.append(f"{name}.{attr}: {error!r}")
print("\\n".join(failing))
"""


def test_a_vllm_worker_can_start_after_the_compiled_loops_ran():
    """After the compiled loops were imported and ran, the kernel scan a vLLM CPU worker makes
    reads a dict from every module attribute's vars() (the vLLM tier starts real engines after
    a round in tests/vllm_tier/test_engine_after_round.py)."""
    done = subprocess.run([sys.executable, "-c", KERNEL_SCAN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


NATIVE_REPLAY = """
import sys
import vtoken.engine.warmup  # what an engine imports with its tracker, before it calls the warm-up
from vtoken.engine import Experiment, run_sim
from vtoken.hardware import resolve_gpu
from vtoken.model_spec import resolve_model
from vtoken.trace import Request

experiment = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=400)
result = run_sim(experiment.run("native", 8), [Request(str(i), 0.0, 300, 50) for i in range(20)])
print(result.num_requests, "numba" in sys.modules)
"""


def test_a_replay_that_neither_evicts_nor_reclaims_does_not_import_numba():
    """The compiled loops are loaded at the first eviction or reclamation (kv/live_counts.py,
    `compiled_loops`; policies/base.py), so native's replay pays neither numba's import nor a
    compilation; importing the warm-up (vLLM's tracker does) loads nothing before it is called."""
    done = subprocess.run([sys.executable, "-c", NATIVE_REPLAY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["20", "False"]
