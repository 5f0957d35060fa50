"""What a check runs: the options (`CheckOptions`, with `TraceLimits` from names.py) and the
scenarios built from them (`build_scenarios`): every trace, cut down to the limits, x policy x
reclaim mode on a block budget under pressure, plus seeded random draws (`fuzz_scenario`). The
hf and vllm executors run a real model, so their traces are cut down harder by default
(`default_limits`, also in names.py). Importable without torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

import vtoken
from vtoken.checker.names import EXECUTORS, FAULT_KINDS, PRESSURE, TraceLimits
from vtoken import defaults
from vtoken.engine.experiment import EvictionConfig, Experiment, Run
from vtoken.errors import ConfigError
from vtoken.kv.reclaim import RECLAIM_MODES, ReclaimConfig, StepShare
from vtoken.policies import DEFAULT_AUDIT_POLICIES, POLICIES
from vtoken.policies.base import Budget
from vtoken.trace import Request, Trace

SAMPLE_TRACES_DIR = Path(vtoken.__file__).resolve().parent.parent / "sample_traces"
TRACE_SUFFIXES = (".jsonl", ".csv", ".json")


@dataclass(frozen=True)
class CheckOptions:
    policies: tuple[str, ...] = DEFAULT_AUDIT_POLICIES
    reclaim_modes: tuple[str, ...] = RECLAIM_MODES
    executor: str = "sim"
    fault: str | None = None
    num_fuzz_scenarios: int = 0
    num_blocks: int | None = None  # None: chosen per trace so that the pool is under pressure
    block_size: int | None = None  # None: the base experiment's (fuzz: drawn per scenario)
    limits: TraceLimits = field(default_factory=TraceLimits)
    device: str | None = None  # None: cuda when available, else cpu
    concurrency: int | None = defaults.CHECK_CONCURRENCY  # the traces' closed-loop clients; None = open loop

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ConfigError(f"unknown executor '{self.executor}'; check-invariants runs on: {', '.join(EXECUTORS)}")
        if not self.policies:
            raise ConfigError("no policy to check")
        for policy in self.policies:
            if policy not in POLICIES:
                raise ConfigError(f"unknown policy '{policy}'; choose one of: {', '.join(POLICIES)} or 'all'")
        if not self.reclaim_modes:
            raise ConfigError("no reclaim mode to check")
        for mode in self.reclaim_modes:
            if mode not in RECLAIM_MODES:
                raise ConfigError(f"unknown reclaim mode '{mode}'; choose one of: {', '.join(RECLAIM_MODES)} or 'both'")
        if self.fault is not None and self.fault not in FAULT_KINDS:
            raise ConfigError(f"unknown fault '{self.fault}'; choose one of: {', '.join(FAULT_KINDS)}")
        if self.num_fuzz_scenarios < 0:
            raise ConfigError(f"--fuzz must be >= 0 scenarios, got {self.num_fuzz_scenarios}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"--num-blocks must be > 0, got {self.num_blocks}")
        if self.concurrency is not None and self.concurrency <= 0:
            raise ConfigError(f"--concurrency must be > 0, got {self.concurrency}")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError(f"--block-size must be > 0, got {self.block_size}")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"unknown device '{self.device}'; choose cpu or cuda")
        if self.device == "cuda" and not _has_cuda():
            raise ConfigError("device 'cuda' requested but torch sees no CUDA device")


def _has_cuda() -> bool:
    import torch  # only when cuda is asked for: the options are built before anything runs

    return torch.cuda.is_available()


@dataclass(frozen=True)
class Scenario:
    """One run to check: requests and the full run (policy, reclaim mode, budget, geometry, concurrency)."""

    name: str
    requests: tuple[Request, ...]
    run: Run

    @property
    def label(self) -> str:
        """What the progress bar shows: name policy/mode."""
        experiment = self.run.experiment
        return f"{self.name} {experiment.eviction.policy}/{experiment.reclaim.mode}"


def bundled_sample_traces() -> list[Path]:
    """The sample traces that ship in the repository's sample_traces/, sorted by name."""
    paths = sorted(p for p in SAMPLE_TRACES_DIR.glob("*") if p.suffix in TRACE_SUFFIXES) if SAMPLE_TRACES_DIR.is_dir() else []
    if not paths:
        raise ConfigError(f"no bundled sample traces in {SAMPLE_TRACES_DIR}; give a TRACE or --fuzz N")
    return paths


