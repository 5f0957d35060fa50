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
   scheduler on the ModelRunnerOutput. Under tensor parallelism each rank holds
   `num_heads / tp` heads, so the rows are summed over the TP group first (an all-reduce on its
   CPU group): the one scheduler ranks tokens on every head, and every rank applies the one
   plan it gets in the broadcast `SchedulerOutput` to its own shard of heads.

On a check run (`StepPlan.verify_copies`, CPU) it also checks, raising InvariantError:

    after the copy          I1  every destination holds, byte for byte, what its source held
    before the forward      I3  each request reads exactly its live tokens' slots (block table
                                row x seq_len) and writes its new K/V to the slots its token
                                table gave them; every copy destination already holds its
                                source's K/V (no read before the copy landed)

How a step's moves are copied and which evicted counts the read lengths and the new tokens'
slots subtract are two parts, a `StepCopier` and a `PhysicalLengths`; an in-process caller
hands the runner others with `runner.vtoken_use(...)` (the checker's faults, checker/faults.py).
Nothing outside replaces the runner's methods.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from vllm.platforms import current_platform

from vtoken.engine.vllm.kv_layout import cpu_gather, cpu_index_map, cpu_mismatched_tokens, cpu_slot_copy, cuda_slot_copy
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


SlotCopy = Callable[[torch.Tensor, torch.Tensor], int]  # (src slots, dst slots) -> bytes copied
CopyStep = Callable[[StepPlan], None]  # copies a step's moves (then I1 on a check run)


class StepCopier(Protocol):
    """How and when the runner copies a step's planned moves."""

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, copy: SlotCopy) -> int:
        """Copy these moves with `copy` (the runner's own); bytes copied."""

    def before_forward(self, plan: StepPlan, copy_step: CopyStep) -> None:
        """At the start of `execute_model`, before the forward."""

    def after_forward(self, copy_step: CopyStep) -> None:
        """After the forward of `execute_model`."""


class PhysicalLengths(Protocol):
    """Given the scheduler's evicted count per request: the counts the runner subtracts."""

    def read_offsets(self, num_evicted: dict[str, int]) -> dict[str, int]:
        """What each request's attention read length (seq_len) is shortened by."""

    def write_offsets(self, num_evicted: dict[str, int]) -> dict[str, int]:
        """What each new token's position is shortened by to give its slot."""


class CopyBeforeForward:
    """The runner's copier: every move, before the forward that reads it."""

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, copy: SlotCopy) -> int:
        return copy(src_slots, dst_slots)

    def before_forward(self, plan: StepPlan, copy_step: CopyStep) -> None:
        copy_step(plan)

    def after_forward(self, copy_step: CopyStep) -> None:
        pass


class SchedulerLengths:
    """The runner's lengths: reads cover the live tokens (`seq_len - evicted count`), a new
    token goes to its physical position (`position - evicted count`)."""

    def read_offsets(self, num_evicted: dict[str, int]) -> dict[str, int]:
        return num_evicted

    def write_offsets(self, num_evicted: dict[str, int]) -> dict[str, int]:
        return num_evicted


