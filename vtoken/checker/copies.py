"""The copy engine of a checked run, which keeps every copy in flight across the next forward,
so that the ordering the runtime must respect really has a window:

- on CPU the copy engine runs `deferred`: the runtime polls once per step, before the forward,
  and a deferred copy lands at its second poll, so its data lands only after the next forward;
- on CUDA it runs `async` on a side stream, and `ReportAfterForwardCopyEngine` reports its
  completion only after that forward (a small copy may land before the host polls again).

`CopyEngineWrapper` is also the base of the fault that substitutes plans (`faults.py`).
"""

from __future__ import annotations

from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.kv_cache import PagedKVCache
from vtoken.kv.moves import RelocationPlan


def copy_mode_for(device: str) -> str:
    """`async` on a CUDA stream; on CPU `deferred`, so that copies land one step after launch."""
    return "async" if device == "cuda" else "deferred"


def make_copy_engine(kv_cache: PagedKVCache) -> CopyEngine:
    """The copy engine of a checked run: every plan stays in flight across the next forward."""
    engine = CopyEngine(kv_cache, copy_mode_for(kv_cache.device.type))
    if engine.mode == "deferred":
        return engine
    return ReportAfterForwardCopyEngine(engine)


class CopyEngineWrapper:
    """Delegates to a copy engine; subclasses change one part of its behaviour."""

    def __init__(self, inner: CopyEngine) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    @property
    def in_flight_plans(self) -> list[RelocationPlan]:
        return self._inner.in_flight_plans

    def launch(self, plan: RelocationPlan) -> None:
        self._inner.launch(plan)

    def wait_before_forward(self) -> None:
        self._inner.wait_before_forward()

    def poll_completed(self) -> list[RelocationPlan]:
        return self._inner.poll_completed()

    def cancel(self, req_id: int) -> None:
        self._inner.cancel(req_id)

    def drain(self) -> list[RelocationPlan]:
        return self._inner.drain()


class ReportAfterForwardCopyEngine(CopyEngineWrapper):
    """`async` copies (CUDA) whose completion is reported only once a forward ran while they
    were in flight. A small copy on the side stream may land before the host polls again; the
    runtime must behave the same when it has not, and this makes that case happen every time."""

    def __init__(self, inner: CopyEngine) -> None:
        super().__init__(inner)
        self._landed: list[RelocationPlan] = []  # completed by the inner engine, not reported yet
        self._num_forwards: dict[int, int] = {}  # id(plan) -> forwards begun since its launch

    @property
    def in_flight_plans(self) -> list[RelocationPlan]:
        return self._landed + self._inner.in_flight_plans

    def launch(self, plan: RelocationPlan) -> None:
        self._inner.launch(plan)
        self._num_forwards[id(plan)] = 0

    def wait_before_forward(self) -> None:
        self._inner.wait_before_forward()
        for key in self._num_forwards:
            self._num_forwards[key] += 1

    def poll_completed(self) -> list[RelocationPlan]:
        # the first forward begins right after the poll that follows its wait: 2 = one forward passed
        self._landed += self._inner.poll_completed()
        ready = [p for p in self._landed if self._num_forwards[id(p)] >= 2]
        self._landed = [p for p in self._landed if self._num_forwards[id(p)] < 2]
        for plan in ready:
            del self._num_forwards[id(plan)]
        return ready

    def cancel(self, req_id: int) -> None:
        for plan in self.in_flight_plans:
            if plan.req_id == req_id:
                del self._num_forwards[id(plan)]
        self._landed = [p for p in self._landed if p.req_id != req_id]
        self._inner.cancel(req_id)

    def drain(self) -> list[RelocationPlan]:
        plans = self._landed + self._inner.drain()
        self._landed = []
        self._num_forwards.clear()
        return plans