def build_scenarios(traces: Sequence[Trace], base: Experiment, options: CheckOptions) -> tuple[list[Scenario], list[str]]:
    """Scenarios of the traces (x policies x reclaim modes) and the fuzz draws; notes say what
    was cut down."""
    scenarios: list[Scenario] = []
    notes: list[str] = []
    block_size = options.block_size or base.block_size
    for trace in traces:
        name = trace.source.replace("\\", "/").rsplit("/", 1)[-1]
        requests, cut = scale_requests(trace.requests, options.limits)
        if cut:
            notes.append(f"{name}: {cut}")
        num_blocks = options.num_blocks or pressure_num_blocks(requests, block_size, base, options.concurrency)
        for policy in options.policies:
            for mode in options.reclaim_modes:
                experiment = replace(base, block_size=block_size, num_blocks=num_blocks,
                                     eviction=replace(base.eviction, policy=policy), reclaim=replace(base.reclaim, mode=mode))
                scenarios.append(Scenario(name, requests, experiment.run("vtoken", options.concurrency)))
    scenarios += [fuzz_scenario(i, base, options) for i in range(options.num_fuzz_scenarios)]
    return scenarios, notes


def scale_requests(requests: Sequence[Request], limits: TraceLimits) -> tuple[tuple[Request, ...], str]:
    """Cut a trace down to `limits`; returns the requests and a note of what was cut ('' if nothing)."""
    kept = list(requests[: limits.max_requests])
    cuts = []
    if len(kept) < len(requests):
        cuts.append(f"first {len(kept)} of {len(requests)} requests")
    max_prompt = limits.max_prompt_tokens or max(r.num_prompt_tokens for r in kept)
    max_output = limits.max_output_tokens or max(r.num_output_tokens for r in kept)
    num_long_prompts = sum(r.num_prompt_tokens > max_prompt for r in kept)
    num_long_outputs = sum(r.num_output_tokens > max_output for r in kept)
    if num_long_prompts:
        cuts.append(f"prompts capped at {max_prompt} tokens ({num_long_prompts} requests)")
    if num_long_outputs:
        cuts.append(f"outputs capped at {max_output} tokens ({num_long_outputs} requests)")
    return tuple(_capped(r, max_prompt, max_output) for r in kept), "; ".join(cuts)


def _capped(request: Request, max_prompt: int, max_output: int) -> Request:
    num_prompt = min(request.num_prompt_tokens, max_prompt)
    num_prefix = min(request.num_prefix_tokens, num_prompt - 1)
    prefix_id = request.prefix_id if num_prefix > 0 else None
    return replace(request, num_prompt_tokens=num_prompt, num_output_tokens=min(request.num_output_tokens, max_output),
                   prefix_id=prefix_id, num_prefix_tokens=num_prefix if prefix_id else 0)


