"""What the trace-replay benchmarks (bench_variants.py, bench_instructions.py) replay, and what
they check of their arguments before anything runs. A bad one is one line on stderr,
`SCRIPT: message`, and exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

from vtoken import defaults
from vtoken.engine import VARIANTS, Experiment
from vtoken.engine.experiment import EvictionConfig
from vtoken.hardware import num_blocks_for_gpu, resolve_gpu
from vtoken.model_spec import resolve_model
from vtoken.trace import Request, load_trace, within_context


def fail(script: str, message: str) -> NoReturn:
    print(f"{script}: {message}", file=sys.stderr)
    raise SystemExit(2)


def checked_replay(script: str, variants: str, azure: str, max_requests: int | None) -> list[str]:
    """The variants `variants` names (comma-separated), once the names, the request count
    (None: every request) and the trace's path are checked."""
    names = variants.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        fail(script, f"--variants: unknown variant '{unknown[0]}'; known: {', '.join(VARIANTS)}")
    if max_requests is not None and max_requests < 1:
        fail(script, f"--max-requests must be at least 1, got {max_requests}")
    if not Path(azure).is_file():
        fail(script, f"--azure: no trace at {azure}")
    return names


def replayed(azure: str, max_requests: int | None,
             eviction_interval: int = defaults.EVICTION_INTERVAL_TOKENS) -> tuple[Experiment, list[Request]]:
    """What `vtoken compare TRACE --open-loop --no-sweep --no-frontier` replays: the default
    model, GPU and block budget, H2O at 50% every `eviction_interval` generated tokens, and the
    trace's first `max_requests` requests (None: all) that fit the model's context."""
    model, gpu = resolve_model(defaults.MODEL), resolve_gpu(defaults.GPU)
    num_blocks = num_blocks_for_gpu(model, gpu, defaults.GPU_MEMORY_UTILIZATION, defaults.BLOCK_SIZE)
    requests = within_context(load_trace(azure, max_requests=max_requests), model.max_model_len).requests
    return Experiment(model, gpu, num_blocks, eviction=EvictionConfig(interval_tokens=eviction_interval)), list(requests)
