"""`VTokenWorker`: vLLM's worker whose model runner applies the scheduler's StepPlan.

Select it with `worker_cls="vtoken.engine.vllm.worker.VTokenWorker"` (or `--worker-cls`). It
subclasses the CPU worker on CPU and the GPU worker elsewhere; after the stock runner is built,
its class is swapped for one with `VTokenRunnerMixin` in front, which adds three things:

1. Before anything else in `execute_model`: truncate block tables that handed blocks back,
   then copy the planned token moves inside the real KV tensors (CPU: in the per-ISA layout the
   attention kernels wrote, kv_layout.py; CUDA: on a side stream, with an event the forward
   waits on, so the host never blocks).
2. After the stock `_prepare_inputs`: rotary positions stay logical, but each new token's slot
   comes from its physical position (position - evicted count) and attention reads
   `seq_len = live tokens`, so `seq_lens`, `optimistic_seq_lens_cpu` and the slot mapping are
   refreshed for requests that lost tokens.
3. Attention rows for H2O-style policies, when the plan asks for them: the scoring backend
   (attention.py) fills a collector during the forward; `sample_tokens` hands the rows to the
   scheduler on the ModelRunnerOutput.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.platforms import current_platform

from vtoken.engine.vllm.kv_layout import cpu_copied_correctly, cpu_gather, cpu_index_map, cpu_slot_copy, cuda_slot_copy
from vtoken.engine.vllm.plan import PLAN_ATTRIBUTE, SCORES_ATTRIBUTE, StepPlan
from vtoken.errors import InvariantError

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as _StockRunner
    from vllm.v1.worker.cpu_worker import CPUWorker as _StockWorker

    from vtoken.engine.vllm import attention
else:
    attention = None
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as _StockRunner
    from vllm.v1.worker.gpu_worker import Worker as _StockWorker


class VTokenRunnerMixin:
    """Goes in front of vLLM's V1 model runner (GPUModelRunner or CPUModelRunner)."""

    _vtoken_plan: StepPlan | None = None
    _vtoken_copy_stream: torch.cuda.Stream | None = None
    _vtoken_collector = None  # attention.ScoreCollector, made on first use
    vtoken_bytes_copied: int = 0

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        plan = getattr(scheduler_output, PLAN_ATTRIBUTE, None)
        self._vtoken_plan = plan
        if plan is not None:
            self._vtoken_truncate_block_tables(plan.block_table_lengths)
            self._vtoken_copy(plan)
        return super().execute_model(scheduler_output, intermediate_tensors)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        plan = self._vtoken_plan
        if plan is not None and plan.num_evicted_tokens:
            self._vtoken_physical_lengths(plan.num_evicted_tokens, scheduler_output.total_num_scheduled_tokens)
        if plan is not None and plan.score_req_ids:
            self._vtoken_collect_scores(plan.score_req_ids)
        return result

    def sample_tokens(self, *args, **kwargs):
        output = super().sample_tokens(*args, **kwargs)
        collector = self._vtoken_collector
        if collector is not None and collector.rows:
            setattr(output, SCORES_ATTRIBUTE, collector.sums)
            collector.begin_step({})
        return output

    def _vtoken_collect_scores(self, req_ids: frozenset[str]) -> None:
        if attention is None:
            raise RuntimeError("attention-score policies (H2O, Scissorhands, TOVA) run on the CPU backend only")
        if self._vtoken_collector is None:
            self._vtoken_collector = attention.ScoreCollector(self._vtoken_index_map())
            layers = self.compilation_config.static_forward_context.values()
            if attention.attach(layers, self._vtoken_collector) == 0:
                raise RuntimeError("no attention layer runs vToken's scoring backend; was the model built "
                                   "before VTokenWorker registered it?")
        rows = {row: req_id for row, req_id in enumerate(self.input_batch.req_ids[: self.input_batch.num_reqs])
                if req_id in req_ids}
        self._vtoken_collector.begin_step(rows)

    # ---- block tables --------------------------------------------------------------------------

    def _vtoken_truncate_block_tables(self, lengths: dict[str, int]) -> None:
        """Drop trailing block ids the scheduler freed, before this step's new ids are appended."""
        for req_id, num_blocks in lengths.items():
            state = self.requests.get(req_id)
            if state is not None:
                del state.block_ids[0][num_blocks:]
            row = self.input_batch.req_id_to_index.get(req_id)
            if row is not None:
                table = self.input_batch.block_table[0]
                table.num_blocks_per_row[row] = min(table.num_blocks_per_row[row], num_blocks)

    # ---- KV copies -----------------------------------------------------------------------------

    def _vtoken_copy(self, plan: StepPlan) -> None:
        if plan.num_moves == 0:
            return
        src = torch.from_numpy(plan.src_slots)
        dst = torch.from_numpy(plan.dst_slots)
        if self.device.type == "cpu":
            index_map = self._vtoken_index_map()
            before = cpu_gather(self.kv_caches, src, index_map) if plan.verify_copies else None
            self.vtoken_bytes_copied += cpu_slot_copy(self.kv_caches, src, dst, index_map)
            if before is not None and not cpu_copied_correctly(self.kv_caches, src, dst, index_map, before):
                raise InvariantError("I1", f"a KV copy of {plan.num_moves} tokens did not land byte for byte")
            return
        self._vtoken_cuda_copy(src, dst)

    def _vtoken_index_map(self) -> torch.Tensor:
        kv = self.kv_caches[0]  # [num_blocks, num_kv_heads, block_size, 2 * head_dim]
        isa = next(getattr(layer, "isa") for layer in self.compilation_config.static_forward_context.values()
                   if hasattr(layer, "isa"))
        return cpu_index_map(isa, kv.shape[2], kv.shape[3] // 2, kv.dtype)

    def _vtoken_cuda_copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy on a side stream after the work queued so far; the forward waits on its event."""
        if self._vtoken_copy_stream is None:
            self._vtoken_copy_stream = torch.cuda.Stream(device=self.device)
        compute = torch.cuda.current_stream(self.device)
        stream = self._vtoken_copy_stream
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            src_dev = src.to(self.device, non_blocking=True)
            dst_dev = dst.to(self.device, non_blocking=True)
            self.vtoken_bytes_copied += cuda_slot_copy(self.kv_caches, src_dev, dst_dev, self.cache_config.block_size)
            done = torch.cuda.Event()
            done.record(stream)
        src_dev.record_stream(compute)
        dst_dev.record_stream(compute)
        compute.wait_event(done)

    # ---- physical lengths ----------------------------------------------------------------------

    def _vtoken_physical_lengths(self, num_evicted: dict[str, int], num_tokens: int) -> None:
        """Slots from physical positions; attention reads the live count. Positions stay logical."""
        num_reqs = self.input_batch.num_reqs
        offsets_np = np.array([num_evicted.get(r, 0) for r in self.input_batch.req_ids[:num_reqs]], dtype=np.int64)
        offsets = torch.from_numpy(offsets_np).to(self.device)
        req_indices = self.req_indices.gpu[:num_tokens].to(torch.int64)
        physical_positions = self.positions[:num_tokens] - offsets[req_indices]
        self.input_batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1],
                                                          physical_positions)
        self.seq_lens[:num_reqs] -= offsets.to(self.seq_lens.dtype)
        self.optimistic_seq_lens_cpu[:num_reqs] -= torch.from_numpy(offsets_np).to(self.optimistic_seq_lens_cpu.dtype)


class VTokenModelRunner(VTokenRunnerMixin, _StockRunner):
    """The stock runner with vToken's steps; built by swapping the class of a stock instance."""


class VTokenWorker(_StockWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if attention is not None:
            attention.register()  # before the model (and its attention layers) is built

    def init_device(self) -> None:
        super().init_device()
        if not isinstance(self.model_runner, _StockRunner):
            raise RuntimeError(f"vToken needs vLLM's V1 model runner, got {type(self.model_runner).__name__}; "
                               "set VLLM_USE_V2_MODEL_RUNNER=0")
        self.model_runner.__class__ = VTokenModelRunner
