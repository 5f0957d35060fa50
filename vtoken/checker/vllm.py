"""`check-invariants --executor vllm`: the checks run inside vLLM's scheduler and worker, one
in-process engine for every run, optionally with a fault's parts inside it.

    VllmChecker.check(traces, base, options)            -> CheckReport (as sim and hf)
        the trace (default: azure_conv_sample.csv), cut down to `VLLM_LIMITS`
        the model folder's config.json gives the KV geometry; block size 32 (vLLM's CPU
        kernels need a multiple of 32); enough blocks for `concurrency` full-length requests
        one engine; per (variant, reclaim mode) of `VLLM_CHECK_VARIANTS` x the options' modes:
            scheduler.reconfigure -> replay(check_invariants=True) -> one RunCheck

Every eviction is followed by I1 (live ids kept), I2 (one slot per live token over all tables,
pool counts agree) and I3 (dense live layout), in the scheduler; in the worker, every KV copy
is read back byte for byte (I1 on the data) and, before each forward, what attention reads and
writes is compared with the token tables, and the copies of the step must have landed (I3). I4
has nothing to check: a compaction is applied when it is planned and no block is shared. A
violation is raised inside vLLM's step; the check stops there and the runs after it do not run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from vtoken.checker.faults import Fault, make_fault
from vtoken.checker.names import INVARIANTS, VLLM_CHECK_UNITS
from vtoken.checker.report import CheckReport, KVLayout, RunCheck, Tally, Violation
from vtoken.checker.scenarios import CheckOptions, bundled_sample_traces, scale_requests
from vtoken.engine.experiment import Experiment, Run
from vtoken.errors import ConfigError, InvariantError
from vtoken.model_spec import model_spec_from_hf_config
from vtoken.trace import Request, Trace, load_trace, num_output_tokens

Progress = Callable[[str, int], None]  # (stage description, units done), as vtoken.analysis

VLLM_DEFAULT_TRACE = "azure_conv_sample.csv"
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention kernels need a multiple of 32
VLLM_CHECK_VARIANTS = ("naive-evict", "vtoken")  # native evicts nothing: nothing moves, nothing to check
VLLM_NO_I4 = ("I4 has nothing to check on vLLM: a compaction is applied when it is planned, and with prefix "
              "caching off no block is shared")
VLLM_STOPS_NOTE = "a violation is raised inside vLLM's step: the check stopped there and the runs after it did not run"


class VllmChecker:
    """The vllm executor's checker. `model`: smollm2-135m or a local model folder with a config.json."""

    def __init__(self, model: str | None = None, on_status: Callable[[str], None] | None = None) -> None:
        self.model = model
        self._on_status = on_status

    def default_traces(self, options: CheckOptions) -> list[Trace]:
        return [load_trace(next(p for p in bundled_sample_traces() if p.name == VLLM_DEFAULT_TRACE))]

    def num_progress_units(self, traces: Sequence[Trace], base: Experiment, options: CheckOptions) -> int:
        self._validate(options)
        requests = [r for t in traces for r in scale_requests(t.requests, options.limits)[0]]
        return len(VLLM_CHECK_VARIANTS) * len(options.reclaim_modes) * num_output_tokens(requests)

    def check(self, traces: Sequence[Trace], base: Experiment, options: CheckOptions,
              progress: Progress | None = None) -> CheckReport:
        from vtoken.engine.vllm.engine import model_runner_of, open_llm
        from vtoken.engine.vllm.run import default_num_blocks, engine_spec_for, settings_for

        started = time.perf_counter()
        fault = self._validate(options)
        folder = self.model_folder()
        cut = [(_name(t), *scale_requests(t.requests, options.limits)) for t in traces]
        block_size = options.block_size or VLLM_BLOCK_SIZE
        all_requests = [r for _, requests, _ in cut for r in requests]
        base = replace(base, model=replace(model_spec_from_hf_config(folder), dtype_bytes=4),  # the engine runs fp32
                       block_size=block_size, eviction=replace(base.eviction, policy=options.policies[0]),
                       num_blocks=options.num_blocks or default_num_blocks(all_requests, options.concurrency, block_size))
        notes = [f"{name}: {note}" for name, _, note in cut if note] + self._policy_notes(options) + [VLLM_NO_I4]
        runs: list[RunCheck] = []
        with open_llm(engine_spec_for(base, options.concurrency, str(folder)), settings_for(base, "vtoken")) as llm:
            runner = model_runner_of(llm)
            put_fault(llm, fault)
            for name, requests, _ in cut:
                for variant, mode in ((v, m) for v in VLLM_CHECK_VARIANTS for m in options.reclaim_modes):
                    run = replace(base, reclaim=replace(base.reclaim, mode=mode)).run(variant, options.concurrency)
                    runs.append(_check_run(llm, f"{name} {variant}", run, requests, fault, progress))
                    if runs[-1].stopped:
                        break
                if runs and runs[-1].stopped:
                    break
            device = runner.device.type
        if any(run.stopped for run in runs):
            notes.append(VLLM_STOPS_NOTE)
        spec = base.model
        return CheckReport(tuple(runs), base, options, device, "sync" if device == "cpu" else "async", tuple(notes),
                           time.perf_counter() - started, KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32"),
                           dict(VLLM_CHECK_UNITS), model_kv=True)

    def _validate(self, options: CheckOptions) -> Fault:
        """The fault to inject (a `Fault()` for none); ConfigError for what cannot run on vLLM."""
        fault = make_fault(options.fault)
        if fault.vllm_refusal:
            raise ConfigError(f"--inject-fault {options.fault} cannot run on --executor vllm: {fault.vllm_refusal}")
        if options.num_fuzz_scenarios:
            raise ConfigError("--fuzz runs on the sim and hf executors; --executor vllm replays traces")
        from vtoken.replay import require_vllm

        require_vllm()
        self.model_folder()
        return fault

    def model_folder(self) -> Path:
        """The local folder the engine loads, resolved as compare's (`vtoken.replay.model_folder`)."""
        from vtoken.replay import model_folder

        return model_folder("vllm", self.model, self._on_status)

    @staticmethod
    def _policy_notes(options: CheckOptions) -> list[str]:
        if len(options.policies) == 1:
            return []
        return [f"policy {options.policies[0]} only (of {', '.join(options.policies)}): one engine replays every "
                "run; give --policy to check another"]


