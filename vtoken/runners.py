"""Where independent replays run: in this process, on local worker processes, or on a Ray cluster.

    runner.map(func, jobs, on_done)    [func(job) for job in jobs], in job order; on_done(idx,
                                       result) in this process as each one finishes
    runner.map(func, jobs, on_done, on_tokens)
                                       also on_tokens(idx, n) as job idx generates tokens:
                                       func(job, report) calls report(n) as it goes
    make_runner(workers, ray_address)  SerialRunner | ProcessRunner | RayRunner
    with runner: ...                   runner.close() at the end: local worker processes are
                                       kept from one batch to the next until then

`func` must be a module-level function and every job picklable (a `ReplayJob` is: frozen
dataclasses and tuples). Results do not depend on the runner: a replay is a pure function of
its run (experiment and run spec) and requests (the sim is seeded by the experiment), so serial, process and Ray runs give
the same results; only the host time each replay measured differs.

Worker processes are spawned, not forked: a forked child would inherit the parent's threads and
locks (numpy's BLAS pool, a progress bar's refresh thread), and spawn behaves the same on Linux
and macOS. A spawned worker imports vtoken once (about a second) and then takes jobs, batch
after batch, until the runner is closed. A batch that fails or is interrupted ends its workers
at once, whatever they run; on Linux a worker also ends when the process that started it does,
however that ends.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from multiprocessing.managers import SyncManager
from typing import Any, Protocol

from vtoken.engine import Run, run_sim
from vtoken.errors import ConfigError
from vtoken.metrics import RunResult
from vtoken.processes import end_with_parent
from vtoken.trace import Request, num_output_tokens

OnDone = Callable[[int, Any], None]  # (index of the job that just finished, its result)
OnTokens = Callable[[int, int], None]  # (index of a running job, tokens it generated since its last report)
TOKEN_REPORT_INTERVAL_S = 0.25  # a worker process batches its token reports this long
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a local cluster stays on 127.0.0.1
RAY_INSTALL_HINT = "pip install 'vtoken[ray]' (or pip install 'ray>=2')"
RAY_ADDRESS_FORMS = "auto, HOST:PORT, ray://HOST:PORT or local"
RAY_CONNECT_TIMEOUT_S = 5.0  # a cluster's address that does not answer within this is refused
# Ray's servers (the GCS, the Ray Client server) speak gRPC: HTTP/2, which a server answers with
# a SETTINGS frame (RFC 9113 §3.4) once a client sent its preface and a SETTINGS frame of its own
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP2_EMPTY_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # length 0, type 4 (SETTINGS), no flags, stream 0
HTTP2_SETTINGS = 4
HTTP2_FRAME_HEADER_BYTES = 9


@dataclass(frozen=True)
class ReplayJob:
    """One sim replay: what determines it, and nothing else."""

    run: Run
    requests: tuple[Request, ...]


def replay_job(job: ReplayJob, on_tokens: Callable[[int], None] | None = None) -> RunResult:
    """The sim replay of `job` (what every runner runs, in whatever process); `on_tokens(n)` as
    it generates tokens."""
    return run_sim(job.run, job.requests, on_tokens)


class ReplayProgress:
    """A batch of replays' progress in generated tokens, for `map(..., on_done, on_tokens)`:
    tokens as a runner streams them, and when a replay is done whatever of its output tokens it
    has not reported (all of them for a reused, cached or non-streaming one). The batch reports
    exactly its replays' output tokens, whatever runs them."""

    def __init__(self, progress: Callable[[str, int], None], jobs: Sequence[ReplayJob],
                 label: Callable[[int], str]) -> None:
        self._progress, self._label = progress, label
        self._left = [num_output_tokens(job.requests) for job in jobs]

    def on_tokens(self, idx: int, num_tokens: int) -> None:
        num_tokens = min(num_tokens, self._left[idx])
        self._left[idx] -= num_tokens
        if num_tokens:
            self._progress(self._label(idx), num_tokens)

    def on_done(self, idx: int, result: object) -> None:
        self.on_tokens(idx, self._left[idx])


