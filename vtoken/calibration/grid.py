"""The designed grid a calibration measures, as closed-loop scenarios both engines replay.

Each scenario is a list of requests and a concurrency; the engine replays it closed loop (a
client submits its next request when its previous one finished) and every step is timed with
the load the engine scheduled. The scenarios are chosen so that the steps span the model's
features:

    decode(B, L)    B requests of L prompt tokens, N outputs each, at concurrency B:
                    one prefill step of B prompts, then N - 1 decode steps of B requests at L..L+N
    prefill(P)      one request of P prompt tokens and one output token: a prefill step of P
    mixed(B, P)     B long requests (L_mix prompt tokens) and K short ones (P prompt tokens, one
                    output) at concurrency B + 1: each short request is prefilled in the same
                    step as the B decodes (vLLM V1's mixed steps), K - 1 of them
    copy(N)         the engine's own relocation copy of N token slots, timed alone

A round replays every scenario once; the first round is preceded by a warm-up replay of the
smallest decode scenario that is not kept. Rounds repeat every point.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vtoken.errors import ConfigError
from vtoken.trace import Request


@dataclass(frozen=True)
class CalibrationGrid:
    decode_batch_sizes: tuple[int, ...] = (1, 4, 8)
    decode_context_tokens: tuple[int, ...] = (64, 512)
    num_decode_outputs: int = 6  # N: output tokens of each decode-scenario request
    prefill_tokens: tuple[int, ...] = (64, 256, 1024)
    mixed_batch_sizes: tuple[int, ...] = (4,)
    mixed_prefill_tokens: tuple[int, ...] = (128, 512)
    mixed_context_tokens: int = 256  # L_mix
    num_mixed_steps: int = 2  # K - 1 mixed steps per mixed scenario
    copy_tokens: tuple[int, ...] = (64, 512, 2048)
    num_rounds: int = 2

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            values = value if isinstance(value, tuple) else (value,)
            if not values or any(not isinstance(v, int) or v <= 0 for v in values):
                raise ConfigError(f"calibration grid: {name} must be integers > 0, got {value!r}")

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @property
    def max_model_len(self) -> int:
        """Longest request of the grid, in tokens."""
        return max(max(self.decode_context_tokens) + self.num_decode_outputs, max(self.prefill_tokens) + 1,
                   self.mixed_context_tokens + self.num_mixed_steps + 2, max(self.mixed_prefill_tokens) + 1)


# `vtoken calibrate --quick`: every kind of step, at small sizes
QUICK_GRID = CalibrationGrid(decode_batch_sizes=(1, 4), decode_context_tokens=(32, 128), num_decode_outputs=4,
                             prefill_tokens=(32, 128), mixed_batch_sizes=(2,), mixed_prefill_tokens=(64,),
                             mixed_context_tokens=64, num_mixed_steps=2, copy_tokens=(32, 256), num_rounds=1)


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: tuple[Request, ...]
    concurrency: int


def scenarios(grid: CalibrationGrid) -> list[Scenario]:
    """Every replayed scenario of one round, in order."""
    out = [decode_scenario(b, ctx, grid.num_decode_outputs)
           for b in grid.decode_batch_sizes for ctx in grid.decode_context_tokens]
    out += [Scenario(f"prefill P={p}", (_request("p", 0, p, 1),), 1) for p in grid.prefill_tokens]
    for b in grid.mixed_batch_sizes:
        for p in grid.mixed_prefill_tokens:
            num_short = grid.num_mixed_steps + 1
            long = [_request("long", i, grid.mixed_context_tokens, num_short + 1) for i in range(b)]
            short = [_request("short", i, p, 1) for i in range(num_short)]
            out.append(Scenario(f"mixed B={b} P={p}", tuple(long + short), b + 1))
    return out


def warmup_scenario(grid: CalibrationGrid) -> Scenario:
    return decode_scenario(min(grid.decode_batch_sizes), min(grid.decode_context_tokens), grid.num_decode_outputs)


def decode_scenario(num_requests: int, num_context_tokens: int, num_outputs: int) -> Scenario:
    requests = tuple(_request("d", i, num_context_tokens, num_outputs) for i in range(num_requests))
    return Scenario(f"decode B={num_requests} L={num_context_tokens}", requests, num_requests)


def _request(prefix: str, idx: int, num_prompt_tokens: int, num_output_tokens: int) -> Request:
    return Request(f"{prefix}{idx}", 0.0, num_prompt_tokens, num_output_tokens)
