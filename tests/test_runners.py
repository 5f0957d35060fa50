"""Where replays run and what is kept of them: serial, local processes and Ray give the same
results; the on-disk cache is reused when nothing that determines a run changed, and missed
when anything did."""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vtoken import cache as cache_module
from vtoken.analysis import frontier, run_together
from vtoken.audit import Overrides, audit
from vtoken.audit import report_to_json as audit_report_to_json
from vtoken.cache import RunCache, job_key
from vtoken.compare import CompareOptions, compare, report_to_json
from vtoken.engine.experiment import EvictionConfig, SchedulerConfig
from vtoken.engine.sim import SimProfile
from vtoken.errors import ConfigError, VTokenError
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.policies.base import Budget
from vtoken.replay import SimReplayer
from vtoken.runners import (
    ProcessRunner, RayRunner, ReplayJob, SerialRunner, check_ray_answers, make_runner, ray_endpoint, replay_job,
)
from vtoken.trace import Request, load_trace
import vtoken_cli.app as app_module
from vtoken_cli.app import app
from vtoken_cli.options import build_cache

from test_replayers import REQUESTS, CountingRunner, make_experiment, make_run

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_traces" / "azure_conv_sample.csv"
OPTIONS = CompareOptions((2, 8), repeats=2, concurrency=8)  # the headline at two seeds, a sweep at 2 and 8, a frontier


def compare_json(runner) -> dict:
    trace = load_trace(SAMPLE, max_requests=40)
    report = compare(trace, make_experiment(num_blocks=600), OPTIONS, SimReplayer(runner=runner), num_blocks=600)
    return json.loads(json.dumps(report_to_json(report)))


@pytest.fixture(scope="module")
def serial_json() -> dict:
    return compare_json(SerialRunner())


def test_two_worker_processes_give_the_serial_json(serial_json) -> None:
    assert compare_json(ProcessRunner(2)) == serial_json


@pytest.mark.timeout(240)
def test_ray_on_a_local_cluster_gives_the_serial_json(serial_json) -> None:
    ray = pytest.importorskip("ray")
    try:
        assert compare_json(RayRunner("local", num_cpus=2)) == serial_json  # starts it, on 127.0.0.1
        assert [node["NodeManagerAddress"] for node in ray.nodes()] == ["127.0.0.1"]
    finally:
        ray.shutdown()


def test_a_runner_returns_results_in_job_order_and_reports_each_job() -> None:
    jobs = [ReplayJob(make_run(c), REQUESTS) for c in (4, 1, 2)]
    done: list[int] = []
    results = ProcessRunner(2).map(replay_job, jobs, lambda idx, result: done.append(idx))
    assert sorted(done) == [0, 1, 2]
    without_host_time = [replace(r, host_time_s=0.0) for r in results]
    assert without_host_time == [replace(replay_job(job), host_time_s=0.0) for job in jobs]


def worker_pid(job: int) -> int:
    return os.getpid()


def fails_on_two(job: int) -> int:
    if job == 2:
        raise ValueError("job 2 failed")
    return job * job


def test_a_process_runner_keeps_its_workers_from_one_batch_to_the_next() -> None:
    # children of earlier tests that have not exited yet (a loaded host) are not this runner's
    before = {child.pid for child in multiprocessing.active_children()}
    with ProcessRunner(2) as runner:
        runner.map(worker_pid, [0, 1, 2, 3])
        workers = {child.pid for child in multiprocessing.active_children()} - before
        assert set(runner.map(worker_pid, [0, 1, 2, 3])) <= workers  # no new process started
        assert os.getpid() not in workers
    assert not workers & {child.pid for child in multiprocessing.active_children()}  # closed: they are gone


def test_a_batch_that_raises_ends_its_workers_and_the_next_batch_starts_fresh_ones() -> None:
    with ProcessRunner(2) as runner:
        workers = set(runner.map(worker_pid, [0, 1, 2, 3]))
        with pytest.raises(ValueError, match="job 2 failed"):
            runner.map(fails_on_two, [1, 2, 3])
        assert not workers & {child.pid for child in multiprocessing.active_children()}  # ended
        assert runner.map(fails_on_two, [1, 3, 4]) == [1, 9, 16]


