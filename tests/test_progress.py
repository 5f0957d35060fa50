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
from vtoken.runners import ProcessRunner, ReplayJob, ReplayProgress
from vtoken.sweep import SweepOptions, Vary, sweep
from vtoken.sweep import num_progress_units as sweep_units
from vtoken.trace import load_trace, num_output_tokens
from vtoken_cli.output import PlainProgress

from test_checker import ONE, make_base
from test_replayers import make_experiment, make_run

SAMPLE = Path(__file__).resolve().parent.parent / "sample_traces" / "azure_conv_sample.csv"


def test_compare_reports_exactly_its_announced_tokens_as_replays_run() -> None:
    trace = load_trace(SAMPLE, max_requests=12)
    options, replayer, seen = CompareOptions((2, 4), concurrency=4), SimReplayer(), []
    compare(trace, make_experiment(num_blocks=600), options, replayer, lambda s, n: seen.append((s, n)),
            num_blocks=600)
    assert sum(n for _, n in seen) == compare_units(trace, options, replayer) > len(trace.requests) * 3 * 10
    # a serial replay reports its tokens as its steps complete, not once at its end
    vtoken_reports = [n for stage, n in seen if stage == "vtoken"]
    assert len(vtoken_reports) > 10 and sum(vtoken_reports) == num_output_tokens(trace.requests)


def test_worker_processes_stream_their_tokens_and_report_exactly_the_total() -> None:
    trace = load_trace(SAMPLE, max_requests=12)
    options, seen = CompareOptions((2, 4), concurrency=4, with_frontier=False), []
    replayer = SimReplayer(runner=ProcessRunner(2))
    compare(trace, make_experiment(num_blocks=600), options, replayer, lambda s, n: seen.append(n), num_blocks=600)
    assert sum(seen) == compare_units(trace, options, replayer)
    assert all(n > 0 for n in seen)


def test_sweep_reports_tokens_not_points() -> None:
    trace = load_trace(SAMPLE, max_requests=8)
    base, options, seen = make_run(), SweepOptions((Vary("theta_f", (0.05, 0.25)),)), []
    sweep(trace, base, options, SimReplayer(), lambda s, n: seen.append(n), num_blocks=600)
    assert sum(seen) == sweep_units(trace, base, options) == 2 * 3 * num_output_tokens(trace.requests)


def test_a_reused_replay_reports_all_its_tokens_when_done() -> None:
    trace = load_trace(SAMPLE, max_requests=4)
    job = ReplayJob(make_run(), trace.requests)
    seen = []
    tracker = ReplayProgress(lambda s, n: seen.append((s, n)), [job, job], lambda idx: f"job {idx}")
    SimReplayer().run_many([job, job], tracker.on_done, tracker.on_tokens)
    total = num_output_tokens(trace.requests)
    assert sum(n for s, n in seen if s == "job 0") == sum(n for s, n in seen if s == "job 1") == total
    assert [n for s, n in seen if s == "job 1"] == [total]  # the duplicate is reused, not replayed


def test_a_streamed_report_does_not_hash_its_job(monkeypatch) -> None:
    """A replay in this process reports its tokens at every step: the index a report goes to is
    looked up once, not by the job, whose hash walks every request (a lookup at every report
    made the quick start in one process take 1.8x as long)."""
    job = ReplayJob(make_run(), load_trace(SAMPLE, max_requests=12).requests)
    num_hashes, job_hash = [0], ReplayJob.__hash__

    def counted_hash(self: ReplayJob) -> int:
        num_hashes[0] += 1
        return job_hash(self)

    monkeypatch.setattr(ReplayJob, "__hash__", counted_hash)
    reports = []
    SimReplayer().run_many([job], None, lambda idx, n: reports.append((idx, n)))
    assert len(reports) > 100 and {idx for idx, _ in reports} == {0}
    assert num_hashes[0] < 10


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
