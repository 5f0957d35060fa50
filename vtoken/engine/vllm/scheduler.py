"""`VTokenScheduler`: vLLM's V1 scheduler with token-level eviction and block reclamation.

Select it with `scheduler_cls="vtoken.engine.vllm.scheduler.VTokenScheduler"` (or
`--scheduler-cls`) together with the worker from worker.py, and settings in
`additional_config["vtoken"]` (settings.py). The state lives in `VTokenTracker`; this class
is the glue to vLLM's hooks:

    schedule()            super(), then sync the scheduled tokens into the token tables and
                          attach a StepPlan (moves, physical lengths, truncations) to the output
    update_from_output()  moves of the last plan have landed; super(); evict where a request
                          reached its eviction point; hand back trailing blocks; metrics
    _free_request_blocks  (preemption and finish) drop or rebuild the request's table
    KV manager            allocate_slots sees `num_computed_tokens - offset` tokens, so the
                          block list holds what the variant keeps (tracker.manager_offset);
                          a request whose layout changed never registers blocks in the prefix
                          cache (delay_cache_blocks)
    prefix caching        prefix_cache.PrefixCache: protected leading blocks, hashes dropped
                          before a rewrite, every moved or released block checked private

vLLM private names used here are listed in contract.py and checked by a test.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vtoken.engine.batch import TableFactory
from vtoken.engine.vllm.metrics import EngineMetrics
from vtoken.engine.vllm.plan import PLAN_ATTRIBUTE, SCORES_ATTRIBUTE
from vtoken.engine.vllm.prefix_cache import PrefixCache
from vtoken.engine.vllm.settings import CONFIG_KEY, VllmSettings, settings_from_additional_config
from vtoken.engine.vllm.support import check_supported
from vtoken.engine.vllm.tracker import VTokenTracker
from vtoken.errors import ConfigError, InvariantError
from vtoken.kv.token_table import TokenTable


class _ShiftedRequest:
    """A read-only view of a vLLM `Request` whose KV length is `offset` tokens shorter.

    Only the KV manager sees it: it sizes block lists from `num_computed_tokens` and
    `num_tokens`, and must count only the tokens the variant keeps blocks for.
    """

    __slots__ = ("_request", "_offset")

    def __init__(self, request: Request, offset: int) -> None:
        self._request = request
        self._offset = offset

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens - self._offset

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens - self._offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class VTokenScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.vtoken_settings = settings_from_additional_config(self.vllm_config.additional_config)
        check_supported(self.vllm_config, self.kv_cache_config)
        self._vtoken_table_factory: TableFactory = TokenTable
        self.vtoken = self._make_tracker()
        self.vtoken_metrics = EngineMetrics(self.vtoken_settings, self.vllm_config.model_config.served_model_name)
        self._num_vtoken_steps = 0
        self._block_manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        stock_allocate_slots = self.kv_cache_manager.allocate_slots

        def allocate_slots(request: Request, *args, **kwargs):
            offset = self.vtoken.manager_offset(request.request_id)
            if not self.vtoken.is_cacheable(request.request_id):
                kwargs["delay_cache_blocks"] = True  # its blocks no longer hold their logical tokens
            return stock_allocate_slots(_ShiftedRequest(request, offset) if offset else request, *args, **kwargs)

        self.kv_cache_manager.allocate_slots = allocate_slots

    def _make_tracker(self) -> VTokenTracker:
        model_config = self.vllm_config.model_config
        num_heads_layers = model_config.hf_text_config.num_attention_heads * model_config.get_total_num_hidden_layers()
        num_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks
        self.vtoken_prefix_cache = None
        num_ledger_blocks = None
        if self.kv_cache_manager.enable_caching:
            self.vtoken_prefix_cache = PrefixCache(self.kv_cache_manager, self.vtoken_settings.prefix_protection,
                                                   lambda req_id: self.requests[req_id].num_prompt_tokens)
            # a shared block is in each sharer's table: room for every running request at full length
            max_blocks_per_request = -(-model_config.max_model_len // self.block_size)
            num_ledger_blocks = num_blocks + self.scheduler_config.max_num_seqs * max_blocks_per_request
        return VTokenTracker(self.vtoken_settings, num_blocks, self.block_size, num_heads_layers,
                             table_factory=self._vtoken_table_factory, prefix_cache=self.vtoken_prefix_cache,
                             num_ledger_blocks=num_ledger_blocks)

    def reconfigure(self, settings: VllmSettings, table_factory: TableFactory | None = None) -> None:
        """Switch variant, policy or reclaim settings between runs (no request in the engine).

        The model runner only applies plans, so one engine can replay a trace once per variant.
        `table_factory`: the token table of this tracker and of every later one (an in-process
        caller's, e.g. a checker fault's); None keeps the one in use (TokenTable at start).
        """
        if self.get_num_unfinished_requests():
            raise ConfigError("cannot change vToken settings while requests are in the engine")
        record_events = self.vtoken.record_events
        self.vllm_config.additional_config[CONFIG_KEY] = settings.to_dict()
        check_supported(self.vllm_config, self.kv_cache_config)
        self.vtoken_settings = settings
        if table_factory is not None:
            self._vtoken_table_factory = table_factory
        self.vtoken = self._make_tracker()
        self.vtoken.record_events = record_events
        self._num_vtoken_steps = 0

    # ---- hooks ---------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.vtoken.req_idx(request.request_id)
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        scheduled = list(output.num_scheduled_tokens)
        for req_id, num_new_tokens in output.num_scheduled_tokens.items():
            num_cached = 0  # a prefix-cache hit: computed tokens at the request's first step
            if req_id not in self.vtoken.requests:
                num_cached = self.requests[req_id].num_computed_tokens - num_new_tokens
            block_ids = None
            if self.vtoken.num_new_blocks_needed(req_id, num_cached + num_new_tokens):
                block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            self.vtoken.sync(req_id, num_new_tokens, block_ids, num_cached)
        plan = self.vtoken.take_step_plan(scheduled)
        if self.vtoken_prefix_cache is not None and plan.num_moves:
            self._check_private(np.concatenate([plan.src_slots, plan.dst_slots]) // self.block_size,
                                "is read or written by a token move")
        setattr(output, PLAN_ATTRIBUTE, plan)
        return output

    def _check_private(self, vllm_block_ids, what: str) -> None:
        """I2 with prefix caching: the block is this request's alone and in no hash map."""
        try:
            self.vtoken_prefix_cache.check_private(vllm_block_ids, what, hashed_ok=False)
        except InvariantError:
            self.vtoken.counters = self.vtoken.counters.plus(invariant_violations=1)
            self.vtoken_metrics.observe(self.vtoken.stats(self._num_allocated_blocks()))
            raise

    def update_from_output(self, scheduler_output, model_runner_output):
        self.vtoken.complete_moves()
        for req_id, rows in (getattr(model_runner_output, SCORES_ATTRIBUTE, None) or {}).items():
            self.vtoken.add_scores(req_id, rows)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens == request.num_tokens - 1:  # KV complete, one token waits
                self.vtoken.after_step(req_id, request.num_output_tokens, request.num_computed_tokens)
        self._num_vtoken_steps += 1
        self._release_blocks()
        self.vtoken_metrics.observe(self.vtoken.stats(self._num_allocated_blocks()))
        return outputs

    def _free_request_blocks(self, request: Request) -> None:
        self.vtoken.drop(request.request_id, is_finished=request.is_finished())
        super()._free_request_blocks(request)

    # ---- block release -------------------------------------------------------------------------

    def _release_blocks(self) -> None:
        """Hand trailing blocks back to vLLM's pool where the variant keeps fewer."""
        if not self.vtoken_settings.evicts:
            return
        reclaim_now = self.vtoken.is_reclaim_step(self._num_vtoken_steps, self._num_allocated_blocks())
        for req_id in list(self.vtoken.requests):
            blocks = self._block_manager.req_to_blocks.get(req_id)
            if not blocks:
                continue
            num_keep = self.vtoken.num_blocks_to_keep(req_id, len(blocks), reclaim_now)
            if num_keep >= len(blocks):
                continue
            released = blocks[num_keep:]
            if self.vtoken_prefix_cache is not None:
                self._check_private(np.array([b.block_id for b in released]), "is handed back to the pool")
            del blocks[num_keep:]
            self.kv_cache_manager.block_pool.free_blocks(reversed(released))
            self.vtoken.blocks_released(req_id, num_keep, len(released))

    def _num_allocated_blocks(self) -> int:
        pool = self.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # the null block is never free
