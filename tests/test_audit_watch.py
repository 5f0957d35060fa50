"""`vtoken audit URL --watch`: ticks from counter deltas, resets, replicas that stop answering,
vToken's figures, the plain lines of a non-terminal, and a clean exit on SIGINT (subprocess,
on a pipe and on a pseudo-terminal)."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fakeserver import Computed, serve
from fakevllm import Served, metrics_text, routes
from typer.testing import CliRunner

import vtoken.audit.watch as watch_module
from vtoken.audit.watch import Watch, replica_tick
from vtoken.endpoint import LiveState, parse_metrics
from vtoken.errors import EndpointError
from vtoken_cli.app import app

REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 32  # the fixture's vllm:cache_config_info
WAIT_S = 120  # how long a subprocess may take to print what the test waits for (start-up under load)


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def live(served: Served, at_s: float, url: str = "http://h") -> LiveState:
    cache, metrics = parse_metrics(metrics_text({"0": served}), f"{url}/metrics")
    return LiveState(url, "tiny-llama", 4096, cache, metrics, (), scraped_at_s=at_s)


def load(num_prompt_tokens: int, num_generation_tokens: int, **kwargs) -> Served:
    """An engine whose token counters stand at these values (one finished request holds them)."""
    return Served([num_prompt_tokens], [num_generation_tokens], **kwargs)


def vtoken_series(moved: float, reclaimed: float, live_s: float, allocated_s: float, live_tokens: float = 48,
                  blocks: float = 4, histogram: tuple[int, ...] | None = None) -> dict[str, float]:
    series = {"vtoken_tokens_moved_total": moved, "vtoken_blocks_reclaimed_total": reclaimed,
              "vtoken_live_token_seconds_total": live_s, "vtoken_allocated_token_seconds_total": allocated_s,
              "vtoken_live_tokens": live_tokens, "vtoken_allocated_blocks": blocks}
    for idx, num_blocks in enumerate(histogram or ()):
        series[f'vtoken_block_utilization_blocks{{bin="{idx}"}}'] = num_blocks
    return series


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


# ---- ticks ---------------------------------------------------------------------------------------


def test_rates_are_counter_deltas_over_the_interval_and_gauges_as_scraped() -> None:
    before = live(load(1_000, 200, num_prefix_queries=400, num_prefix_hits=100), 10.0)
    now = live(load(3_000, 700, num_prefix_queries=1_400, num_prefix_hits=600, num_running=3, num_waiting=1,
                    kv_cache_usage=0.25, num_preemptions=2), 14.0)

    tick = replica_tick(now, before)
    assert tick.interval_s == 4.0
    assert tick.prompt_tokens_per_s == 2_000 / 4 and tick.generation_tokens_per_s == 500 / 4
    assert tick.prefix_cache_hit_ratio == 500 / 1_000  # of the tokens queried in the interval
    assert (tick.kv_cache_usage, tick.num_requests_running, tick.num_requests_waiting) == (0.25, 3, 1)
    assert tick.num_preemptions == 2 and tick.num_preemptions_in_interval == 2
    assert tick.notes == () and tick.vtoken is None
    first = replica_tick(before, None)
    assert first.prompt_tokens_per_s is None and first.interval_s is None


def test_a_counter_reset_mid_watch_is_noted_and_the_summary_keeps_what_came_before() -> None:
    clock = Clock()
    watch = Watch(["http://h"], 1.0, clock=clock)
    ticks = []
    for at_s, prompt in ((0.0, 1_000), (2.0, 1_600), (4.0, 2_000), (6.0, 300), (8.0, 900)):
        clock.now_s = at_s
        ticks.append(watch.update([live(load(prompt, 10), at_s)]).replicas[0])

    assert [t.prompt_tokens_per_s for t in ticks] == [None, 300.0, 200.0, 150.0, 300.0]
    (note,) = ticks[3].notes
    assert note.startswith("vllm:prompt_tokens_total fell from 2000 to 300 between the scrapes (the server restarted)")
    assert all(t.prompt_tokens_per_s >= 0 for t in ticks[1:])
    summary = watch.summary().replicas[0]
    # 600 + 400 before the reset, its 300, then 600: nothing seen before the reset is lost.
    assert summary.num_prompt_tokens == 1_900 and summary.observed_s == 8.0
    assert summary.num_resets >= 1 and summary.prompt_tokens_per_s == 1_900 / 8


def test_a_replica_that_stops_answering_is_shown_down_and_the_watch_goes_on() -> None:
    clock = Clock()
    a, b = "http://a", "http://b"
    script = iter([
        [live(load(100, 10), 0.0, a), live(load(100, 10), 0.0, b)],
        [live(load(500, 50), 2.0, a), EndpointError(f"{b}/metrics: connection refused (is the server running?)")],
        [live(load(900, 90), 4.0, a), live(load(700, 70), 4.0, b)],
    ])
    watch = Watch([a, b], 1.0, clock=clock, scraper=lambda urls, timeout_s: next(script))
    ticks = [watch.update(watch.scraper(watch.urls, 1.0)) for _ in range(3)]

    down = ticks[1].replicas[1]
    assert not down.is_up and "connection refused" in down.error
    assert ticks[1].replicas[0].prompt_tokens_per_s == 200.0  # the other replica goes on
    back = ticks[2].replicas[1]
    assert back.is_up and back.interval_s == 4.0 and back.prompt_tokens_per_s == 600 / 4  # spans the gap
    summary = watch.summary()
    assert [(r.num_answered, r.num_ticks, r.is_up_at_end) for r in summary.replicas] == [(3, 3, True), (2, 3, True)]


def test_the_first_scrape_with_no_replica_answering_is_an_error() -> None:
    error = EndpointError("http://a/metrics: connection refused")
    watch = Watch(["http://a"], 1.0, scraper=lambda urls, timeout_s: [error])
    with pytest.raises(EndpointError, match="connection refused"):
        next(watch.ticks(0.01))


def test_a_vtoken_server_shows_f_the_histogram_tokens_moved_and_blocks_reclaimed() -> None:
    before = live(load(100, 10, vtoken=vtoken_series(1_000, 40, 600.0, 1_000.0)), 0.0)
    now = live(load(200, 20, vtoken=vtoken_series(1_800, 90, 1_500.0, 2_000.0, live_tokens=40, blocks=5,
                                                  histogram=(1, 0, 0, 0, 0, 1, 0, 0, 0, 2))), 2.0)

    v = replica_tick(now, before).vtoken
    assert v.waste_ratio == 1 - 40 / (5 * BLOCK_SIZE)
    assert v.waste_ratio_interval == pytest.approx(1 - 900 / 1_000)  # from the token-second integrals
    assert v.utilization_histogram == (0.25, 0, 0, 0, 0, 0.25, 0, 0, 0, 0.5)
    assert (v.num_tokens_moved, v.num_blocks_reclaimed) == (1_800, 90)
    assert (v.tokens_moved_per_s, v.blocks_reclaimed_per_s) == (400.0, 25.0)
    watch = Watch(["http://h"], 1.0, clock=Clock())
    watch.update([before])
    watch.update([now])
    summary = watch.summary().replicas[0]
    assert (summary.num_tokens_moved, summary.num_blocks_reclaimed) == (800, 50)
    assert summary.waste_ratio == pytest.approx(0.1)


# ---- the command ---------------------------------------------------------------------------------


def scripted(monkeypatch: pytest.MonkeyPatch, samples: list[list]) -> None:
    """scrape_all answers `samples` in turn, then Ctrl-C."""
    remaining = iter(samples)

    def scrape_all(urls, timeout_s):
        try:
            return next(remaining)
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(watch_module, "scrape_all", scrape_all)


def test_a_non_terminal_gets_one_plain_line_per_replica_and_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = "http://a", "http://b"
    scripted(monkeypatch, [
        [live(load(100, 10), 1_000.0, a), live(load(100, 10), 1_000.0, b)],
        [live(load(300, 30), 1_002.0, a), EndpointError(f"{b}/metrics: connection refused")],
    ])
    result = CliRunner().invoke(app, ["audit", a, b, "--watch", "--interval", "0.01"])

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 4 + 3  # two ticks of two replicas, then the summary's three lines
    assert lines[0].startswith("t=0s http://a KV usage 0.0% running 0 waiting 0 preemptions 0 prompt tokens/s -")
    assert "prompt tokens/s 100.0" in lines[2]
    assert lines[3].endswith("http://b down: http://b/metrics: connection refused")
    assert lines[4].startswith("watch summary: 2 ticks")
    assert "http://a: answered 2/2, prompt 200 tokens" in lines[5]
    assert "http://b: answered 1/2" in lines[6] and "down at the end" in lines[6]


@pytest.mark.parametrize("args, fragment", [
    (["--json"], "drop --json"), (["--window", "5"], "drop --window"), (["--interval", "0"], "--interval must be > 0"),
])
def test_watch_flags_it_does_not_take_are_one_line_and_exit_2(args: list[str], fragment: str) -> None:
    result = CliRunner().invoke(app, ["audit", "http://127.0.0.1:9", "--watch", *args])
    assert result.exit_code == 2 and fragment in result.output and len(result.output.strip().splitlines()) == 1


def test_a_watch_of_a_toml_file_is_refused() -> None:
    result = CliRunner().invoke(app, ["audit", "tests/data/audit_small.toml", "--watch"])
    assert result.exit_code == 2 and "--watch needs the http:// or https:// URL" in result.output


def growing_server(reset_after: int | None = None) -> Computed:
    """Counters that grow at every scrape (and fall back to small values after `reset_after` scrapes)."""
    num_scrapes = 0
    lock = threading.Lock()

    def render() -> str:
        nonlocal num_scrapes
        with lock:
            num_scrapes += 1
            n = num_scrapes if reset_after is None or num_scrapes <= reset_after else num_scrapes - reset_after
        return metrics_text({"0": load(1_000 * n, 100 * n, num_running=2, kv_cache_usage=0.5)})

    return Computed(render)


def watch_argv(url: str) -> list[str]:
    return [sys.executable, "-c", "from vtoken_cli.app import main; main()", "audit", url, "--watch",
            "--interval", "0.2"]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def read_until(fd: int, wanted: str, buffer: bytearray) -> None:
    """Read `fd` into `buffer` until `wanted` is in it (fails after WAIT_S without it)."""
    deadline = time.monotonic() + WAIT_S
    while wanted.encode() not in buffer:
        if time.monotonic() > deadline:
            pytest.fail(f"{wanted!r} not printed in {WAIT_S} s: {buffer.decode(errors='replace')[-2000:]}")
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty's master reads EIO once the child has closed it
                chunk = b""
            if not chunk:
                pytest.fail(f"output ended before {wanted!r}: {buffer.decode(errors='replace')[-2000:]}")
            buffer += chunk


def read_count(fd: int, wanted: str, num_times: int, buffer: bytearray) -> None:
    """Read until `wanted` has been printed `num_times` times."""
    while buffer.count(wanted.encode()) < num_times:
        read_until(fd, wanted, tail := bytearray(buffer[-len(wanted) + 1:]))
        buffer += tail[len(wanted) - 1:]


def drain(fd: int, buffer: bytearray) -> None:
    while True:
        ready, _, _ = select.select([fd], [], [], 5.0)
        if not ready:
            return
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        buffer += chunk


def test_sigint_on_a_pipe_prints_the_summary_and_exits_0_after_a_reset() -> None:
    with serve(routes(growing_server(reset_after=3))) as server:
        process = subprocess.Popen(watch_argv(server.url), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=child_env())
        out = bytearray()
        try:
            read_until(process.stdout.fileno(), "fell from", out)  # the 4th scrape's reset
            read_count(process.stdout.fileno(), "\nt=", out.count(b"\nt=") + 1, out)  # a tick after it
            process.send_signal(signal.SIGINT)
            drain(process.stdout.fileno(), out)
            returncode = process.wait(timeout=WAIT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        stderr = process.stderr.read().decode()

    text = out.decode()
    assert returncode == 0, stderr
    assert "Traceback" not in stderr and "Traceback" not in text
    lines = text.splitlines()
    ticks = [line for line in lines if line.startswith("t=")]
    assert len(ticks) >= 4 and all(f" {server.url} KV usage 50.0% running 2" in line for line in ticks)
    assert "prompt tokens/s -" in ticks[0] and "[vllm:prompt_tokens_total fell from 3000 to 1000" in ticks[3]
    summary = lines[lines.index(next(line for line in lines if line.startswith("watch summary:"))):]
    assert summary[1].startswith(f"{server.url}: answered {len(ticks)}/{len(ticks)}")
    assert "counter resets" in summary[1] and " 0 counter resets" not in summary[1]


def test_sigint_on_a_terminal_redraws_in_place_then_prints_the_summary() -> None:
    master, slave = pty.openpty()
    env = {**child_env(), "COLUMNS": "160", "LINES": "50", "TERM": "xterm"}
    with serve(routes(growing_server())) as server:
        process = subprocess.Popen(watch_argv(server.url), stdin=slave, stdout=slave, stderr=slave, env=env,
                                   start_new_session=True)
        os.close(slave)
        out = bytearray()
        try:
            read_until(master, "prompt tok/s", out)
            read_count(master, "vtoken audit --watch", 3, out)  # the first frame and two refreshes
            process.send_signal(signal.SIGINT)
            drain(master, out)
            returncode = process.wait(timeout=WAIT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            os.close(master)

    text = out.decode(errors="replace")
    assert returncode == 0, text[-3000:]
    assert "Traceback" not in text
    assert "\x1b[" in text  # cursor moves: the view is redrawn in place
    assert "Watch summary:" in text and "peak KV" in text and "50.0%" in text
