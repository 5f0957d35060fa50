"""The copy engine: moves the KV entries of relocation plans, then reports them complete.

Ordering contract (invariant I3): a plan's moves are applied to the token table (and its
sources freed) only after its copy completed, so attention never reads a moved token through
its new slot before the data is there.

Modes:
- `sync`: the copy runs inside `launch` (CPU; on CUDA followed by a synchronize, the
  forced-synchronous ablation).
- `async` (CUDA): the copy runs on a dedicated stream after the compute stream's work so far;
  `wait_before_forward` makes the compute stream wait on the copy's event (GPU side, the host
  does not block); `poll_completed` returns plans whose event has fired.
- `deferred` (CPU, for checking): the data moves one step late, when `poll_completed` runs at
  the next step, so the ordering logic is really exercised without a GPU.

Without a materialized KV cache (the sim's default) plans complete at once: there is no data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vtoken.errors import ConfigError
from vtoken.kv.moves import RelocationPlan

if TYPE_CHECKING:  # torch is imported only once a KV cache exists: the sim runs without it
    import torch

    from vtoken.kv.kv_cache import PagedKVCache

COPY_MODES = ("sync", "async", "deferred")


@dataclass
class _InFlight:
    plan: RelocationPlan
    src_slots: torch.Tensor | None
    dst_slots: torch.Tensor | None
    done_event: object | None = None
    num_polls: int = field(default=0)


class CopyEngine:
    def __init__(self, kv_cache: PagedKVCache | None, mode: str = "sync") -> None:
        if mode not in COPY_MODES:
            raise ConfigError(f"unknown copy mode '{mode}'; choose one of: {', '.join(COPY_MODES)}")
        is_cuda = kv_cache is not None and kv_cache.device.type == "cuda"
        if mode == "async" and not is_cuda:
            raise ConfigError("copy mode 'async' needs a CUDA KV cache; use 'sync' or 'deferred' on CPU")
        self.kv_cache = kv_cache
        self.mode = mode
        self.block_size = kv_cache.shape.block_size if kv_cache is not None else 0
        self._stream = None
        if mode == "async":
            import torch

            self._stream = torch.cuda.Stream(device=kv_cache.device)
        self._in_flight: list[_InFlight] = []
        self._cancelled_events: list = []
        self.num_bytes_copied = 0

    @property
    def in_flight_plans(self) -> list[RelocationPlan]:
        return [entry.plan for entry in self._in_flight]

    def launch(self, plan: RelocationPlan) -> None:
        if self.kv_cache is None:
            self._in_flight.append(_InFlight(plan, None, None))
            return
        import torch

        device = self.kv_cache.device
        src = torch.as_tensor(plan.moves.src_slots(self.block_size), device=device)
        dst = torch.as_tensor(plan.moves.dst_slots(self.block_size), device=device)
        entry = _InFlight(plan, src, dst)
        self.num_bytes_copied += self._num_bytes(src.numel())
        if self.mode == "sync":
            self.kv_cache.copy_slots(src, dst)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        elif self.mode == "async":
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                self.kv_cache.copy_slots(src, dst)
                entry.done_event = torch.cuda.Event()
                entry.done_event.record(self._stream)
            src.record_stream(self._stream)
            dst.record_stream(self._stream)
        self._in_flight.append(entry)

    def _num_bytes(self, num_tokens: int) -> int:
        kv = self.kv_cache
        per_token = kv.data.element_size() * kv.shape.num_layers * 2 * kv.shape.num_kv_heads * kv.shape.head_dim
        return 2 * per_token * num_tokens  # read + write

    def wait_before_forward(self) -> None:
        """Order the next forward after every in-flight copy (GPU side; no host wait)."""
        events = [e.done_event for e in self._in_flight if e.done_event is not None] + self._cancelled_events
        if not events:
            return
        import torch

        for event in events:
            torch.cuda.current_stream(self.kv_cache.device).wait_event(event)
        self._cancelled_events = []

    def poll_completed(self) -> list[RelocationPlan]:
        """Plans whose copy has completed, in launch order; they leave the in-flight list."""
        completed, pending = [], []
        for entry in self._in_flight:
            if self._is_complete(entry):
                completed.append(entry.plan)
            else:
                pending.append(entry)
        self._in_flight = pending
        return completed

    def _is_complete(self, entry: _InFlight) -> bool:
        if self.mode == "deferred" and self.kv_cache is not None:
            entry.num_polls += 1
            if entry.num_polls < 2:
                return False
            self.kv_cache.copy_slots(entry.src_slots, entry.dst_slots)
            return True
        if entry.done_event is not None:
            return entry.done_event.query()
        return True

    def cancel(self, req_id: int) -> None:
        """Forget the plans of a request that released its blocks. On CUDA the copy was already
        enqueued; its event stays awaited so that nothing reuses the blocks before it ran."""
        kept = []
        for entry in self._in_flight:
            if entry.plan.req_id != req_id:
                kept.append(entry)
            elif entry.done_event is not None:
                self._cancelled_events.append(entry.done_event)
        self._in_flight = kept

    def drain(self) -> list[RelocationPlan]:
        """Wait for every in-flight copy (end of a run)."""
        if self._stream is not None:
            self._stream.synchronize()
        for entry in self._in_flight:
            entry.num_polls = max(entry.num_polls, 1)
        return self.poll_completed()