def runs_long_or_fails(job: tuple[str, str], report=None) -> None:
    """("long", folder): writes its pid to folder/long.pid and sleeps for ten minutes (reporting
    no token);
    ("fail", folder): waits for that file, then raises."""
    kind, folder = job
    pid_file = Path(folder) / "long.pid"
    if kind == "long":
        pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
        pid_file.with_suffix(".tmp").rename(pid_file)
        time.sleep(600)
    while not pid_file.exists():
        time.sleep(0.05)
    raise ValueError("the other job failed")


def has_ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def still_running(pids: list[int], wait_s: float = 10.0) -> list[int]:
    """Those of `pids` that have not ended within `wait_s` (a process killed by the parent-death
    signal, or a resource tracker let go of, ends a moment after its parent)."""
    deadline = time.monotonic() + wait_s
    while (running := [pid for pid in pids if not has_ended(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


@pytest.mark.timeout(120)  # before: the failed batch waited for the other job's ten minutes
def test_a_batch_that_fails_ends_its_workers_at_once_whatever_they_run(tmp_path) -> None:
    with pytest.raises(ValueError, match="the other job failed"):
        ProcessRunner(2).map(runs_long_or_fails, [("long", str(tmp_path)), ("fail", str(tmp_path))])
    assert has_ended(int((tmp_path / "long.pid").read_text()))


SIGNALLED_RUN = """
import sys
from vtoken.runners import ProcessRunner
from vtoken_cli.app import _terminated
import signal
from test_runners import runs_long_or_fails
signal.signal(signal.SIGTERM, _terminated)
with ProcessRunner(2) as runner:
    runner.map(runs_long_or_fails, [("long", sys.argv[1]), ("long", sys.argv[1] + "/2")], on_tokens=lambda *a: None)
"""


@pytest.fixture
def signalled_run(tmp_path: Path):
    """A process like `vtoken` (in a session of its own) whose two worker processes run
    ten-minute jobs, and a manager process takes their token reports, once both jobs started;
    whatever the test leaves of its session is killed after it."""
    (tmp_path / "2").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    process = subprocess.Popen([sys.executable, "-c", SIGNALLED_RUN, str(tmp_path)], env=env, start_new_session=True)
    try:
        while not ((tmp_path / "long.pid").exists() and (tmp_path / "2" / "long.pid").exists()):
            assert process.poll() is None, "the run ended before its jobs started"
            time.sleep(0.1)
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def children_of(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="pgrep -P and /proc")
def test_sigterm_ends_a_command_and_every_process_it_started(signalled_run) -> None:
    process = signalled_run
    children = children_of(process.pid)
    assert len(children) >= 3  # two workers and the reports' manager (and the resource tracker)
    process.send_signal(signal.SIGTERM)
    assert process.wait() == 128 + signal.SIGTERM
    assert still_running(children) == []


SERVE_STAND_IN = """
import signal, sys
import vtoken.engine.vllm.serve as serve
from vtoken_cli.app import _terminated
serve.importlib.util.find_spec = lambda name: object()  # as if vLLM were installed
server = "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(600)"
serve.serve_command = lambda options: [sys.executable, "-c", server, sys.argv[1]]  # a server that never ends
signal.signal(signal.SIGTERM, _terminated)
serve.run_server(None)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, exit_code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)],
                         ids=["sigterm", "sigkill"])
def test_the_server_vtoken_serve_started_ends_with_it(tmp_path, how, exit_code) -> None:
    if how == signal.SIGKILL and sys.platform != "linux":
        pytest.skip("the parent-death signal is Linux's (prctl)")
    pid_file = tmp_path / "server.pid"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", SERVE_STAND_IN, str(pid_file)], env=env, start_new_session=True)
    try:
        while not pid_file.exists():
            assert process.poll() is None, "vtoken serve's stand-in ended before its server started"
            time.sleep(0.1)
        process.send_signal(how)
        assert process.wait() == exit_code
        assert still_running([int(pid_file.read_text())]) == []  # before: the server went on, its parent gone
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_after_a_sigterm_the_exit_code_is_143_whatever_ended_the_unwinding(monkeypatch) -> None:
    def command(prog_name: str) -> None:
        try:
            app_module._terminated(signal.SIGTERM, None)
        except SystemExit:
            raise SystemExit(1) from None  # as Ray's wait ends a wait a signal interrupted

    monkeypatch.setattr(app_module, "app", command)
    monkeypatch.setattr(app_module, "_sigterm_received", False)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as ended:
            app_module.main()
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert ended.value.code == 128 + signal.SIGTERM


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's (prctl)")
def test_workers_end_when_the_command_is_killed_outright(signalled_run) -> None:
    process = signalled_run
    children = children_of(process.pid)
    process.kill()  # SIGKILL: no cleanup runs in the command
    process.wait()
    assert still_running(children) == []


def test_computations_run_together_see_what_they_see_alone() -> None:
    def computation(name: str, batch_sizes: tuple[int, ...]):
        seen = []
        for size in batch_sizes:
            yield [f"{name}{k}" for k in range(size)], lambda k, result: seen.append((k, result))
        return seen

    batches = []

    def run_many(jobs, on_done):
        batches.append(list(jobs))
        for idx, job in reversed(list(enumerate(jobs))):  # in any order
            on_done(idx, job.upper())

    a, b = run_together([computation("a", (2, 1)), computation("b", (1, 1, 3))], run_many)
    assert batches == [["a0", "a1", "b0"], ["a0", "b0"], ["b0", "b1", "b2"]]  # one batch a round
    assert a == [(1, "A1"), (0, "A0"), (0, "A0")]
    assert b == [(0, "B0"), (0, "B0"), (2, "B2"), (1, "B1"), (0, "B0")]


def test_make_runner() -> None:
    assert isinstance(make_runner(1), SerialRunner)
    assert make_runner(2).workers == 2
    with pytest.raises(ConfigError, match="--workers must be > 0, got 0"):
        make_runner(0)


def test_ray_missing_is_a_one_line_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"^--ray needs Ray installed: pip install 'vtoken\[ray\]'"):
        make_runner(None, "local")


@pytest.mark.parametrize("address, endpoint", [
    ("local", None), ("auto", None), ("10.0.0.2:6379", ("10.0.0.2", 6379)), ("head-node:6379", ("head-node", 6379)),
    ("ray://head:10001", ("head", 10001)), ("[::1]:6379", ("::1", 6379)),
])
def test_a_ray_address_is_local_auto_or_a_host_and_port(address, endpoint) -> None:
    assert ray_endpoint(address) == endpoint


@pytest.mark.parametrize("address", ["head", "head:", ":6379", "head:0", "head:65536", "head:63x", "ray://", "http://h:1",
                                     "h /x:1", "--json"])
def test_anything_else_is_refused_as_an_address(address) -> None:
    with pytest.raises(ConfigError, match=rf"^--ray {re.escape(address)}: not a cluster's address; give auto, HOST:PORT"):
        ray_endpoint(address)


class AnsweringServer:
    """A TCP server on 127.0.0.1 that accepts connections and answers each with `reply` (bytes,
    or None: reads and never answers), in a thread, until closed."""

    def __init__(self, reply: bytes | None) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.socket.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):  # a client that gave up resets the connection
                conn.recv(64)
                if self.reply is not None:
                    conn.sendall(self.reply)
                conn.recv(64)  # until the client closes

    def __enter__(self) -> AnsweringServer:
        return self

    def __exit__(self, *exc) -> None:
        self.socket.close()


def test_a_grpc_server_answers_as_a_cluster_and_nothing_else_does() -> None:
    settings = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # the server's own SETTINGS frame, as gRPC's HTTP/2 sends first
    with AnsweringServer(settings) as grpc:
        check_ray_answers("a", "127.0.0.1", grpc.port, timeout_s=2)
    with AnsweringServer(b"HTTP/1.1 400 Bad Request\r\n\r\n") as http, \
            pytest.raises(ConfigError, match=rf"^--ray a: 127.0.0.1:{http.port} answered, but not as a Ray cluster"):
        check_ray_answers("a", "127.0.0.1", http.port, timeout_s=2)
    with AnsweringServer(None) as silent, \
            pytest.raises(ConfigError, match=rf"^--ray a: nothing answered at 127.0.0.1:{silent.port} \(timed out\)"):
        check_ray_answers("a", "127.0.0.1", silent.port, timeout_s=0.3)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(ConfigError, match=rf"^--ray a: nothing answered at 127.0.0.1:{port} \(Connection refused\)"):
        check_ray_answers("a", "127.0.0.1", port, timeout_s=2)


def test_a_ray_address_where_no_cluster_answers_is_one_line_exit_2_before_any_work(tmp_path) -> None:
    pytest.importorskip("ray")
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    for address, fragment in ((f"127.0.0.1:{port}", f"nothing answered at 127.0.0.1:{port}"),
                              ("notanaddress", "not a cluster's address")):
        result = CliRunner().invoke(app, ["compare", str(SAMPLE), "--max-requests", "3", "--no-sweep", "--no-frontier",
                                          "--ray", address, "--cache-dir", str(tmp_path / "cache")])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --ray {address}: {fragment}"), result.stderr
        assert "Traceback" not in result.output and result.stdout == ""
    assert not (tmp_path / "cache").exists()


# ---- the cache ---------------------------------------------------------------------------------


def test_a_cache_directory_vtoken_could_not_write_is_refused_naming_where_it_came_from(tmp_path, monkeypatch) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"^--cache-dir .*/afile: .*afile is a file, not a directory$"):
        build_cache(tmp_path / "afile", no_cache=False)
    monkeypatch.setenv("VTOKEN_RUN_CACHE_DIR", str(tmp_path / "afile" / "runs"))
    with pytest.raises(ConfigError, match=r"^\$VTOKEN_RUN_CACHE_DIR .*afile/runs: .*afile is a file, not a directory$"):
        build_cache(None, no_cache=False)
    assert build_cache(tmp_path / "new" / "runs", no_cache=False).directory == tmp_path / "new" / "runs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # made at the first write: nothing made here


def test_a_cache_write_that_fails_is_one_error_naming_the_directory(tmp_path) -> None:
    (tmp_path / "afile").write_text("x")
    cache = RunCache(tmp_path / "afile" / "runs")  # as if it went bad after the command's check
    job = ReplayJob(make_run(), REQUESTS)
    with pytest.raises(VTokenError, match=r"^cannot write the run cache at .*afile/runs: Not a directory \(--no-cache"):
        cache.put(job, replay_job(job))


def cached_replayer(tmp_path: Path) -> SimReplayer:
    return SimReplayer(runner=CountingRunner(), cache=RunCache(tmp_path))


def test_a_second_compare_replays_nothing(tmp_path) -> None:
    options = CompareOptions((1, 4), concurrency=4)
    first = cached_replayer(tmp_path)
    report = compare(load_trace(SAMPLE, max_requests=12), make_experiment(), options, first, num_blocks=64)
    assert len(first.runner.replayed) > 0
    second = cached_replayer(tmp_path)
    again = compare(load_trace(SAMPLE, max_requests=12), make_experiment(), options, second, num_blocks=64)
    assert second.runner.replayed == []
    assert report_to_json(again) == report_to_json(report)
    assert [r.host_time_s for r in again.runs.values()] == [r.host_time_s for r in report.runs.values()]


@pytest.mark.parametrize("change", [
    lambda e, r: (replace(e, reclaim=replace(e.reclaim, theta_f=0.3)).run("vtoken", 4), r),
    lambda e, r: (replace(e, eviction=replace(e.eviction, budget=Budget(keep_ratio=0.4))).run("vtoken", 4), r),
    lambda e, r: (replace(e, seed=1).run("vtoken", 4), r),
    lambda e, r: (replace(e, sim=replace(e.sim, overhead_s=0.003)).run("vtoken", 4), r),
    lambda e, r: (e.run("vtoken", 3), r),
    lambda e, r: (e.run("naive-evict", 4), r),
    lambda e, r: (e.run("vtoken", 4), (replace(r[0], num_output_tokens=r[0].num_output_tokens + 1), *r[1:])),
    lambda e, r: (e.run("vtoken", 4), r[:-1]),
], ids=["theta_f", "budget", "seed", "sim-profile", "concurrency", "variant", "a request", "a request fewer"])
def test_anything_that_determines_a_run_misses_the_cache(tmp_path, change) -> None:
    experiment = make_experiment()
    cache = RunCache(tmp_path)
    SimReplayer(cache=cache).run(experiment.run("vtoken", 4), REQUESTS)
    replayer = SimReplayer(runner=CountingRunner(), cache=cache)
    replayer.run(experiment.run("vtoken", 4), REQUESTS)
    assert replayer.runner.replayed == []
    changed_run, changed_requests = change(experiment, REQUESTS)
    replayer.run(changed_run, changed_requests)
    assert len(replayer.runner.replayed) == 1


def test_the_key_covers_every_field_of_the_run_and_the_code(monkeypatch) -> None:
    job = ReplayJob(make_run(), REQUESTS)
    key = job_key(job)
    assert job_key(ReplayJob(make_run(), tuple(REQUESTS))) == key
    assert job_key(ReplayJob(make_run(scheduler=SchedulerConfig(max_num_batched_tokens=4096)), REQUESTS)) != key
    assert job_key(ReplayJob(make_run(scheduler=SchedulerConfig(max_num_seqs=255)), REQUESTS)) != key
    assert job_key(ReplayJob(make_run(reclaim=ReclaimConfig(theta_f=0.05)), REQUESTS)) != key
    assert job_key(ReplayJob(make_run(eviction=EvictionConfig("tova", Budget(keep_ratio=0.5), 8)), REQUESTS)) != key
    assert job_key(ReplayJob(make_run(sim=SimProfile(sync_copy=True)), REQUESTS)) != key
    assert job_key(ReplayJob(make_run(None), REQUESTS)) != key
    assert job_key(ReplayJob(make_experiment().run("vtoken", 4, admit_all_at_start=True), REQUESTS)) != key
    monkeypatch.setattr(cache_module, "code_fingerprint", lambda: "vtoken 0.1.0; numpy x; source edited")
    assert job_key(job) != key


def test_the_key_is_the_sha256_of_one_canonical_document() -> None:
    """Written in parts, the key is still the one document's (so that a cache written before
    stays valid): every field, keys sorted, no spaces."""
    job = ReplayJob(make_run(), REQUESTS)
    document = {"format": cache_module.CACHE_FORMAT, "code": cache_module.code_fingerprint(),
                "run": cache_module._canonical(job.run), "requests": [cache_module._canonical(r) for r in REQUESTS]}
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=True)
    assert job_key(job) == hashlib.sha256(text.encode()).hexdigest()


def test_jobs_that_share_their_requests_write_them_once(monkeypatch) -> None:
    written, canonical = [], cache_module._canonical
    monkeypatch.setattr(cache_module, "_canonical", lambda value: (written.append(value), canonical(value))[1])
    cache_module._requests_json.cache_clear()
    requests = tuple(replace(r, request_id=f"shared {r.request_id}") for r in REQUESTS)
    keys = {job_key(ReplayJob(make_run(c), requests)) for c in (1, 2, 4)} | {job_key(ReplayJob(make_run(1), list(requests)))}
    assert len(keys) == 3
    assert sum(isinstance(value, Request) for value in written) == len(requests)


def test_an_interrupted_batch_keeps_what_finished(tmp_path) -> None:
    class FailingSecond(SerialRunner):
        def map(self, func, jobs, on_done=None, on_tokens=None):
            on_done(0, func(jobs[0]))
            raise KeyboardInterrupt

    jobs = [ReplayJob(make_run(c), REQUESTS) for c in (1, 2)]
    with pytest.raises(KeyboardInterrupt):
        SimReplayer(runner=FailingSecond(), cache=RunCache(tmp_path)).run_many(jobs)
    resumed = SimReplayer(runner=CountingRunner(), cache=RunCache(tmp_path))
    resumed.run_many(jobs)
    assert resumed.runner.replayed == [("vtoken", 2, len(REQUESTS), False)]


def test_an_unreadable_entry_is_a_miss(tmp_path) -> None:
    job = ReplayJob(make_run(), REQUESTS)
    cache = RunCache(tmp_path)
    cache.put(job, replay_job(job))
    (path,) = tmp_path.rglob("*.pkl")
    path.write_bytes(b"not a pickle")
    assert cache.get(job) is None


# ---- the frontier's and audit's replays -------------------------------------------------------

LONG_OUTPUTS = tuple(Request(f"r{i}", 0.0, 64 + 8 * i, 160) for i in range(4))  # packing decides the frontier


class RecordingRunner(SerialRunner):
    """The serial runner, recording each batch it was given: (variant, C, block budget) per job."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, int, int]]] = []

    def map(self, func, jobs, on_done=None, on_tokens=None):
        self.batches.append([(j.run.spec.variant, len(j.requests), j.run.experiment.num_blocks) for j in jobs])
        return super().map(func, jobs, on_done, on_tokens)


def test_the_frontier_runs_in_two_batches_on_the_runner_with_the_serial_result() -> None:
    # lazy reclamation off (theta_F 0.9): an unbounded pool never packs, so vtoken is replayed
    # again in the budget wherever its unbounded demand exceeds it
    experiment = make_experiment(num_blocks=60, reclaim=ReclaimConfig(theta_f=0.9))
    serial = frontier(experiment, LONG_OUTPUTS, (4, 6, 8))
    runner = RecordingRunner()
    batched = frontier(experiment, LONG_OUTPUTS, (4, 6, 8), run_many=lambda jobs, on_done: runner.map(replay_job, jobs, on_done))
    assert batched == serial
    assert serial.max_feasible_concurrency["vtoken"] > serial.max_feasible_concurrency["naive-evict"]
    assert len(runner.batches[0]) == 9  # every point in an unbounded pool
    assert runner.batches[1] == [("vtoken", 6, 60), ("vtoken", 8, 60)]  # then in the budget, where needed
    processes = frontier(experiment, LONG_OUTPUTS, (4, 6, 8), run_many=lambda jobs, on_done: ProcessRunner(2).map(replay_job, jobs, on_done))
    assert processes == serial


def test_compare_sends_the_frontier_to_the_replayer_runner() -> None:
    runner = CountingRunner()
    compare(load_trace(SAMPLE, max_requests=10), make_experiment(num_blocks=600), CompareOptions((2, 3), with_sweep=False),
            SimReplayer(runner=runner), num_blocks=600)
    assert sum(admitted_at_once for *_, admitted_at_once in runner.replayed) == 6  # C = 2, 3 x three variants


def test_audit_on_two_worker_processes_gives_the_serial_json() -> None:
    small = ROOT / "tests" / "data" / "audit_small.toml"
    overrides = Overrides(max_requests=6, frontier_max_concurrency=8)  # two policies: five replays
    serial = audit_report_to_json(audit(str(small), overrides))
    runner = RecordingRunner()
    recorded = audit_report_to_json(audit(str(small), overrides, runner=runner))
    assert recorded == serial
    assert len(runner.batches[0]) == 5  # native, and naive-evict and vtoken per policy: one batch
    # the capacity searches: native's alone, then both policies' probes side by side, a batch a round
    probes = [[variant for variant, *_ in batch] for batch in runner.batches[1:]]
    num_native = probes.count(["native"])
    assert num_native and probes[:num_native] == [["native"]] * num_native
    assert ["naive-evict", "naive-evict"] in probes[num_native:]
    assert audit_report_to_json(audit(str(small), overrides, runner=ProcessRunner(2))) == serial


def test_a_repeated_audit_replays_nothing_its_cache_holds(tmp_path) -> None:
    small = ROOT / "tests" / "data" / "audit_small.toml"
    overrides = Overrides(max_requests=6, frontier_max_concurrency=8)
    first, again = CountingRunner(), CountingRunner()
    measured = audit_report_to_json(audit(str(small), overrides, runner=first, cache=RunCache(tmp_path)))
    assert sum(not admitted_at_once for *_, admitted_at_once in first.replayed) == 5  # and the capacity probes
    assert audit_report_to_json(audit(str(small), overrides, runner=again, cache=RunCache(tmp_path))) == measured
    assert again.replayed == []
    changed = replace(overrides, seed=1)
    audit(str(small), changed, runner=again, cache=RunCache(tmp_path))
    assert sum(not admitted_at_once for *_, admitted_at_once in again.replayed) == 5
