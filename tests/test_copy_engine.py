"""The paged KV tensor and the copy engine: data moves exactly when each mode says it does, and a
plan leaves the in-flight list only once its data is in place (I3's ordering)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from vtoken.errors import ConfigError
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.kv.moves import RelocationPlan
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable

SHAPE = KVShape(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=3)
VALUES_PER_TOKEN = SHAPE.num_layers * 2 * SHAPE.num_kv_heads * SHAPE.head_dim  # 24


def token_kv(req_id: int, token_ids: np.ndarray) -> torch.Tensor:
    """Distinct K/V for every (request, token, layer, k/v, head, dim): [layers, 2, n, heads, dim]."""
    token_ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.float64)
    base = (req_id * 10_000 + token_ids) * 100  # [n]
    within = torch.arange(VALUES_PER_TOKEN, dtype=torch.float64).view(SHAPE.num_layers, 2, 1, SHAPE.num_kv_heads, SHAPE.head_dim)
    return within + base.view(1, 1, -1, 1, 1)


def make_setup(device: str = "cpu") -> tuple[PagedKVCache, TokenTable, RelocationPlan]:
    """One request, 14 tokens with holes, its K/V written; and the hole-fill plan for it.

        block 0: [0 . . 3]  block 1: [4 5 6 7]  block 2: [8 9 . .]  block 3 (tail): [12 13 . .]
        plan: token 8 -> (0, 1), token 9 -> (0, 2); block 2 freed
    """
    kv_cache = PagedKVCache(SHAPE, dtype=torch.float64, device=device)
    pool = BlockPool(SHAPE.num_blocks, SHAPE.block_size)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(4), 14)
    kv_cache.write(torch.as_tensor(table.slots()), token_kv(0, np.arange(14)))
    table.evict_tokens(np.array([1, 2, 10, 11]))
    (plan,) = Reclaimer(ReclaimConfig(mode="hole-fill"), pool).plan([table])
    assert plan.moves.token_ids.tolist() == [8, 9]
    assert plan.moves.dst_slots(4).tolist() == [1, 2]
    return kv_cache, table, plan


def read_live(kv_cache: PagedKVCache, table: TokenTable) -> torch.Tensor:
    return kv_cache.read(torch.as_tensor(table.slots())).cpu()


def expected_live(table: TokenTable) -> torch.Tensor:
    return token_kv(table.req_id, table.live_token_ids())


def complete(plan: RelocationPlan, table: TokenTable) -> None:
    table.apply_moves(plan.moves)
    table.release_blocks(plan.src_block_ids)
    table.pool.free(plan.src_block_ids)


# ---- KV tensor ---------------------------------------------------------------------------


def test_kv_shape_rejects_non_positive_sizes() -> None:
    with pytest.raises(ConfigError, match="KV cache head_dim must be > 0, got 0"):
        KVShape(num_layers=1, num_blocks=1, block_size=1, num_kv_heads=1, head_dim=0)
    assert SHAPE.num_slots == 32


def test_write_then_read_round_trips_through_slots() -> None:
    kv_cache = PagedKVCache(SHAPE, dtype=torch.float64)
    slots = torch.tensor([5, 0, 31])
    kv_cache.write(slots, token_kv(3, np.array([0, 1, 2])))
    assert torch.equal(kv_cache.read(slots), token_kv(3, np.array([0, 1, 2])))
    assert torch.equal(kv_cache.data[:, :, 1, 1], token_kv(3, np.array([0]))[:, :, 0])  # slot 5 = block 1 offset 1
    assert kv_cache.read(torch.tensor([1])).abs().sum() == 0


def test_copy_slots_gathers_before_it_scatters() -> None:
    kv_cache = PagedKVCache(SHAPE, dtype=torch.float64)
    kv_cache.write(torch.tensor([0, 1]), token_kv(0, np.array([0, 1])))
    kv_cache.copy_slots(torch.tensor([0, 1]), torch.tensor([1, 0]))  # a swap
    assert torch.equal(kv_cache.read(torch.tensor([0, 1])), token_kv(0, np.array([1, 0])))


# ---- modes -------------------------------------------------------------------------------


def test_unknown_mode_and_async_without_cuda_raise() -> None:
    with pytest.raises(ConfigError, match="unknown copy mode 'later'; choose one of: sync, async, deferred"):
        CopyEngine(None, "later")
    with pytest.raises(ConfigError, match="copy mode 'async' needs a CUDA KV cache"):
        CopyEngine(None, "async")
    with pytest.raises(ConfigError, match="copy mode 'async' needs a CUDA KV cache"):
        CopyEngine(PagedKVCache(SHAPE), "async")


def test_sync_copies_inside_launch_and_completes_at_the_first_poll() -> None:
    kv_cache, table, plan = make_setup()
    engine = CopyEngine(kv_cache, "sync")
    engine.launch(plan)
    assert torch.equal(kv_cache.read(torch.tensor([1, 2])), token_kv(0, np.array([8, 9])))
    assert engine.in_flight_plans == [plan]
    assert engine.poll_completed() == [plan]
    assert engine.in_flight_plans == []
    complete(plan, table)
    assert table.slots().tolist() == [0, 3, 4, 5, 6, 7, 1, 2, 12, 13]
    assert torch.equal(read_live(kv_cache, table), expected_live(table))
    assert engine.num_bytes_copied == 2 * 8 * VALUES_PER_TOKEN * 2  # read + write, 2 tokens of float64


def test_deferred_moves_the_data_only_at_the_second_poll() -> None:
    kv_cache, table, plan = make_setup()
    before = kv_cache.data.clone()
    engine = CopyEngine(kv_cache, "deferred")
    engine.launch(plan)
    assert torch.equal(kv_cache.data, before)
    assert engine.poll_completed() == []
    assert torch.equal(kv_cache.data, before)
    assert torch.equal(read_live(kv_cache, table), expected_live(table))  # still read at the sources
    assert engine.in_flight_plans == [plan]
    assert engine.poll_completed() == [plan]
    assert torch.equal(kv_cache.read(torch.tensor([1, 2])), token_kv(0, np.array([8, 9])))
    complete(plan, table)
    assert torch.equal(read_live(kv_cache, table), expected_live(table))


def test_drain_completes_deferred_copies_with_their_data() -> None:
    kv_cache, table, plan = make_setup()
    engine = CopyEngine(kv_cache, "deferred")
    engine.launch(plan)
    assert engine.drain() == [plan]
    assert engine.in_flight_plans == []
    complete(plan, table)
    assert torch.equal(read_live(kv_cache, table), expected_live(table))


def test_a_cancelled_deferred_copy_never_writes() -> None:
    kv_cache, table, plan = make_setup()
    before = kv_cache.data.clone()
    engine = CopyEngine(kv_cache, "deferred")
    engine.launch(plan)
    engine.cancel(req_id=1)
    assert engine.in_flight_plans == [plan]
    engine.cancel(req_id=0)
    assert engine.in_flight_plans == []
    assert engine.poll_completed() == [] and engine.poll_completed() == []
    assert torch.equal(kv_cache.data, before)


@pytest.mark.parametrize("mode", ["sync", "deferred"])
def test_without_kv_data_plans_complete_at_the_first_poll(mode: str) -> None:
    _, table, plan = make_setup()
    engine = CopyEngine(None, mode)
    engine.launch(plan)
    assert engine.poll_completed() == [plan]
    assert engine.num_bytes_copied == 0
    engine.wait_before_forward()  # nothing to wait for, and no CUDA needed


def test_plans_complete_in_launch_order() -> None:
    kv_cache = PagedKVCache(SHAPE, dtype=torch.float64)
    pool = BlockPool(SHAPE.num_blocks, SHAPE.block_size)
    tables = []
    for req_id in range(2):
        table = TokenTable(req_id, pool)
        table.sync_new_tokens(pool.allocate(3), 9)  # blocks 3r..3r+2
        kv_cache.write(torch.as_tensor(table.slots()), token_kv(req_id, np.arange(9)))
        table.evict_tokens(np.array([1, 5, 6, 7]))
        tables.append(table)
    plans = Reclaimer(ReclaimConfig(mode="hole-fill"), pool).plan(tables)
    assert [p.req_id for p in plans] == [0, 1]
    engine = CopyEngine(kv_cache, "deferred")
    engine.launch(plans[1])
    assert engine.poll_completed() == []
    engine.launch(plans[0])
    assert engine.poll_completed() == [plans[1]]
    assert engine.poll_completed() == [plans[0]]
    for plan in plans:
        complete(plan, tables[plan.req_id])
    for table in tables:
        assert torch.equal(read_live(kv_cache, table), expected_live(table))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_copies_on_a_side_stream_and_the_next_forward_waits_on_its_event() -> None:
    kv_cache, table, plan = make_setup(device="cuda")
    engine = CopyEngine(kv_cache, "async")
    # slow the compute stream down so that the copy is enqueued behind real work
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(8):
        busy = busy @ busy
        busy = busy / busy.norm()
    engine.launch(plan)
    assert engine.in_flight_plans == [plan]
    engine.wait_before_forward()
    # the "forward": ordered after the copy on the GPU, the host did not wait
    gathered = kv_cache.read(torch.tensor([1, 2], device="cuda"))
    deadline = time.monotonic() + 10.0
    completed: list[RelocationPlan] = []
    while not completed and time.monotonic() < deadline:
        completed = engine.poll_completed()
    assert completed == [plan]
    assert torch.equal(gathered.cpu(), token_kv(0, np.array([8, 9])))
    complete(plan, table)
    assert torch.equal(read_live(kv_cache, table), expected_live(table))