class Runner(Protocol):
    name: str

    def __enter__(self) -> Runner: ...

    def __exit__(self, *exc_info: object) -> None:
        """`close()`."""

    def close(self) -> None:
        """Release what the runner keeps between batches (worker processes); it may run more after."""

    def map(self, func: Callable[..., Any], jobs: Sequence[Any], on_done: OnDone | None = None,
            on_tokens: OnTokens | None = None) -> list[Any]:
        """`[func(job) for job in jobs]` in job order; `on_done(idx, result)` as job `idx` finishes.
        With `on_tokens`, `func(job, report)` is called instead and `report(n)` reaches
        `on_tokens(idx, n)` in this process (a runner that cannot stream reports nothing, and
        `on_done` then stands for all of the job's tokens)."""


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _Closing:
    """`with runner:` closes it at the end."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        pass


class SerialRunner(_Closing):
    """Every job in this process, one after the other."""

    name = "serial"

    def map(self, func: Callable[..., Any], jobs: Sequence[Any], on_done: OnDone | None = None,
            on_tokens: OnTokens | None = None) -> list[Any]:
        results = []
        for idx, job in enumerate(jobs):
            results.append(func(job, partial(on_tokens, idx)) if on_tokens is not None else func(job))
            if on_done is not None:
                on_done(idx, results[-1])
        return results


class ProcessRunner(_Closing):
    """`workers` spawned local processes; one job alone runs in this process, where a worker's
    start-up would cost more than it saves.

    The workers are started at the first batch of more than one job, as many as its jobs (at
    most `workers`), and kept for the batches after it: a command's stages (compare's replays,
    then the frontier's two batches; the audit's capacity probes) are several batches, and a
    fresh pool per batch would spawn its workers, which import vtoken, and the token reports'
    manager process again each time (about a second). `close()` (or leaving a `with` block)
    ends them; so does the end of this process. A batch that raises (a job failed, or Ctrl-C)
    ends them too, its pending jobs cancelled: the next batch starts fresh ones, and no token
    report of the failed batch reaches it."""

    name = "processes"

    def __init__(self, workers: int) -> None:
        if workers <= 0:
            raise ConfigError(f"--workers must be > 0, got {workers}")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._manager: Any = None  # a multiprocessing manager, for the token reports' queue
        self._reports: Any = None

    def close(self, abort: bool = False) -> None:
        """End the worker processes (and the reports' manager); the next batch starts new ones.
        `abort` (a batch failed or was interrupted): at once, not after the jobs they run, whose
        results nobody waits for (a replay of a large trace runs for minutes)."""
        pool, manager = self._pool, self._manager
        self._pool = self._manager = self._reports = None
        if pool is not None:
            if abort:  # ProcessPoolExecutor ends its workers only after their jobs (terminate_workers: 3.14)
                for process in list(pool._processes.values()):
                    process.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
        if manager is not None:
            manager.shutdown()

    def map(self, func: Callable[..., Any], jobs: Sequence[Any], on_done: OnDone | None = None,
            on_tokens: OnTokens | None = None) -> list[Any]:
        if len(jobs) <= 1 or self.workers == 1:
            return SerialRunner().map(func, jobs, on_done, on_tokens)
        results: list[Any] = [None] * len(jobs)
        pending: dict = {}
        try:
            pool = self._started_pool()
            reports = self._report_queue() if on_tokens is not None else None
            for idx, job in enumerate(jobs):
                future = pool.submit(func, job) if reports is None else pool.submit(_reporting, func, job, idx, reports)
                pending[future] = idx
            while pending:
                done, _ = wait(pending, timeout=TOKEN_REPORT_INTERVAL_S, return_when=FIRST_COMPLETED)
                if reports is not None:  # a finished job's reports are all queued before its result
                    _drain(reports, on_tokens)
                for future in sorted(done, key=pending.__getitem__):
                    idx = pending.pop(future)
                    results[idx] = future.result()
                    if on_done is not None:
                        on_done(idx, results[idx])
        except BaseException:
            for future in pending:
                future.cancel()
            self.close(abort=True)  # its workers may be broken or still busy with the cancelled batch
            raise
        return results

    def _started_pool(self) -> ProcessPoolExecutor:
        # spawned workers start on demand, one per job submitted while none is idle
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=end_with_parent, initargs=(os.getpid(),))
        return self._pool

    def _report_queue(self) -> Any:
        if self._reports is None:
            self._manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            self._manager.start(end_with_parent, (os.getpid(),))
            self._reports = self._manager.Queue()
        return self._reports


def _reporting(func: Callable[..., Any], job: Any, idx: int, reports: Any) -> Any:
    """`func(job, report)` in a worker, its token reports batched onto the `reports` queue."""
    pending = [0, time.monotonic()]  # tokens not yet sent, when the last batch was sent

    def report(num_tokens: int) -> None:
        pending[0] += num_tokens
        if time.monotonic() - pending[1] >= TOKEN_REPORT_INTERVAL_S:
            reports.put((idx, pending[0]))
            pending[:] = [0, time.monotonic()]

    result = func(job, report)
    if pending[0]:
        reports.put((idx, pending[0]))
    return result


def _drain(reports: Any, on_tokens: OnTokens) -> None:
    while True:
        try:
            idx, num_tokens = reports.get_nowait()
        except queue.Empty:
            return
        on_tokens(idx, num_tokens)


class RayRunner(_Closing):
    """A Ray cluster: `address` of a running one (`auto`, `HOST:PORT`, `ray://HOST:PORT`), or
    `local` to start one on this machine, bound to 127.0.0.1, with `num_cpus` CPUs (default:
    the cores available). The cluster is joined (or started) at the first batch of more than
    one job and left to Ray's own shutdown at exit (`close()` leaves it); one job alone runs in
    this process. The cluster's nodes need the same vtoken (and numpy) installed as this machine.
    An address that is not one, or where no gRPC server answers, is refused when the runner is
    made (`ray_endpoint`, `check_ray_answers`), before any work."""

    name = "ray"

    def __init__(self, address: str, num_cpus: int | None = None) -> None:
        require_ray()
        endpoint = ray_endpoint(address)
        if endpoint is not None:
            check_ray_answers(address, *endpoint)
        self.address = address
        self.num_cpus = num_cpus

    def map(self, func: Callable[..., Any], jobs: Sequence[Any], on_done: OnDone | None = None,
            on_tokens: OnTokens | None = None) -> list[Any]:
        """Ray tasks do not stream token reports: `on_done` stands for each job's tokens."""
        if len(jobs) <= 1:
            return SerialRunner().map(func, jobs, on_done, on_tokens)
        import ray

        if not ray.is_initialized():
            self._init(ray)
        remote = ray.remote(func)
        pending = {remote.remote(job): idx for idx, job in enumerate(jobs)}
        results: list[Any] = [None] * len(jobs)
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    idx = pending.pop(ref)
                    results[idx] = ray.get(ref)
                    if on_done is not None:
                        on_done(idx, results[idx])
        except BaseException:
            for ref in pending:
                ray.cancel(ref)
            raise
        return results

    def _init(self, ray) -> None:
        on_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            self._join_or_start(ray)
        finally:  # Ray's core installs a SIGTERM handler of its own, which ends the process at once
            if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_sigterm)

    def _join_or_start(self, ray) -> None:
        if self.address == "local":
            # Ray resolves 127.0.0.1 to the machine's reachable address unless it runs as a
            # single-machine cluster (its switch for macOS and Windows): keep it on loopback.
            os.environ[LOOPBACK_ONLY_ENV] = "0"
            ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
            ray.init(address="local", include_dashboard=False, num_cpus=self.num_cpus or available_cores(),
                     _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
            return
        try:
            ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"--ray {self.address}: no Ray cluster answered ({reason})") from None


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """`--ray`'s address as (host, port) for HOST:PORT and ray://HOST:PORT (a host name, an IPv4
    address, or an IPv6 one in brackets), None for `auto` and `local` (Ray finds the cluster, or
    starts one); ConfigError for anything else."""
    if address in ("auto", "local"):
        return None
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536) or any(c in host for c in "/[] "):
        raise ConfigError(f"--ray {address}: not a cluster's address; give {RAY_ADDRESS_FORMS}")
    return host, int(port)


