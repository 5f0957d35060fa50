"""`vtoken audit DEPLOYMENT [DEPLOYMENT ...]`: the KV memory token-level eviction would trap on a
deployment (a TOML file or a running vLLM server; several for several replicas), per policy, and
what vToken would recover.

The command parses flags into `Overrides`, calls `vtoken.audit.audit_deployment` and prints
render/audit.py's report: one replica (the usual case) as before, several each and in total. A
flag left out takes the TOML's or the server's value, else the default of vtoken/defaults.py
(the library resolves them). `--watch` replays nothing: audit_watch.py shows the servers' live
load until Ctrl-C.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from vtoken import defaults
from vtoken.audit import (
    DEFAULT_TIMEOUT_S, AuditReport, DeploymentAudit, Overrides, audit_deployment, deployment_to_json, report_rows,
    report_to_json,
)
from vtoken.errors import ConfigError
from vtoken.measured import require_measured_audit
from vtoken.policies import DEFAULT_AUDIT_POLICIES
from vtoken.runners import make_runner
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import (
    GPU_NAMES, MODEL_NAMES, POLICY_NAMES, TRACE_FORMAT_NAMES, CacheDir, Force, JsonOut, MaxRequests, NoCache, Output,
    RayAddress, TimeUnit, Workers,
    build_cache, check_flags, resolve_policies,
)
from vtoken_cli.output import check_output_dir, json_writer, progress_bar, write_output_dir
from vtoken_cli.commands.audit_watch import watch_command
from vtoken_cli.render.audit import audit_report, deployment_report


def audit_command(
    deployments: Annotated[list[str], typer.Argument(
        help="A deployment TOML file, or the http(s):// URL of a running vLLM server; several URLs for several "
             "replicas (a server's data-parallel engines are replicas too).", metavar="DEPLOYMENT",
        show_default=False)],
    model: Annotated[Optional[str], typer.Option(
        help=f"Catalog model ({MODEL_NAMES}, or an HF id); supplies or replaces the deployment's.")] = None,
    model_config: Annotated[Optional[Path], typer.Option(help="An HF config.json giving the model's KV geometry.")] = None,
    gpu: Annotated[Optional[str], typer.Option(
        help=f"Catalog GPU of the cost model (step times): {GPU_NAMES}. Default {defaults.GPU}.")] = None,
    block_size: Annotated[Optional[int], typer.Option(
        help=f"Tokens per KV block (replaces the server's or the TOML's). Default {defaults.BLOCK_SIZE}.")] = None,
    num_blocks: Annotated[Optional[int], typer.Option(help="KV block budget (replaces the server's or the TOML's).")] = None,
    policy: Annotated[Optional[list[str]], typer.Option(
        help=f"Policy to audit, repeatable: {POLICY_NAMES}. Default: {', '.join(DEFAULT_AUDIT_POLICIES)}.")] = None,
    budget: Annotated[Optional[str], typer.Option(
        help=f"Tokens each request keeps: '50%', '0.5' or '512'. Default {defaults.BUDGET}.")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="Workload trace. Default: the TOML's, else the bundled Azure sample.")] = None,
    trace_format: Annotated[Optional[str], typer.Option("--format", help=f"Trace format: {TRACE_FORMAT_NAMES}.")] = None,
    time_unit: TimeUnit = None,
    max_requests: MaxRequests = None,
    concurrency: Annotated[Optional[int], typer.Option(help=f"Closed-loop clients. Default {defaults.CONCURRENCY}.")] = None,
    frontier_max: Annotated[Optional[int], typer.Option(
        help=f"Largest concurrency the capacity search tries. Default {defaults.FRONTIER_MAX_CONCURRENCY}.")] = None,
    timeout: Annotated[Optional[float], typer.Option(
        help=f"Seconds the server scrape may take. Default {DEFAULT_TIMEOUT_S:g}.")] = None,
    window: Annotated[Optional[float], typer.Option(
        help="Scrape the server twice this many seconds apart: its request rate and concurrency over that window.",
        metavar="SECONDS")] = None,
    seed: Annotated[Optional[int], typer.Option(
        help=f"Seed of the synthetic attention and the random policy. Default {defaults.SEED}.")] = None,
    watch: Annotated[bool, typer.Option(
        "--watch", help="Show the servers' live load (and vToken's figures on a vToken server) refreshed in place "
                        "until Ctrl-C, then a summary; replays nothing.")] = False,
    interval: Annotated[float, typer.Option(
        help="Seconds between two refreshes of --watch.", metavar="SECONDS")] = defaults.WATCH_INTERVAL_S,
    json_out: JsonOut = False,
    output: Output = None,
    force: Force = False,
    workers: Workers = None,
    ray: RayAddress = None,
    cache_dir: CacheDir = None,
    no_cache: NoCache = False,
) -> None:
    """Audit DEPLOYMENT: replay its workload (for a server, what it has served) on its KV block
    budget with naive eviction and with vToken, per policy, and report the waste, the trapped
    memory and what vToken recovers.

    \b
    Examples
      vtoken audit deployment.toml
      vtoken audit http://10.0.0.5:8000 http://10.0.0.6:8000 --window 30
      vtoken audit http://10.0.0.5:8000 --watch --interval 5

    \b
    Exit codes
      0  the audit ran (--watch: stopped with Ctrl-C)
      2  bad input (the TOML, a flag, a server that does not answer or does not
         say what the audit needs) or nothing measured

    \b
    Deployment TOML (unknown sections and keys are errors; paths are
    relative to the file; a flag replaces the file's value)
      [model]      name = "llama-3.1-8b"     a catalog model or an HF id, or
                   config = "config.json"    an HF config.json, or num_layers,
                                             num_kv_heads, head_dim (+ num_atten-
                                             tion_heads, hidden_size, num_params);
                   dtype = "bf16"            the KV cache dtype
      [engine]     block_size = 16           tokens per KV block
                   num_gpu_blocks = 4096     the KV budget, or gpu = "h100" and
                                             gpu_memory_utilization = 0.9
      [eviction]   policies = ["h2o"]        default: h2o, streaming_llm,
                                             scissorhands, random
                   budget = "50%"            kept per request: "50%", 0.5 or 512
                   interval_tokens = 32      evict every N generated tokens
      [workload]   trace = "trace.jsonl"     default: the bundled Azure sample;
                                             also format, time_unit, max_requests
                   concurrency = 16          closed-loop clients
                   frontier_max_concurrency = 64   largest C the search tries
      [endpoint]   url = "http://host:8000"  read the live server too: it gives
                                             what [model] and [engine] leave out,
                                             the workload when no trace is named
                   timeout_s = 5             seconds a scrape may take
                   window_s = 30             scrape twice this far apart: the rate
    """
    if model is not None and model_config is not None:
        raise ConfigError("give --model or --model-config, not both")
    if watch:
        watch_command(deployments, interval, timeout or DEFAULT_TIMEOUT_S,
                      {"--json": json_out, "--output": output is not None, "--window": window is not None})
        return
    check_flags(seed=seed, num_blocks=num_blocks, budget=budget)
    if output is not None:
        check_output_dir(output, force)
    overrides = Overrides(
        model=str(model_config) if model_config is not None else model, gpu=gpu, block_size=block_size,
        num_gpu_blocks=num_blocks, policies=resolve_policies(policy) if policy else None, budget=budget, trace=trace,
        trace_format=trace_format, time_unit=time_unit, max_requests=max_requests, concurrency=concurrency,
        frontier_max_concurrency=frontier_max, timeout_s=timeout, window_s=window, seed=seed,
    )
    runner = make_runner(workers, ray)  # closed, its worker processes ended, after the replays
    with runner, progress_bar(stderr, 26, "audit") as bar:
        task = bar.add_task("reading the deployment", total=None)
        result = audit_deployment(deployments, overrides, lambda stage, done, total: bar.update(
            task, completed=done, total=total, description=stage), runner, build_cache(cache_dir, no_cache))
    require_measured_audit(result)
    is_one = len(result.replicas) == 1 and not result.failures
    payload = report_to_json(result.replicas[0]) if is_one else deployment_to_json(result)
    if output is not None:
        write_output_dir(output, _writers(result, payload), force)
    if json_out:
        typer.echo(json.dumps(payload, indent=2))
    else:
        stdout.print(audit_report(result.replicas[0]) if is_one else deployment_report(result), soft_wrap=False)


# ---- --output -----------------------------------------------------------------------------------


def _writers(result: DeploymentAudit, payload: dict) -> list:
    """report.json; policies.csv (a `replica` column when there are several); one histogram per
    policy (and replica: histogram_<replica #>_<policy>.png)."""
    reports: list[AuditReport] = list(result.replicas)
    is_one = len(reports) == 1

    def write_csv(d: Path) -> None:
        import pandas as pd

        rows = [row if is_one else {"replica": r.deployment.source, **row} for r in reports for row in report_rows(r)]
        pd.DataFrame(rows).to_csv(d / "policies.csv", index=False)

    def write_plots(d: Path) -> None:
        from vtoken_cli import plots  # matplotlib: imported when a plot is drawn, not at start-up

        for idx, report in enumerate(reports):
            for p in report.policies:
                name = f"histogram_{p.policy}.png" if is_one else f"histogram_{idx}_{p.policy}.png"
                plots.plot_policy_histogram(report, p, d / name)

    return [json_writer(payload), write_csv, write_plots]
