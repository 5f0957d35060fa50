"""What `vtoken audit URL --watch` prints: the view refreshed in place on a terminal
(`watch_view`), one plain line per replica and interval elsewhere (`watch_lines`), and the
summary after Ctrl-C (`watch_summary`)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from vtoken.audit.watch import ReplicaSummary, ReplicaTick, WatchSummary, WatchTick
from vtoken_cli.render.common import figure_table, histograms, titled

_COLUMNS = (("KV", "KV usage"), ("run", "running"), ("wait", "waiting"), ("preempt", "preemptions (+ interval)"),
            ("prompt tok/s", "prompt tokens/s"), ("gen tok/s", "generation tokens/s"), ("prefix hit", "prefix-cache hit"))
_VTOKEN_COLUMNS = (("F", "F now"), ("F interval", "F over the interval"), ("moved", "tokens moved (/s)"),
                   ("reclaimed", "blocks reclaimed (/s)"))


def watch_view(tick: WatchTick, interval_s: float) -> Group:
    """Every replica's row, its vToken figures when it runs vToken, and its utilization histogram."""
    rows = {r.url: _cells(r) for r in tick.replicas}
    is_vtoken = any(r.vtoken is not None for r in tick.replicas)
    columns = _COLUMNS + (_VTOKEN_COLUMNS if is_vtoken else ())
    parts: list[RenderableType] = [titled(
        f"vtoken audit --watch: {len(tick.replicas)} replica{'s' if len(tick.replicas) > 1 else ''}, "
        f"every {interval_s:g} s, {tick.elapsed_s:.0f} s so far (Ctrl-C: summary and exit)",
        figure_table("replica", columns, {url: cells[:len(columns)] for url, cells in rows.items()}),
        "rates over the interval since each replica's previous answer (counter deltas)")]
    for r in tick.replicas:
        if not r.is_up:
            parts.append(Text(f"{r.url}: not answering: {r.error}", style="bold red"))
        parts += [Text(f"{r.url}: {note}", style="yellow") for note in r.notes]
    named = [(r.url, r.vtoken.utilization_histogram) for r in tick.replicas
             if r.vtoken is not None and r.vtoken.utilization_histogram is not None]
    if named:
        parts.append(histograms(named, "block utilization u = live / S, share of allocated blocks (as the server reports it)"))
    elif is_vtoken:
        parts.append(Text("utilization histogram: not exported by this server (no vtoken_block_utilization_blocks)",
                          style="dim"))
    return Group(*parts)


def watch_lines(tick: WatchTick) -> list[str]:
    """One plain line per replica: `t=12s URL KV 41.0% run 3 wait 0 ...` (or `down: why`)."""
    lines = []
    for r in tick.replicas:
        head = f"t={tick.elapsed_s:.0f}s {r.url}"
        if not r.is_up:
            lines.append(f"{head} down: {r.error}")
            continue
        labels = [label.split(" (")[0] for _, label in _COLUMNS + (_VTOKEN_COLUMNS if r.vtoken else ())]
        cells = [c.replace("\n", " ") for c in _cells(r)]
        line = f"{head} " + " ".join(f"{label} {cell}" for label, cell in zip(labels, cells))
        if r.vtoken is not None and r.vtoken.utilization_histogram is not None:
            line += " u-histogram " + ",".join(f"{100 * v:.0f}" for v in r.vtoken.utilization_histogram)
        lines.append(line + "".join(f" [{note}]" for note in r.notes))
    return lines


def watch_summary(summary: WatchSummary) -> Group:
    rows = {r.url: _summary_cells(r) for r in summary.replicas}
    is_vtoken = any(r.num_tokens_moved is not None for r in summary.replicas)
    columns = [("answered", "ticks answered"), ("up at end", "up at the end"), ("prompt tok", "prompt tokens"),
               ("prompt tok/s", "prompt tokens/s"), ("gen tok", "generation tokens"), ("gen tok/s", "generation tokens/s"),
               ("preempt", "preemptions"), ("prefix hit", "prefix-cache hit"), ("peak KV", "peak KV usage"),
               ("max run", "max running"), ("max wait", "max waiting"), ("resets", "counter resets")]
    if is_vtoken:
        columns += [("F", "F over the watch"), ("moved", "tokens moved"), ("reclaimed", "blocks reclaimed")]
    table = figure_table("replica", columns, {url: cells[:len(columns)] for url, cells in rows.items()})
    parts: list[RenderableType] = [titled(
        f"Watch summary: {summary.num_ticks} ticks over {summary.elapsed_s:.1f} s",
        table, "token counts: sums of the counter deltas of every interval (a reset loses nothing seen before it)")]
    parts += [Text(f"{r.url}: last answer failed: {r.last_error}", style="red") for r in summary.replicas
              if r.last_error is not None]
    return Group(*parts)


def summary_lines(summary: WatchSummary) -> list[str]:
    lines = [f"watch summary: {summary.num_ticks} ticks over {summary.elapsed_s:.1f} s"]
    for r in summary.replicas:
        lines.append(f"{r.url}: answered {r.num_answered}/{r.num_ticks}, prompt {r.num_prompt_tokens:,.0f} tokens "
                     f"({_rate(r.prompt_tokens_per_s)}/s), generation {r.num_generation_tokens:,.0f} tokens "
                     f"({_rate(r.generation_tokens_per_s)}/s), {r.num_preemptions:g} preemptions, "
                     f"peak KV {_percent(r.peak_kv_cache_usage)}, {r.num_resets} counter resets"
                     + (f", F {_fraction(r.waste_ratio)}, {r.num_tokens_moved:,.0f} tokens moved, "
                        f"{r.num_blocks_reclaimed:,.0f} blocks reclaimed" if r.num_tokens_moved is not None else "")
                     + ("" if r.is_up_at_end else f", down at the end: {r.last_error}"))
    return lines


def _cells(r: ReplicaTick) -> list[str]:
    if not r.is_up:
        return ["down"] + [""] * (len(_COLUMNS) + len(_VTOKEN_COLUMNS) - 1)
    preempt = _count(r.num_preemptions)
    if r.num_preemptions_in_interval:
        preempt += f" (+{r.num_preemptions_in_interval:g})"
    cells = [_percent(r.kv_cache_usage), _count(r.num_requests_running), _count(r.num_requests_waiting), preempt,
             _rate(r.prompt_tokens_per_s), _rate(r.generation_tokens_per_s), _percent(r.prefix_cache_hit_ratio)]
    v = r.vtoken
    if v is None:
        return cells + ["-"] * len(_VTOKEN_COLUMNS)
    return cells + [_fraction(v.waste_ratio), _fraction(v.waste_ratio_interval),
                    f"{v.num_tokens_moved:,.0f} ({_rate(v.tokens_moved_per_s)})",
                    f"{v.num_blocks_reclaimed:,.0f} ({_rate(v.blocks_reclaimed_per_s)})"]


def _summary_cells(r: ReplicaSummary) -> list[str]:
    return [f"{r.num_answered}/{r.num_ticks}", "yes" if r.is_up_at_end else "no", f"{r.num_prompt_tokens:,.0f}",
            _rate(r.prompt_tokens_per_s), f"{r.num_generation_tokens:,.0f}", _rate(r.generation_tokens_per_s),
            f"{r.num_preemptions:g}", _percent(r.prefix_cache_hit_ratio), _percent(r.peak_kv_cache_usage),
            _count(r.max_requests_running), _count(r.max_requests_waiting), str(r.num_resets),
            _fraction(r.waste_ratio), _count(r.num_tokens_moved), _count(r.num_blocks_reclaimed)]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
