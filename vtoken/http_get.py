"""HTTP GET of a server's endpoints for `vtoken.endpoint`, with stdlib HTTP only: one deadline
for a whole scrape, a bounded body, credentials (`user:password@`) sent as basic auth and never
kept, printed or put in a message, and every failure one `EndpointError` line naming the URL.

    target = parse_target(url)                         ConfigError for an unusable URL
    body = fetch(target, "/metrics", deadline, timeout_s)
    text = decode_text(body, url)
"""

from __future__ import annotations

import base64
import http.client
import re
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from vtoken.errors import ConfigError, EndpointError

MAX_BODY_BYTES = 64 << 20
_READ_CHUNK_BYTES = 1 << 16
_MAX_CAUSE_CHARS = 160


@dataclass(frozen=True)
class Target:
    base_url: str  # scheme://host[:port][/prefix], no credentials, no trailing slash
    host: str
    auth_header: str | None  # "Basic ..." built from user:password@, never shown


def redact_url(url: str) -> str:
    """Return `url` without its `user:password@` part; everything else is left as written."""
    return re.sub(r"^((?:[A-Za-z][A-Za-z0-9+.\-]*:)?//)?[^/?#]*@", r"\1", url)



def parse_target(url: str) -> Target:
    shown = redact_url(url.strip())
    if "://" not in shown:
        raise ConfigError(f"{shown}: no scheme; use http://{shown} or https://{shown}")
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 -- urlsplit checks the port only when it is read
    except ValueError as err:
        raise ConfigError(f"{shown}: not a usable URL: {one_line(err)}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ConfigError(f"{shown}: unsupported scheme {parts.scheme!r}; use http:// or https://")
    if not parts.hostname:
        raise ConfigError(f"{shown}: no host in the URL")
    path = parts.path.rstrip("/")
    for suffix in ("/metrics", "/v1"):
        path = path.removesuffix(suffix)
    auth = None
    if parts.username is not None:
        userpass = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(userpass.encode()).decode("ascii")
    hostport = parts.netloc.rpartition("@")[2]
    return Target(f"{parts.scheme.lower()}://{hostport}{path}", parts.hostname, auth)


def fetch(target: Target, path: str, deadline: float, timeout_s: float) -> bytes:
    """GET base_url + path before `deadline` (time.monotonic()); EndpointError on any failure."""
    url = target.base_url + path
    headers = {"User-Agent": "vtoken", "Accept": "text/plain, application/json"}
    if target.auth_header is not None:
        headers["Authorization"] = target.auth_header
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise EndpointError(f"{url}: no answer within {timeout_s:g} s")
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=remaining_s) as response:
            return _read_body(response, url, deadline, timeout_s)
    except urllib.error.HTTPError as err:
        err.close()
        raise EndpointError(f"{url}: HTTP {err.code} {one_line(err.reason)}") from None
    except urllib.error.URLError as err:
        cause = _describe(err.reason, target.host, timeout_s)
        raise EndpointError(f"{url}: {cause}") from None
    # ValueError: a host name that IDNA cannot encode (a label over 63 characters, ...).
    except (OSError, http.client.HTTPException, ValueError) as err:
        raise EndpointError(f"{url}: {_describe(err, target.host, timeout_s)}") from None


def _read_body(
    response: http.client.HTTPResponse, url: str, deadline: float, timeout_s: float
) -> bytes:
    # Each read is bounded by the socket timeout set at connect time; read1 returns what one
    # recv got, so checking the deadline between chunks also cuts off a server that trickles
    # bytes (read() would wait for a full chunk, resetting the socket timeout at every byte).
    chunks: list[bytes] = []
    num_bytes = 0
    while chunk := response.read1(_READ_CHUNK_BYTES):
        chunks.append(chunk)
        num_bytes += len(chunk)
        if num_bytes > MAX_BODY_BYTES:
            raise EndpointError(f"{url}: body larger than {MAX_BODY_BYTES >> 20} MiB")
        if time.monotonic() > deadline:
            raise EndpointError(f"{url}: no complete answer within {timeout_s:g} s")
    return b"".join(chunks)


def _describe(cause: object, host: str, timeout_s: float) -> str:
    if isinstance(cause, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(cause, socket.gaierror):
        return f"cannot resolve host {host!r} ({cause.strerror})"
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (is the server running on that port?)"
    if isinstance(cause, http.client.RemoteDisconnected):
        return "server closed the connection without answering"
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {one_line(cause)}"
    return one_line(cause)


def decode_text(body: bytes, url: str) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise EndpointError(f"{url}: body is not Prometheus text: not UTF-8") from None



def one_line(value: object) -> str:
    """One line of at most _MAX_CAUSE_CHARS characters: messages must stay one line."""
    line = " ".join(str(value).split())
    return line if len(line) <= _MAX_CAUSE_CHARS else line[: _MAX_CAUSE_CHARS - 3] + "..."