def put_fault(llm, fault: Fault) -> None:
    """Build `fault`'s parts into an in-process engine for the rest of its life: the model
    runner's copier and lengths, and the token tables of the scheduler's trackers (its current
    tracker is made afresh with them; no request may be in the engine)."""
    from vtoken.engine.vllm.engine import model_runner_of, scheduler_of

    model_runner_of(llm).vtoken_use(copier=fault.vllm_copier(), lengths=fault.vllm_lengths())
    scheduler = scheduler_of(llm)
    scheduler.reconfigure(scheduler.vtoken_settings, table_factory=fault.vllm_table_factory())


def _check_run(llm, scenario: str, run: Run, requests: Sequence[Request], fault: Fault,
               progress: Progress | None) -> RunCheck:
    """Replay `requests` with every check on; the checks run and the violation that stopped it."""
    from vtoken.engine.vllm.engine import model_runner_of, scheduler_of
    from vtoken.engine.vllm.run import replay

    started = time.perf_counter()
    experiment = run.experiment
    runner = model_runner_of(llm)
    runner_checks_before = Counter(runner.vtoken_num_checks or {})
    num_injected_before = fault.num_injected
    num_done = [0]

    def on_done(n: int) -> None:
        num_done[0] += n
        if progress is not None:
            progress(f"{scenario} {experiment.eviction.policy}/{experiment.reclaim.mode}", n)

    violation = None
    try:
        replay(llm, run, requests, on_done, check_invariants=True)
    except InvariantError as exc:
        violation = Violation(exc.invariant, str(exc), scenario, experiment.eviction.policy, experiment.reclaim.mode,
                              block_id=exc.where.get("block_id"), offset=exc.where.get("offset"))
    if progress is not None and num_done[0] < num_output_tokens(requests):  # skipped or stopped early
        progress(scenario, num_output_tokens(requests) - num_done[0])
    tracker = scheduler_of(llm).vtoken  # replay() reconfigured the scheduler: this run's tracker
    num_checks = Counter(tracker.num_checks) + (Counter(runner.vtoken_num_checks or {}) - runner_checks_before)
    tallies = {name: Tally(num_checks.get(name, 0), int(violation is not None and violation.invariant == name),
                           violation if violation is not None and violation.invariant == name else None)
               for name in INVARIANTS}
    counters = tracker.counters
    return RunCheck(
        scenario=scenario, policy=experiment.eviction.policy, reclaim_mode=experiment.reclaim.mode,
        block_size=experiment.block_size, num_blocks=experiment.num_blocks, num_requests=len(requests),
        num_completed=num_done[0], relocation_events=counters.relocation_events, tokens_moved=counters.tokens_moved,
        preemptions=counters.preemptions, faults_injected=fault.num_injected - num_injected_before,
        stopped=None if violation is None else f"stopped after an {violation.invariant} violation raised inside vLLM's step",
        tallies=tallies, elapsed_s=time.perf_counter() - started,
    )


def _name(trace: Trace) -> str:
    return trace.source.replace("\\", "/").rsplit("/", 1)[-1]

