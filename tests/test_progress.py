"""Progress follows the work: the units a command's progress callback reports sum to the total
it announces (generated tokens), and a non-terminal stderr gets at most one line an interval."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from vtoken.checker import check_invariants
from vtoken.checker import num_progress_units as check_units
from vtoken.compare import CompareOptions, compare
from vtoken.compare import num_progress_units as compare_units
from vtoken.replay import SimReplayer
from vtoken.trace import load_trace
from vtoken_cli.output import PlainProgress

from test_checker import ONE, make_base
from test_replayers import make_config

SAMPLE = Path(__file__).resolve().parent.parent / "sample_traces" / "azure_conv_sample.csv"


def test_compare_reports_exactly_its_announced_tokens() -> None:
    trace = load_trace(SAMPLE, max_requests=12)
    options, replayer, seen = CompareOptions((2, 4)), SimReplayer(), []
    compare(trace, make_config(num_blocks=600, concurrency=4), options, replayer, lambda s, n: seen.append(n),
            num_blocks=600)
    assert sum(seen) == compare_units(trace, options, replayer) > len(trace.requests) * 3 * 10


def test_check_invariants_reports_exactly_its_announced_tokens() -> None:
    traces, seen = [load_trace(SAMPLE, max_requests=6)], []
    check_invariants(traces, make_base(), ONE, lambda s, n: seen.append(n))
    assert sum(seen) == check_units(traces, make_base(), ONE)
    assert len(seen) > 1  # steps report as they complete


def test_the_plain_reporter_prints_at_most_one_line_per_interval() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = PlainProgress(Console(file=out, width=200), "compare", 10.0, clock=lambda: now[0])
    task = bar.add_task("replaying", total=1_200_000)
    for step_s in (1, 3, 9.9, 10, 12, 19, 20.5, 40):
        now[0] = step_s
        bar.update(task, advance=100_000)
    lines = out.getvalue().splitlines()
    assert lines == ["compare: 33% of 1.2M tokens, 10 s elapsed, about 20 s left",
                     "compare: 58% of 1.2M tokens, 20 s elapsed, about 15 s left",
                     "compare: 67% of 1.2M tokens, 40 s elapsed, about 20 s left"]
