"""`vtoken serve MODEL`: a vToken-enabled OpenAI-compatible vLLM server."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vtoken import defaults
from vtoken.engine.experiment import VARIANTS
from vtoken.engine.vllm.serve import ServeOptions, run_server, serve_command, shell_line
from vtoken.engine.vllm.settings import CONFIG_KEY, PREFIX_PROTECTIONS, settings_from_additional_config
from vtoken.errors import ConfigError
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import (
    Budget, EvictionInterval, Policy, ReclaimMode, ThetaF, check_positive, check_serve_flags, resolve_policies,
)


def serve_command_line(
    model: Annotated[str, typer.Argument(help="Model folder or Hugging Face name vLLM can load.", metavar="MODEL")],
    variant: Annotated[str, typer.Option(help=f"Variant: {', '.join(VARIANTS)}.")] = defaults.VARIANT,
    policy: Policy = defaults.VLLM_POLICY,
    budget: Budget = defaults.BUDGET,
    sink_tokens: Annotated[int, typer.Option(help="Protected first tokens.")] = defaults.NUM_SINK_TOKENS,
    recent_tokens: Annotated[int, typer.Option(help="Protected most recent tokens.")] = defaults.NUM_RECENT_TOKENS,
    eviction_interval: EvictionInterval = defaults.EVICTION_INTERVAL_TOKENS,
    reclaim_mode: ReclaimMode = defaults.RECLAIM_MODE,
    theta_f: ThetaF = defaults.THETA_F,
    prefix_protection: Annotated[str, typer.Option(
        help="With vLLM's prefix caching: 'prompt' keeps a request's full prompt blocks (a hit and a miss give "
             "the same outputs), 'shared' only the blocks another request holds.")] = PREFIX_PROTECTIONS[0],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = defaults.SERVE_HOST,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = defaults.SERVE_PORT,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block (a multiple of 32 on CPU).")] = defaults.VLLM_BLOCK_SIZE,
    kv_cache_bytes: Annotated[Optional[int], typer.Option(
        help="KV cache size in bytes (vLLM's --kv-cache-memory-bytes).")] = defaults.SERVE_KV_CACHE_BYTES,
    num_blocks: Annotated[Optional[int], typer.Option(help="KV blocks (vLLM's --num-gpu-blocks-override).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest sequence in tokens.")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="Most requests running at once.")] = None,
    dtype: Annotated[str, typer.Option(help="Model dtype (float32 for exact comparisons).")] = defaults.SERVE_DTYPE,
    vllm_arg: Annotated[Optional[list[str]], typer.Option("--vllm-arg", help="Extra argument for the vLLM server (repeatable).")] = None,
    print_command: Annotated[bool, typer.Option(help="Print the server command line and exit.")] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server on MODEL with vToken's scheduler and worker. Its
    /metrics carries vtoken_* metrics (waste ratio, live tokens, blocks reclaimed, tokens moved,
    ...), which `vtoken audit URL` reads.

    \b
    Examples
      vtoken serve smollm2-135m --print-command
      vtoken serve /models/llama-3.1-8b --policy h2o --budget 50% --port 8000

    \b
    Exit codes
      0  the server stopped cleanly, or --print-command
      2  bad input
      *  otherwise the vLLM server's own exit code
    """
    check_serve_flags(variant=variant, budget=budget, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                      theta_f=theta_f)
    check_positive({"--kv-cache-bytes": kv_cache_bytes, "--num-blocks": num_blocks, "--max-model-len": max_model_len,
                    "--max-num-seqs": max_num_seqs})
    if prefix_protection not in PREFIX_PROTECTIONS:
        raise ConfigError(f"--prefix-protection: unknown value '{prefix_protection}'; choose one of: "
                          f"{', '.join(PREFIX_PROTECTIONS)}")
    settings = settings_from_additional_config({CONFIG_KEY: {
        "variant": variant, "policy": resolve_policies([policy])[0], "budget": budget, "num_sink_tokens": sink_tokens,
        "num_recent_tokens": recent_tokens, "interval_tokens": eviction_interval,
        "reclaim_mode": reclaim_mode, "theta_f": theta_f, "prefix_protection": prefix_protection,
    }})
    options = ServeOptions(model, settings, host, port, block_size, kv_cache_bytes, num_blocks, max_model_len,
                           max_num_seqs, dtype, extra_args=tuple(vllm_arg or ()))
    if print_command:
        stdout.print(shell_line(serve_command(options)), highlight=False, markup=False, soft_wrap=True)
        return
    code = run_server(options, on_start=lambda argv: stderr.print(
        f"vtoken serve: {variant} / {policy} on http://{host}:{port}", highlight=False, markup=False))
    if code:
        raise typer.Exit(code)
