"""A loopback HTTP server for tests: a route table in, a base URL out.

    with serve({"/metrics": Route(text), "/v1/models": HANG}) as server:
        scrape(server.url, timeout_s=0.5)
        assert server.requests[0].path == "/metrics"

Each route answers with a fixed status, content type and body, or with `Computed(render)`'s
body, rendered afresh for every request (counters that move between scrapes), or stalls: `Hang()` accepts the
request and answers nothing, `Hang(after_headers=True)` sends the headers and then no body,
`Trickle()` sends the headers and then a byte at a time, never finishing. A stalling handler
waits until the `with` block ends (at most `max_hang_s`), so leaving the block releases every
handler, stops the server and joins its threads. Unknown paths get 404.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Route:
    body: str | bytes = b""
    status: int = 200
    content_type: str = PROMETHEUS_TEXT


@dataclass(frozen=True)
class Computed:
    """Answer 200 with `render()` at the time of each request."""

    render: Callable[[], str | bytes]
    content_type: str = PROMETHEUS_TEXT


@dataclass(frozen=True)
class Hang:
    after_headers: bool = False


HANG = Hang()


@dataclass(frozen=True)
class Trickle:
    """Send the headers, then one body byte every `interval_s` (never a complete body)."""

    interval_s: float = 0.05


@dataclass(frozen=True)
class SeenRequest:
    path: str
    headers: dict[str, str]


@dataclass
class FakeServer:
    url: str  # http://127.0.0.1:PORT, no trailing slash
    requests: list[SeenRequest] = field(default_factory=list)  # in arrival order


class _Server(ThreadingHTTPServer):
    # Non-daemon handler threads are joined by server_close(), so nothing outlives the test.
    daemon_threads = False
    block_on_close = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that timed out and closed its socket is the expected end of a hang route.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextmanager
def serve(
    routes: Mapping[str, Route | Computed | Hang | Trickle], max_hang_s: float = 30.0
) -> Iterator[FakeServer]:
    release = threading.Event()
    fake = FakeServer(url="")
    handler = _make_handler(dict(routes), fake, release, max_hang_s)
    server = _Server(("127.0.0.1", 0), handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield fake
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join()


def _make_handler(
    routes: dict[str, Route | Computed | Hang | Trickle],
    fake: FakeServer,
    release: threading.Event,
    max_hang_s: float,
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 5  # a client that connects and sends nothing cannot block server_close

        def do_GET(self) -> None:  # noqa: N802 -- http.server's naming
            fake.requests.append(SeenRequest(self.path, dict(self.headers.items())))
            route = routes.get(self.path, Route(b"not found", 404, "text/plain"))
            try:
                if isinstance(route, Hang):
                    self._hang(route)
                elif isinstance(route, Trickle):
                    self._trickle(route)
                elif isinstance(route, Computed):
                    self._answer(Route(route.render(), 200, route.content_type))
                else:
                    self._answer(route)
            except ConnectionError:
                pass  # the client gave up first, which is what hang tests expect

        def _answer(self, route: Route) -> None:
            body = route.body.encode() if isinstance(route.body, str) else route.body
            self.send_response(route.status)
            self.send_header("Content-Type", route.content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _hang(self, route: Hang) -> None:
            if route.after_headers:
                self._send_endless_headers()
            release.wait(max_hang_s)

        def _trickle(self, route: Trickle) -> None:
            self._send_endless_headers()
            deadline_s = time.monotonic() + max_hang_s
            while not release.wait(route.interval_s) and time.monotonic() < deadline_s:
                self.wfile.write(b"#")

        def _send_endless_headers(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", PROMETHEUS_TEXT)
            self.send_header("Content-Length", "1000000")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    return Handler
