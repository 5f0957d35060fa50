"""`vtoken serve MODEL`: a vToken-enabled OpenAI-compatible vLLM server."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vtoken.engine.config import VARIANTS
from vtoken.engine.vllm.serve import ServeOptions, run_server, serve_command, shell_line
from vtoken.engine.vllm.settings import CONFIG_KEY, settings_from_additional_config
from vtoken.kv.reclaim import RECLAIM_MODES
from vtoken.policies import POLICIES
from vtoken_cli.app import command, stderr, stdout


@command("serve")
def serve_command_line(
    model: Annotated[str, typer.Argument(help="Model folder or Hugging Face name vLLM can load.")],
    variant: Annotated[str, typer.Option(help=f"Variant: {', '.join(VARIANTS)}.")] = "vtoken",
    policy: Annotated[str, typer.Option(help=f"Eviction policy: {', '.join(POLICIES)}.")] = "streaming_llm",
    budget: Annotated[str, typer.Option(help="Tokens each request keeps: a ratio ('50%', '0.5') or a count ('512').")] = "50%",
    sink_tokens: Annotated[int, typer.Option(help="Protected first tokens.")] = 4,
    recent_tokens: Annotated[int, typer.Option(help="Protected most recent tokens.")] = 64,
    eviction_interval: Annotated[int, typer.Option(help="Run the policy after prefill and every N generated tokens.")] = 32,
    reclaim_mode: Annotated[str, typer.Option(help=f"Compaction: {', '.join(RECLAIM_MODES)}.")] = "hole-fill",
    theta_f: Annotated[float, typer.Option("--theta-f", help="Hand emptied blocks back when the waste ratio F is at least this.")] = 0.25,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block (a multiple of 32 on CPU).")] = 32,
    kv_cache_bytes: Annotated[Optional[int], typer.Option(help="KV cache size in bytes (vLLM's --kv-cache-memory-bytes).")] = 1 << 30,
    num_blocks: Annotated[Optional[int], typer.Option(help="KV blocks (vLLM's --num-gpu-blocks-override).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest sequence in tokens.")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="Most requests running at once.")] = None,
    dtype: Annotated[str, typer.Option(help="Model dtype (float32 for exact comparisons).")] = "auto",
    vllm_arg: Annotated[Optional[list[str]], typer.Option("--vllm-arg", help="Extra argument for the vLLM server (repeatable).")] = None,
    print_command: Annotated[bool, typer.Option(help="Print the server command line and exit.")] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with vToken's scheduler and worker. Its /metrics
    carries vtoken_* metrics (waste ratio, live tokens, blocks reclaimed, tokens moved, ...),
    which `vtoken audit URL` reads."""
    settings = settings_from_additional_config({CONFIG_KEY: {
        "variant": variant, "policy": policy, "budget": budget, "num_sink_tokens": sink_tokens,
        "num_recent_tokens": recent_tokens, "interval_tokens": eviction_interval,
        "reclaim_mode": reclaim_mode, "theta_f": theta_f,
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
