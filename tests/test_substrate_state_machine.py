"""A hypothesis state machine over the whole substrate: block pool, several token tables (some
sharing a pinned prefix), the reclaimer in both modes, and the copy engine over a materialized
KV tensor, with copies left in flight across rules (deferred mode).

Every token's K/V is a function of (request, token id), written when the token is synced, so
after every rule the machine can read each live token through its slot and compare (I1). The
runtime's protocol is followed: a request with a copy in flight does not release the blocks
its evictions empty; when the copy completes, the moves are applied and every block the request
holds without a live token is released. Finishing a request with a copy in flight cancels it.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vtoken.invariants import check_contents, check_conservation, check_plan, check_unique_mapping, check_visibility
from vtoken.kv.block_pool import NUM_HISTOGRAM_BINS, BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.kv.moves import RelocationPlan
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_arena import TokenArena
from vtoken.kv.token_table import TokenTable

S = 4
NUM_BLOCKS = 48
MAX_REQUESTS = 6
SHAPE = KVShape(num_layers=1, num_blocks=NUM_BLOCKS, block_size=S, num_kv_heads=1, head_dim=2)
VALUES_PER_TOKEN = SHAPE.num_layers * 2 * SHAPE.num_kv_heads * SHAPE.head_dim


def token_kv(req_id: int, token_ids: np.ndarray) -> torch.Tensor:
    """[1, 2, n, 1, 2]: K and V of each token, distinct for every (request, token, k/v, dim)."""
    base = torch.as_tensor(np.asarray(token_ids), dtype=torch.float64) * 10 + req_id * 100_000
    within = torch.arange(4, dtype=torch.float64).view(1, 2, 1, 1, 2)
    return within + base.view(1, 1, -1, 1, 1)


class SubstrateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, S)
        self.pool.token_arena = TokenArena(16)  # small: the tables' ranges move often
        self.kv_cache = PagedKVCache(SHAPE, dtype=torch.float64)
        self.engine = CopyEngine(self.kv_cache, "deferred")
        self.tables: dict[int, TokenTable] = {}
        self.prefix_of: dict[int, tuple[int, int]] = {}  # sharer -> (owner, num prefix tokens)
        self.prefix_owners: list[int] = []
        self.next_req_id = 0
        self.num_plans_launched = 0

    @initialize(copy_mode=st.sampled_from(["deferred", "deferred", "sync"]),
                num_prompt_tokens=st.lists(st.integers(4, 40), min_size=1, max_size=3), seed=st.integers(0, 2**16),
                mode=st.sampled_from(["hole-fill", "ordered"]))
    def start(self, copy_mode: str, num_prompt_tokens: list[int], seed: int, mode: str) -> None:
        """A copy mode, and a few fragmented requests with their copies already in flight, so
        that short runs exercise relocation too."""
        self.engine = CopyEngine(self.kv_cache, copy_mode)
        for num_tokens in num_prompt_tokens:
            self.admit(num_tokens, share_idx=None, num_pin_blocks=num_tokens % 2)
        for idx in range(len(self.tables)):
            self.evict(idx, num_victims=int(0.4 * self.pick(idx).num_tokens) + 1, seed=seed + idx, one_by_one=False)
        self.plan_and_launch(mode, max_src_blocks=4)

    # ---- helpers ---------------------------------------------------------------------------

    def busy_req_ids(self) -> frozenset[int]:
        return frozenset(plan.req_id for plan in self.engine.in_flight_plans)

    def pick(self, idx: int) -> TokenTable:
        return self.tables[sorted(self.tables)[idx % len(self.tables)]]

    def expected_kv(self, table: TokenTable, token_ids: np.ndarray) -> torch.Tensor:
        owner_id, num_prefix = self.prefix_of.get(table.req_id, (table.req_id, 0))
        expected = token_kv(table.req_id, token_ids)
        in_prefix = torch.as_tensor(token_ids < num_prefix)
        expected[:, :, in_prefix] = token_kv(owner_id, token_ids[token_ids < num_prefix])
        return expected

    def grow_table(self, table: TokenTable, num_new_tokens: int) -> bool:
        num_blocks = table.num_new_blocks_needed(num_new_tokens)
        if not self.pool.can_allocate(num_blocks):
            return False
        first = table.num_tokens
        table.sync_new_tokens(self.pool.allocate(num_blocks), first + num_new_tokens)
        new_ids = np.arange(first, table.num_tokens)
        slots = table.token_block_ids[new_ids] * S + table.token_offsets[new_ids]
        self.kv_cache.write(torch.as_tensor(slots), token_kv(table.req_id, new_ids))
        return True

    def release_empty_blocks(self, table: TokenTable) -> None:
        held = np.asarray(table.held_block_ids[table.num_pinned_blocks :], dtype=np.int64)
        emptied = held[self.pool.live_counts[held] == 0]
        table.release_blocks(emptied)
        self.pool.free(emptied)

    def complete(self, plan: RelocationPlan) -> None:
        table = self.tables[plan.req_id]
        live_before = table.live_token_ids().copy()
        table.apply_moves(plan.moves)
        check_conservation(table.req_id, live_before, table.live_token_ids())
        self.release_empty_blocks(table)

    # ---- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.tables) < MAX_REQUESTS)
    @rule(num_prompt_tokens=st.integers(1, 32), share_idx=st.none() | st.integers(0, 10), num_pin_blocks=st.integers(0, 2))
    def admit(self, num_prompt_tokens: int, share_idx: int | None, num_pin_blocks: int) -> None:
        table = TokenTable(self.next_req_id, self.pool)
        owners = [r for r in self.prefix_owners if r in self.tables]
        if share_idx is not None and owners:
            owner = self.tables[owners[share_idx % len(owners)]]
            num_shared_blocks = 1 + share_idx % owner.num_pinned_blocks
            shared_ids = np.asarray(owner.held_block_ids[:num_shared_blocks], dtype=np.int64)
            self.pool.share(shared_ids)
            table.attach_shared_prefix(shared_ids, num_shared_blocks * S)
            self.prefix_of[table.req_id] = (owner.req_id, num_shared_blocks * S)
        if not self.grow_table(table, num_prompt_tokens):
            self.pool.free(np.asarray(table.release_all(), dtype=np.int64))
            self.prefix_of.pop(table.req_id, None)
            return
        self.tables[table.req_id] = table
        self.next_req_id += 1
        if table.req_id not in self.prefix_of and 0 < num_pin_blocks * S <= table.num_tokens:
            table.pin_prefix(num_pin_blocks * S)
            self.prefix_owners.append(table.req_id)

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 10), num_new_tokens=st.integers(1, 6), decode_steps=st.booleans())
    def grow(self, idx: int, num_new_tokens: int, decode_steps: bool) -> None:
        """One sync of several tokens, or one decode step per token (appends the pool counts lazily)."""
        table = self.pick(idx)
        for _ in range(num_new_tokens if decode_steps else 1):
            if not self.grow_table(table, 1 if decode_steps else num_new_tokens):
                return

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 10), num_victims=st.integers(1, 12), seed=st.integers(0, 2**16), one_by_one=st.booleans())
    def evict(self, idx: int, num_victims: int, seed: int, one_by_one: bool) -> None:
        table = self.pick(idx)
        candidates = table.live_token_ids()
        candidates = candidates[candidates >= table.num_pinned_tokens]
        if candidates.size == 0:
            return
        rng = np.random.default_rng(seed)
        victims = rng.choice(candidates, size=min(num_victims, candidates.size), replace=False)
        for batch in np.split(victims, victims.size) if one_by_one else [victims]:
            emptied = table.evict_tokens(batch)
            if table.req_id not in self.busy_req_ids():
                table.release_blocks(emptied)
                self.pool.free(emptied)

    @precondition(lambda self: self.tables)
    @rule(seed=st.integers(0, 2**16))
    def evict_across_the_batch(self, seed: int) -> None:
        """A decode step's evictions: one token of every request with one to lose, in one call."""
        rng = np.random.default_rng(seed)
        tables, victims = [], []
        for table in self.tables.values():
            candidates = table.live_token_ids()
            candidates = candidates[candidates >= table.num_pinned_tokens]
            if candidates.size:
                tables.append(table)
                victims.append(int(rng.choice(candidates)))
        if not tables:
            return
        emptied = TokenTable.evict_one_each(tables, np.array(victims, dtype=np.int64))
        for table, block_id in zip(tables, emptied.tolist()):
            if block_id >= 0 and table.req_id not in self.busy_req_ids():
                table.release_blocks(np.array([block_id], dtype=np.int64))
                self.pool.free(np.array([block_id], dtype=np.int64))

    @rule(mode=st.sampled_from(["hole-fill", "ordered"]), max_src_blocks=st.integers(2, 5))
    def plan_and_launch(self, mode: str, max_src_blocks: int) -> None:
        busy = self.busy_req_ids()
        reclaimer = Reclaimer(ReclaimConfig(mode=mode, max_src_blocks=max_src_blocks), self.pool)
        for plan in reclaimer.plan(list(self.tables.values()), busy):
            table = self.tables[plan.req_id]
            check_plan(plan, table, self.pool, busy)  # I4, before anything is launched
            got = self.pool.allocate(plan.dst_new_block_ids.size)
            assert got.tolist() == plan.dst_new_block_ids.tolist()
            table.adopt_blocks(got)
            self.engine.launch(plan)
            busy = busy | {plan.req_id}
            self.num_plans_launched += 1

    @rule()
    def poll(self) -> None:
        for plan in self.engine.poll_completed():
            self.complete(plan)

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 10))
    def finish(self, idx: int) -> None:
        table = self.pick(idx)
        if table.req_id in self.busy_req_ids():
            self.engine.cancel(table.req_id)
        self.pool.free(np.asarray(table.release_all(), dtype=np.int64))
        del self.tables[table.req_id]

    def teardown(self) -> None:
        event(f"relocation plans launched: {min(self.num_plans_launched, 5)}{'+' if self.num_plans_launched >= 5 else ''}")
        for plan in self.engine.drain():
            self.complete(plan)
        self.check_every_live_token_reads_its_own_kv()
        for table in list(self.tables.values()):
            self.pool.free(np.asarray(table.release_all(), dtype=np.int64))
        assert self.pool.num_free_blocks == NUM_BLOCKS
        assert self.pool.num_live_tokens == 0

    # ---- invariants after every rule -------------------------------------------------------

    @invariant()
    def mapping_is_unique_and_counts_agree(self) -> None:
        check_unique_mapping(self.pool, list(self.tables.values()))  # I2

    @invariant()
    def check_every_live_token_reads_its_own_kv(self) -> None:
        in_flight = self.engine.in_flight_plans
        for table in self.tables.values():
            token_ids, slots = table.live_token_ids(), table.slots()
            assert slots.tolist() == (table.token_block_ids[token_ids] * S + table.token_offsets[token_ids]).tolist()
            check_visibility(table.req_id, slots, in_flight, S)  # I3
            got = self.kv_cache.read(torch.as_tensor(slots))
            mismatched = (got != self.expected_kv(table, token_ids)).transpose(0, 2).reshape(token_ids.size, VALUES_PER_TOKEN).any(-1).numpy()
            check_contents(table.req_id, token_ids, slots, mismatched, S)  # I1

    @invariant()
    def the_layout_trigger_sees_every_block_over_the_uncompacted_layout(self) -> None:
        busy = self.busy_req_ids()
        for table in self.tables.values():
            num_uncompacted = table.num_uncompacted_blocks()
            assert table._uncompacted_floor <= num_uncompacted
            if table.req_id not in busy:  # the runtime asks only a request without a copy in flight
                assert table.num_blocks_over_uncompacted() == max(0, table.num_blocks - num_uncompacted)

    @invariant()
    def the_reclaimable_bound_matches_a_recount(self) -> None:
        for table in self.tables.values():  # the verbs keep it; here it is counted from scratch
            assert table.max_reclaimable_blocks() == recounted_bound(table)

    @invariant()
    def pool_metrics_match_a_recount(self) -> None:
        allocated = self.pool.ref_counts > 0
        live = self.pool.live_counts[allocated]
        assert self.pool.num_allocated_blocks == int(allocated.sum())
        assert self.pool.num_live_tokens == int(self.pool.live_counts.sum())
        if live.size:
            assert abs(self.pool.waste_ratio() - (1 - live.sum() / (live.size * S))) < 1e-12
        bins = np.minimum(live * NUM_HISTOGRAM_BINS // S, NUM_HISTOGRAM_BINS - 1)
        assert self.pool.utilization_histogram().tolist() == np.bincount(bins, minlength=NUM_HISTOGRAM_BINS).tolist()


def recounted_bound(table: TokenTable) -> int:
    """The O(1) bound from its definition: the held blocks past the pinned prefix but the open
    tail, less ceil(the live tokens past the pinned prefix, those written to the open tail left
    out, / S)."""
    blocks = table.held_block_ids[table.num_pinned_blocks :]
    live = table.num_live_tokens - table.num_pinned_tokens
    is_open = blocks.size and table.tail_num_written < S
    if is_open:
        blocks, live = blocks[:-1], live - table.tail_num_written
    return blocks.size - -(-live // S)


SubstrateMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
test_substrate_state_machine = SubstrateMachine.TestCase