def check_ray_answers(address: str, host: str, port: int, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Refuse, with a ConfigError, a cluster address where nothing accepts a connection within
    `timeout_s`, or where what does is not a gRPC server (no SETTINGS frame in answer to an HTTP/2
    client's preface), as each of Ray's is: `ray.init` waits there without end. With Ray's TLS on
    (RAY_USE_TLS) only the connection is checked."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return
            conn.sendall(HTTP2_PREFACE + HTTP2_EMPTY_SETTINGS)
            header = b""
            deadline = time.monotonic() + timeout_s
            while len(header) < HTTP2_FRAME_HEADER_BYTES and (left_s := deadline - time.monotonic()) > 0:
                conn.settimeout(left_s)
                chunk = conn.recv(HTTP2_FRAME_HEADER_BYTES - len(header))
                if not chunk:
                    break
                header += chunk
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ConfigError(f"--ray {address}: nothing answered at {host}:{port} ({reason})") from None
    if len(header) < HTTP2_FRAME_HEADER_BYTES or header[3] != HTTP2_SETTINGS:
        raise ConfigError(f"--ray {address}: {host}:{port} answered, but not as a Ray cluster (not a gRPC server)")


def require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError(f"--ray needs Ray installed: {RAY_INSTALL_HINT}") from None


def make_runner(workers: int | None = None, ray_address: str | None = None) -> Runner:
    """A Ray runner for `ray_address`; else `workers` local processes (None: the cores
    available); a single worker is the serial runner."""
    if ray_address is not None:
        return RayRunner(ray_address, workers)
    workers = available_cores() if workers is None else workers
    if workers <= 0:
        raise ConfigError(f"--workers must be > 0, got {workers}")
    return SerialRunner() if workers == 1 else ProcessRunner(workers)
