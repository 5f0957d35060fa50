"""Load for the soak test: concurrent streaming clients against an OpenAI-compatible server.

Each client loops until the deadline: one streamed completion at a time, a prompt made of one
of a few shared prefixes and a private suffix (token ids, so vLLM's prefix cache hits across
clients), greedy, EOS ignored. A share of the requests disconnects mid-stream after a random
number of chunks (closing the connection, as a client that goes away does; vLLM aborts the
request). Every request ends in exactly one tally: completed (finish_reason "length", the
usage block, `[DONE]`), disconnected, failed (HTTP status, malformed stream, connection
error), or hung (no end within `request_timeout_s`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass(frozen=True)
class Load:
    num_clients: int = 24
    duration_s: float = 60.0
    num_prefixes: int = 3
    prefix_tokens: int = 96  # 3 full blocks of 32: what sharers can hit
    suffix_tokens: tuple[int, int] = (16, 80)  # private suffix length, inclusive range
    output_tokens: tuple[int, int] = (16, 96)
    disconnect_share: float = 0.25
    vocab: tuple[int, int] = (3, 500)  # token ids drawn from [low, high)
    request_timeout_s: float = 300.0
    seed: int = 0


@dataclass
class Tally:
    num_started: int = 0
    num_completed: int = 0
    num_disconnected: int = 0
    num_hung: int = 0
    num_tokens_received: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def num_ended(self) -> int:
        return self.num_completed + self.num_disconnected + self.num_hung + len(self.failures)

    def summary(self, duration_s: float) -> str:
        return (f"{self.num_started} requests in {duration_s:.0f} s: {self.num_completed} completed, "
                f"{self.num_disconnected} disconnected mid-stream, {len(self.failures)} failed, {self.num_hung} hung; "
                f"{self.num_tokens_received} tokens streamed")


def run_load(base_url: str, model: str, load: Load) -> Tally:
    """Drive the server for `load.duration_s` seconds; returns once every request has ended."""
    return asyncio.run(_run(base_url, model, load))


async def _run(base_url: str, model: str, load: Load) -> Tally:
    rng = np.random.default_rng(load.seed)
    prefixes = [rng.integers(*load.vocab, load.prefix_tokens).tolist() for _ in range(load.num_prefixes)]
    tally = Tally()
    deadline = time.monotonic() + load.duration_s
    limits = httpx.Limits(max_connections=load.num_clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(load.request_timeout_s), limits=limits) as http:
        await asyncio.gather(*(_client(http, model, load, prefixes, np.random.default_rng([load.seed, i]), deadline, tally)
                               for i in range(load.num_clients)))
    return tally


async def _client(http: httpx.AsyncClient, model: str, load: Load, prefixes: list[list[int]], rng, deadline: float,
                  tally: Tally) -> None:
    while time.monotonic() < deadline:
        suffix = rng.integers(*load.vocab, int(rng.integers(load.suffix_tokens[0], load.suffix_tokens[1] + 1))).tolist()
        max_tokens = int(rng.integers(load.output_tokens[0], load.output_tokens[1] + 1))
        disconnect_after = int(rng.integers(1, max_tokens)) if rng.random() < load.disconnect_share else None
        body = {"model": model, "prompt": prefixes[int(rng.integers(len(prefixes)))] + suffix, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tally.num_started += 1
        try:
            async with asyncio.timeout(load.request_timeout_s):
                outcome = await _stream(http, body, disconnect_after, tally)
        except TimeoutError:
            tally.num_hung += 1
            continue
        except (httpx.HTTPError, ValueError, KeyError) as error:
            tally.failures.append(f"{type(error).__name__}: {error}")
            continue
        if outcome == "completed":
            tally.num_completed += 1
        elif outcome == "disconnected":
            tally.num_disconnected += 1
        else:
            tally.failures.append(outcome)


async def _stream(http: httpx.AsyncClient, body: dict, disconnect_after: int | None, tally: Tally) -> str:
    """One streamed completion: "completed", "disconnected", or what went wrong."""
    num_chunks, finish_reason, num_completion_tokens = 0, None, None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage") and not chunk.get("choices"):
                num_completion_tokens = chunk["usage"]["completion_tokens"]
                continue
            choice = chunk["choices"][0]
            num_chunks += 1
            tally.num_tokens_received += 1
            finish_reason = choice.get("finish_reason") or finish_reason
            if disconnect_after is not None and num_chunks >= disconnect_after and finish_reason is None:
                return "disconnected"  # leaving the block closes the connection mid-stream
        else:
            return f"stream ended without [DONE] after {num_chunks} chunks"
    if finish_reason != "length" or num_completion_tokens != body["max_tokens"]:
        return (f"finished with reason {finish_reason!r} and {num_completion_tokens} tokens, "
                f"asked for {body['max_tokens']}")
    return "completed"
