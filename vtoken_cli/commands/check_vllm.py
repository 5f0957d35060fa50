"""`vtoken check-invariants --executor vllm`: the checks run inside vLLM's scheduler and worker
(vtoken.engine.vllm.run.check_invariants_on_vllm); this module cuts the trace down, injects a
fault where asked, and prints render/check.py's `vllm_check_report` or the `--json` object."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from vtoken import defaults
from vtoken.checker_names import FAULT_DETECTED_BY, INVARIANT_NAMES, TraceLimits
from vtoken.engine.vllm.run import VllmCheckReport
from vtoken.errors import ConfigError
from vtoken.trace import load_trace
from vtoken_cli.commands.check import parse_policies
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import build_run_config, require_vllm
from vtoken_cli.output import progress_bar
from vtoken_cli.render.check import VLLM_INVARIANTS, VLLM_NO_I4, vllm_check_report

if TYPE_CHECKING:
    from vtoken.checker import Fault

VLLM_LIMITS = TraceLimits(max_requests=6, max_prompt_tokens=192, max_output_tokens=48)


def check_on_vllm(trace, model, policy, budget, eviction_interval, theta_f, concurrency, seed, num_blocks,
                   block_size, max_requests, json_out, fault_kind: str | None = None) -> None:
    """`--executor vllm`: naive-evict and vtoken, both modes, every check on inside vLLM's
    scheduler and worker, optionally with a fault injected there; exit 1 on a violation."""
    fault = _vllm_fault(fault_kind)
    require_vllm()
    if model is None or not (Path(model).expanduser() / "config.json").is_file():
        raise ConfigError(f"--executor vllm needs --model, a local model folder with a config.json, got {model!r}")
    from vtoken.checker import bundled_sample_traces, scale_requests
    from vtoken.engine.vllm.run import check_invariants_on_vllm

    path = trace or next(p for p in bundled_sample_traces() if p.name == defaults.SAMPLE_TRACE)
    loaded = load_trace(path)
    limits = replace(VLLM_LIMITS, max_requests=max_requests or VLLM_LIMITS.max_requests)
    requests, cut = scale_requests(loaded.requests, limits)
    loaded = replace(loaded, requests=requests)
    config = build_run_config(
        model=str(Path(model).expanduser() / "config.json"), gpu=defaults.GPU, num_blocks=num_blocks,
        gpu_mem_util=defaults.GPU_MEMORY_UTILIZATION, block_size=block_size or defaults.VLLM_BLOCK_SIZE,
        policy=parse_policies(policy)[0], budget=budget, eviction_interval=eviction_interval,
        reclaim_mode=defaults.RECLAIM_MODE, theta_f=theta_f, concurrency=concurrency,
        seed=seed, sim_profile=None,
    )
    with progress_bar(stderr, 40) as bar:
        task = bar.add_task("checking on vLLM", total=4 * len(requests))
        report = check_invariants_on_vllm(loaded, config, model, num_blocks,
                                          lambda stage, n: bar.update(task, advance=n, description=stage), fault=fault)
    notes = [cut] if cut else []
    if json_out:
        typer.echo(json.dumps(_vllm_payload(report, path, config.eviction.policy, notes), indent=2))
    else:
        stdout.print(vllm_check_report(report, Path(path).name, config.eviction.policy, notes), soft_wrap=False)
    if not report.passed:
        raise typer.Exit(1)


def _vllm_fault(kind: str | None) -> Fault | None:
    """The fault to inject into vLLM, or None; ConfigError for one that cannot go there."""
    if kind is None:
        return None
    from vtoken.checker import make_fault

    fault = make_fault(kind)
    if fault.vllm_refusal:
        raise ConfigError(f"--inject-fault {kind} cannot run on --executor vllm: {fault.vllm_refusal}")
    return fault


def _vllm_payload(report: VllmCheckReport, path: Path, policy: str, notes: list[str]) -> dict:
    """The `--json` object of `--executor vllm`."""
    violation = report.violation
    return {
        "executor": "vllm", "passed": report.passed, "trace": str(path), "policy": policy,
        "notes": notes + [VLLM_NO_I4],
        "evictions_checked": report.num_evictions_checked, "copies_verified": report.num_copies_verified,
        "elapsed_s": report.elapsed_s,
        "invariants": {name: {
            "name": INVARIANT_NAMES[name], "checked": report.num_checks.get(name, 0),
            "violations": int(violation is not None and violation.invariant == name),
            "first_violation": vars(violation).copy() if violation is not None and violation.invariant == name else None,
        } for name in VLLM_INVARIANTS},
        "stopped": None if violation is None else f"after {violation.invariant} in {violation.run}",
        "fault": None if report.fault is None else {
            "kind": report.fault, "expected_invariant": FAULT_DETECTED_BY[report.fault],
            "num_injected": report.num_faults_injected,
        },
        "runs": report.runs,
    }