class VTokenRunnerMixin:
    """Goes in front of vLLM's V1 model runner (GPUModelRunner or CPUModelRunner)."""

    _vtoken_copier: StepCopier = CopyBeforeForward()  # stateless defaults, shared
    _vtoken_lengths: PhysicalLengths = SchedulerLengths()
    _vtoken_plan: StepPlan | None = None
    _vtoken_copy_stream: torch.cuda.Stream | None = None
    _vtoken_collector = None  # attention.ScoreCollector, made on first use
    _vtoken_expected_kv: list[torch.Tensor] | None = None  # check runs: the step's copy sources, before the copy
    vtoken_bytes_copied: int = 0
    vtoken_num_checks: Counter | None = None  # invariant -> checks this runner ran (check runs)

    def vtoken_use(self, *, copier: StepCopier | None = None, lengths: PhysicalLengths | None = None) -> None:
        """Use these parts from now on, for the rest of the runner's life (None: keep the one
        in use). For in-process engines: the checker's faults."""
        if copier is not None:
            self._vtoken_copier = copier
        if lengths is not None:
            self._vtoken_lengths = lengths

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        plan = getattr(scheduler_output, PLAN_ATTRIBUTE, None)
        self._vtoken_plan = plan
        self._vtoken_expected_kv = None
        if plan is not None:
            self._vtoken_truncate_block_tables(plan.block_table_lengths)
            if plan.verify_copies and plan.num_moves and self.device.type == "cpu":
                self._vtoken_expected_kv = cpu_gather(self.kv_caches, torch.from_numpy(plan.src_slots),
                                                      self._vtoken_index_map())
            self._vtoken_copier.before_forward(plan, self._vtoken_copy)
        output = super().execute_model(scheduler_output, intermediate_tensors)
        self._vtoken_copier.after_forward(self._vtoken_copy)
        return output

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        plan = self._vtoken_plan
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if plan is not None and plan.num_evicted_tokens:
            self._vtoken_slot_mapping(self._vtoken_lengths.write_offsets(plan.num_evicted_tokens), num_tokens)
            self._vtoken_read_lengths(self._vtoken_lengths.read_offsets(plan.num_evicted_tokens))
        if plan is not None and plan.score_req_ids:
            self._vtoken_collect_scores(plan.score_req_ids)
        if plan is not None and plan.live_slots:
            self._vtoken_check_reads(plan, num_tokens)
        return result

    def sample_tokens(self, *args, **kwargs):
        output = super().sample_tokens(*args, **kwargs)
        collector = self._vtoken_collector
        if collector is not None and collector.rows:
            setattr(output, SCORES_ATTRIBUTE, _sum_over_tensor_parallel_ranks(collector.sums))
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
        """The plan's token moves, complete when this returns on CPU; then I1 on a check run."""
        if plan.num_moves == 0:
            return
        self.vtoken_bytes_copied += self._vtoken_copier.copy_slots(torch.from_numpy(plan.src_slots),
                                                                   torch.from_numpy(plan.dst_slots),
                                                                   self.vtoken_copy_slots)
        if self._vtoken_expected_kv is not None:
            self._vtoken_check_landed(plan.dst_slots, "I1", f"a KV copy of {plan.num_moves} tokens did not land "
                                      "byte for byte")

    def vtoken_copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        """dst[i] <- src[i] (vLLM slots) in every layer, every source read before any write. Bytes
        copied. The copy every plan's moves go through; `vtoken calibrate` times it alone."""
        if self.device.type == "cpu":
            return cpu_slot_copy(self.kv_caches, src, dst, self._vtoken_index_map())
        return self._vtoken_cuda_copy(src, dst)

    def _vtoken_check_landed(self, dst_slots: np.ndarray, invariant: str, context: str) -> None:
        """Every copy destination holds the K/V its source held when the step began."""
        self._vtoken_count_check(invariant)
        wrong = cpu_mismatched_tokens(self.kv_caches, torch.from_numpy(dst_slots), self._vtoken_index_map(),
                                      self._vtoken_expected_kv)
        if np.any(wrong):
            slot = int(dst_slots[np.flatnonzero(wrong)[0]])
            self._vtoken_fail(invariant, slot, f"{context}: destination {self._vtoken_place(slot)} does not hold "
                              f"the K/V its source held ({int(wrong.sum())} of {dst_slots.size} destinations differ)")

    def _vtoken_index_map(self) -> torch.Tensor:
        kv = self.kv_caches[0]  # [num_blocks, num_kv_heads, block_size, 2 * head_dim]
        isa = next(getattr(layer, "isa") for layer in self.compilation_config.static_forward_context.values()
                   if hasattr(layer, "isa"))
        return cpu_index_map(isa, kv.shape[2], kv.shape[3] // 2, kv.dtype)

    def _vtoken_cuda_copy(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        """Copy on a side stream after the work queued so far; the forward waits on its event."""
        if self._vtoken_copy_stream is None:
            self._vtoken_copy_stream = torch.cuda.Stream(device=self.device)
        compute = torch.cuda.current_stream(self.device)
        stream = self._vtoken_copy_stream
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            src_dev = src.to(self.device, non_blocking=True)
            dst_dev = dst.to(self.device, non_blocking=True)
            num_bytes = cuda_slot_copy(self.kv_caches, src_dev, dst_dev, self.cache_config.block_size)
            done = torch.cuda.Event()
            done.record(stream)
        src_dev.record_stream(compute)
        dst_dev.record_stream(compute)
        compute.wait_event(done)
        return num_bytes

    # ---- physical lengths ----------------------------------------------------------------------

    def _vtoken_slot_mapping(self, num_evicted: dict[str, int], num_tokens: int) -> None:
        """Slots of this step's new tokens from their physical positions (position - evicted
        count); the positions themselves stay logical (rotary)."""
        num_reqs = self.input_batch.num_reqs
        offsets = torch.from_numpy(self._vtoken_row_offsets(num_evicted)).to(self.device)
        req_indices = self.req_indices.gpu[:num_tokens].to(torch.int64)
        physical_positions = self.positions[:num_tokens] - offsets[req_indices]
        self.input_batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1],
                                                          physical_positions)

    def _vtoken_read_lengths(self, num_evicted: dict[str, int]) -> None:
        """The KV length attention reads: the live tokens, `seq_len - evicted count`."""
        num_reqs = self.input_batch.num_reqs
        offsets = torch.from_numpy(self._vtoken_row_offsets(num_evicted))
        self.seq_lens[:num_reqs] -= offsets.to(self.device).to(self.seq_lens.dtype)
        self.optimistic_seq_lens_cpu[:num_reqs] -= offsets.to(self.optimistic_seq_lens_cpu.dtype)

    def _vtoken_row_offsets(self, num_evicted: dict[str, int]) -> np.ndarray:
        """int64 [num_reqs]: evicted count of the request in each batch row (0 when absent)."""
        req_ids = self.input_batch.req_ids[: self.input_batch.num_reqs]
        return np.array([num_evicted.get(r, 0) for r in req_ids], dtype=np.int64)

    # ---- checks (check runs) -------------------------------------------------------------------

    def _vtoken_check_reads(self, plan: StepPlan, num_tokens: int) -> None:
        """I3 on what this forward is about to read and write, from the tensors attention gets.

        Per request: the slots it reads, positions 0..seq_len-1 through its block table row, are
        exactly its live tokens' slots; its new K/V goes to the slots its token table gave them.
        Then every copy destination of the step holds its source's K/V: the copy has landed.
        """
        num_reqs = self.input_batch.num_reqs
        block_size = self.cache_config.block_size
        block_table = self.input_batch.block_table[0]
        rows = block_table.get_device_tensor(num_reqs).cpu().numpy().astype(np.int64)
        seq_lens = self.seq_lens[:num_reqs].cpu().numpy()
        written = block_table.slot_mapping.gpu[:num_tokens].cpu().numpy()
        starts = self.query_start_loc.gpu[: num_reqs + 1].cpu().numpy()
        for row, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            live_slots = plan.live_slots.get(req_id)
            if live_slots is None:
                continue
            self._vtoken_count_check("I3")
            positions = np.arange(int(seq_lens[row]))
            if positions.size and positions[-1] // block_size >= rows.shape[1]:
                self._vtoken_fail("I3", None, f"request {req_id} reads {positions.size} tokens, past its block table")
            read = rows[row, positions // block_size] * block_size + positions % block_size  # by position
            if not np.array_equal(np.sort(read), live_slots):
                self._vtoken_fail_read(req_id, read, live_slots)
            new_slots, expected = written[starts[row] : starts[row + 1]], plan.new_slots[req_id]
            if not np.array_equal(new_slots, expected):
                self._vtoken_fail_write(req_id, new_slots, expected)
        if self._vtoken_expected_kv is not None:
            self._vtoken_check_landed(plan.dst_slots, "I3", f"this forward reads the {plan.num_moves} moved tokens "
                                      "before their copy landed")

    def _vtoken_fail_read(self, req_id: str, read: np.ndarray, live_slots: np.ndarray) -> None:
        """`read`: the slots the request reads, by position; `live_slots`: its live tokens', sorted."""
        counts = f"request {req_id} reads {read.size} slots for its {live_slots.size} live tokens"
        stray = np.flatnonzero(~np.isin(read, live_slots))
        if stray.size:
            slot = int(read[stray[0]])
            self._vtoken_fail("I3", slot, f"{counts}: position {int(stray[0])}, at {self._vtoken_place(slot)}, "
                              "holds none of them")
        missing = np.setdiff1d(live_slots, read)
        if missing.size:
            slot = int(missing[0])
            self._vtoken_fail("I3", slot, f"{counts}: the one at {self._vtoken_place(slot)} is never read")
        self._vtoken_fail("I3", None, f"{counts}: one slot is read twice")

    def _vtoken_fail_write(self, req_id: str, new_slots: np.ndarray, expected: np.ndarray) -> None:
        stray = np.setdiff1d(new_slots, expected)
        if stray.size:
            slot = int(stray[0])
            self._vtoken_fail("I3", slot, f"request {req_id} writes a new token's K/V to {self._vtoken_place(slot)}, "
                              "where its token table maps none of its new tokens")
        self._vtoken_fail("I3", None, f"request {req_id} writes {new_slots.size} new tokens' K/V, not to the "
                          f"{expected.size} slots its token table gives them in that order")

    def _vtoken_fail(self, invariant: str, slot: int | None, message: str) -> None:
        """Raise InvariantError, naming the vLLM block and offset of `slot` when given."""
        if slot is None:
            raise InvariantError(invariant, message)
        block_id, offset = divmod(slot, self.cache_config.block_size)
        raise InvariantError(invariant, message, block_id=block_id, offset=offset)

    def _vtoken_place(self, slot: int) -> str:
        block_id, offset = divmod(slot, self.cache_config.block_size)
        return f"block {block_id} offset {offset}"

    def _vtoken_count_check(self, invariant: str) -> None:
        if self.vtoken_num_checks is None:
            self.vtoken_num_checks = Counter()
        self.vtoken_num_checks[invariant] += 1


def _sum_over_tensor_parallel_ranks(sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each rank's attention rows (its heads) summed over the TP group; unchanged without TP.

    Every rank scores the same requests with the same shapes (one SchedulerOutput), so the rows
    are flattened in request-id order, all-reduced in one call and split again.
    """
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return sums
    req_ids = sorted(sums)
    flat = torch.from_numpy(np.concatenate([np.asarray(sums[r], dtype=np.float64).ravel() for r in req_ids]))
    torch.distributed.all_reduce(flat, group=group.cpu_group)
    reduced, start = {}, 0
    for req_id in req_ids:
        shape = np.shape(sums[req_id])
        size = int(np.prod(shape))
        reduced[req_id] = flat[start : start + size].numpy().reshape(shape)
        start += size
    return reduced


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