def pressure_num_blocks(requests: Sequence[Request], block_size: int, base: Experiment, concurrency: int | None) -> int:
    """A budget under pressure: PRESSURE x the peak blocks of the `concurrency` largest requests,
    at least the largest request plus the ordered headroom, at most what the model leaves on
    the GPU (`base.num_blocks`)."""
    peaks = sorted((-(-(r.num_prompt_tokens + r.num_output_tokens) // block_size) for r in requests), reverse=True)
    num_resident = concurrency or len(peaks)
    num_blocks = max(int(np.ceil(PRESSURE * sum(peaks[:num_resident]))), peaks[0] + base.reclaim.max_src_blocks + 1)
    return min(num_blocks, base.num_blocks)


# ---- fuzz ------------------------------------------------------------------------------------------


def _fuzz_reclaim_budget(rng: np.random.Generator, executor: str) -> int | StepShare | None:
    """A fuzz scenario's lazy-round budget, from a stream of its own, so that the scenario's
    other draws are what they were before it was drawn: as shipped, a small fixed one (rounds
    over many steps, their plans cut by it), the whole round in one step, or one that follows
    the step with its plans cut to B' (the sim's only: a measured step would make a fuzz run
    depend on the host's timing, and fuzzing repeats exactly)."""
    kinds = ("shipped", "fixed", "whole-round", "step-share") if executor == "sim" else ("shipped", "fixed", "whole-round")
    kind = kinds[int(rng.integers(0, len(kinds)))]
    if kind == "fixed":
        return int(rng.integers(1, 129))
    if kind == "whole-round":
        return None
    if kind == "step-share":
        return StepShare(moves_per_ms=float(np.exp(rng.uniform(np.log(0.2), np.log(20.0)))))  # 0.2-20, as many below 2 as above
    return defaults.RECLAIM_MOVES_PER_STEP


def fuzz_scenario(index: int, base: Experiment, options: CheckOptions) -> Scenario:
    """Random scenario `index` of seed `base.seed`: requests (lengths, arrivals, shared
    prefixes), budget, policy, reclaim mode and its knobs, block size and block budget."""
    rng = np.random.default_rng([base.seed, index, 0xF0])
    block_size = options.block_size or int(rng.choice([4, 8, 16, 32]))
    requests = _fuzz_requests(rng, block_size)
    keep = Budget(keep_ratio=float(rng.uniform(0.15, 0.9)), num_sink_tokens=int(rng.integers(0, 9)),
                  num_recent_tokens=int(rng.integers(0, 65)))
    if rng.random() < 0.3:
        keep = replace(keep, keep_ratio=None, num_tokens=int(rng.integers(16, 512)))
    mode = str(rng.choice(options.reclaim_modes))
    reclaim = ReclaimConfig(mode=mode, theta_f=float(rng.uniform(0.05, 0.5)), check_interval_steps=int(rng.integers(1, 5)),
                            max_src_blocks=int(rng.integers(2, 33)),
                            max_moves_per_step=_fuzz_reclaim_budget(np.random.default_rng([base.seed, index, 0xB0]),
                                                                    options.executor))
    concurrency = None if rng.random() < 0.3 else int(rng.integers(1, 9))
    seed = int(rng.integers(0, 2**31))
    scheduler = replace(base.scheduler, max_num_batched_tokens=int(rng.choice([64, 256, 2048])))
    eviction = EvictionConfig(str(rng.choice(options.policies)), keep, int(rng.choice([1, 4, 8, 16, 32])))
    # From starved (long requests dropped, preemption) to roomy; the floor admits most requests.
    peaks = sorted(-(-(r.num_prompt_tokens + r.num_output_tokens) // block_size) for r in requests)
    num_resident_peak = sum(peaks[-(concurrency or len(peaks)):])
    num_floor = int(rng.uniform(0.5, 1.0) * peaks[-1]) + reclaim.num_headroom_blocks + 1
    num_blocks = options.num_blocks or max(int(rng.uniform(0.1, 1.0) * num_resident_peak), num_floor)
    experiment = replace(base, block_size=block_size, num_blocks=num_blocks, seed=seed, scheduler=scheduler,
                         eviction=eviction, reclaim=reclaim)
    return Scenario(f"fuzz-{index:03d}", requests, experiment.run("vtoken", concurrency))


def _fuzz_requests(rng: np.random.Generator, block_size: int) -> tuple[Request, ...]:
    num_prefixes = int(rng.integers(0, 4))
    prefix_lengths = [int(rng.integers(1, 8)) * block_size + int(rng.integers(0, block_size)) for _ in range(num_prefixes)]
    requests, arrival_s = [], 0.0
    for i in range(int(rng.integers(2, 17))):
        num_question = int(np.exp(rng.uniform(np.log(4), np.log(1500))))
        prefix_idx = int(rng.integers(0, num_prefixes)) if num_prefixes and rng.random() < 0.7 else None
        num_prefix = prefix_lengths[prefix_idx] if prefix_idx is not None else 0
        arrival_s += float(rng.exponential(0.05))
        requests.append(Request(
            f"fuzz-{i}", arrival_s, num_prefix + num_question, int(rng.integers(1, 200)),
            prefix_id=f"p{prefix_idx}" if prefix_idx is not None else None, num_prefix_tokens=num_prefix,
        ))
    return tuple(requests)
