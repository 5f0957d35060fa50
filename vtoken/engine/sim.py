"""The `sim` executor: a deterministic cost model for step time and a synthetic attention model.

No model runs. A step is one forward over the decodes and prompt chunks the scheduler gave it
(vLLM V1 runs them together: engine/scheduler.py). Its time comes from a step model fitted to a
real engine by `vtoken calibrate` when the profile carries one (`SimProfile.step_model`,
vtoken/calibration/model.py), else from a roofline on a GPU from the catalog:

    t_step = overhead_s
           + (weight_bytes + kv_bytes_read) / (hbm_bytes_per_s * hbm_efficiency)
           + (linear_flops + attention_flops) / (bf16_flop_per_s * mfu)
           + max(0, copy_s - copy_overlap_s)        # copy_s = relocation bytes / HBM rate

    kv_bytes_read   = kv_bytes_per_token x (sum over decodes of (extent + 1)
                                            + sum over chunks of (context extent + chunk tokens))
    linear_flops    = 2 x num_params x prompt-chunk tokens (a decode's are in the weight read)
    attention_flops = 4 x layers x heads x head_dim x sum over chunks of
                      c x (context extent) + c x (c + 1) / 2         (QK^T and PV, causal)

A prompt chunk's attention reads its request's KV extent so far and then its own keys: vLLM
passes `seq_lens = num_computed_tokens + num_scheduled_tokens` (vllm/v1/worker/
gpu_model_runner.py, `_prepare_inputs`) and FlashAttention's varlen kernel reads each
request's keys through its block table up to `seqused_k` (vllm/v1/attention/backends/
flash_attn.py), decodes and chunks in the same call.

What attention reads (`SimProfile.attention_reads`):

- `kv-extent` (default): every slot of each request's block list up to its last written token,
  dead or alive (`StepLoad.num_kv_slots_read`). This is what vLLM's paged kernels do; none of
  them takes a token mask (vllm 0.32, under vllm/):
    v1/attention/backends/flash_attn.py        `seqused_k = attn_metadata.seq_lens`
    v1/attention/backends/flashinfer.py        `num_blocks_np = (seq_lens_np + (page_size - 1)) // page_size`
                                               (and `paged_kv_last_page_len_np = seq_lens_np % page_size`)
    v1/attention/ops/triton_unified_attention.py  `for j in range(loop_lo, loop_hi):` loading
                                               `block_tables_ptr + block_table_offset + seq_offset // BLOCK_SIZE`,
                                               the bound from triton_attention_helpers.py's
                                               `num_tiles = cdiv_fn(max_seq_prefix_len, TILE_SIZE)`,
                                               `max_seq_prefix_len = tl.minimum(max_seq_prefix_len, seq_len)`
  So a dead token that stays in a held block costs full bandwidth: naive-evict reads about
  what native does, and only compaction makes attention cheaper. The same holds for a prompt
  chunk's context (and for its attention FLOPs: the kernel computes every key up to seq_len).
- `live-tokens`: only live tokens (`StepLoad.num_live_kv_tokens`), as a token-gather kernel
  that reads a per-token slot list would; no vLLM backend is one.

Relocation copies run on a side stream after the forward; only the part that does not fit in
the post-forward window (`copy_overlap_s`) shows up in the step time. With `sync_copy` the
whole copy does (the forced-synchronous ablation).

Synthetic attention (what H2O, Scissorhands and TOVA score). Each token j of request r has a
heavy-tailed importance w_j ~ Pareto(alpha), seeded by (seed, r), plus a boost for the first
`num_sink_tokens` (attention sinks). The attention a query at position q pays to key j decays
with distance: a(q, j) = w_j * r(q - j), r(d) = (1 + d / tau)^-beta. From it, at logical length L:

    attention_sum[j]    = w_j * sum_{d=0}^{L-1-j} r(d)        (H2O's accumulated attention)
    attention_last[j]   = w_j * r(L - 1 - j)                  (TOVA's latest query)
    importance_count[j] = #{q in [L-W, L) : a(q, j) >= theta}  (Scissorhands, window W)

All three are pure functions of (seed, request, L), so every variant sees the same scores and
makes the same eviction decisions.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vtoken.calibration.model import Provenance, StepTimeModel
from vtoken.engine.executor import SCORE_FIELDS, StepLoad, TokenScores, prefill_kv_pairs
from vtoken.errors import ConfigError
from vtoken.hardware import GpuSpec
from vtoken.lazy import imported_at_first_call
from vtoken.model_spec import ModelSpec

if TYPE_CHECKING:
    from vtoken.engine.batch import Batch


_compiled = imported_at_first_call("vtoken.engine.sim_compiled")  # at the first scores: numba is not imported with the sim


ATTENTION_READS = ("kv-extent", "live-tokens")  # paged kernels (vLLM's); a token-gather kernel
WEIGHTS_DRAWN_AHEAD = 256  # w_j drawn past the length asked for: a growing request draws every few events, not every one
# a request's generator is seeded with those of the next indices (requests reach their first
# scores about in arrival order): seeding one between a replay's events, its code cold, costs
# several times what seeding them one after another does
GENERATORS_SEEDED_AHEAD = 64


@dataclass(frozen=True)
class SimProfile:
    """Every knob of the sim executor, with its default. Overridable from a TOML profile."""

    attention_reads: str = "kv-extent"  # one of ATTENTION_READS: what a decode step's attention reads
    hbm_efficiency: float = 0.80  # fraction of peak HBM bandwidth a decode step achieves
    mfu: float = 0.50  # model FLOP utilization of prefill
    overhead_s: float = 0.002  # fixed per-step cost: scheduling, launch, sampling
    copy_overlap_s: float = 0.0005  # post-forward window that hides relocation copies
    sync_copy: bool = False  # forced-synchronous copies: the whole copy is on the critical path
    pareto_alpha: float = 1.5  # tail index of per-token importance (smaller = heavier hitters)
    sink_boost: float = 50.0  # importance multiplier of the attention-sink tokens
    num_sink_tokens: int = 4
    recency_tau: float = 32.0  # distance scale of the recency decay, in tokens
    recency_beta: float = 1.0  # exponent of the recency decay
    importance_window: int = 64  # Scissorhands' history window W, in queries
    importance_threshold: float = 0.05  # a(q, j) at or above this marks j important for q
    step_model: StepTimeModel | None = None  # fitted step times (vtoken calibrate); None: the roofline

    def __post_init__(self) -> None:
        if self.attention_reads not in ATTENTION_READS:
            raise ConfigError(f"sim profile: attention_reads must be one of {', '.join(ATTENTION_READS)}, "
                              f"got {self.attention_reads!r}")
        for name in ("hbm_efficiency", "mfu"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"sim profile: {name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("overhead_s", "copy_overlap_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"sim profile: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("pareto_alpha", "recency_tau", "recency_beta", "importance_threshold"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"sim profile: {name} must be > 0, got {getattr(self, name)}")
        if self.importance_window <= 0:
            raise ConfigError(f"sim profile: importance_window must be > 0, got {self.importance_window}")

    def as_dict(self) -> dict:
        return asdict(self)

    def describe_step_times(self) -> str:
        """Where step times come from, in one line."""
        model = self.step_model
        if model is None:
            return "catalog roofline estimates (not calibrated)"
        where = model.provenance.describe() if model.provenance is not None else "an unnamed engine"
        return f"calibrated against {where}"


# The [scheduler] table of a sim profile: vLLM V1's scheduler limits (`SchedulerConfig` fields), with
# the type each must have. A command's flags override them; vLLM's defaults fill the rest.
SCHEDULER_KEYS = {"max_num_batched_tokens": int, "max_num_seqs": int, "enable_chunked_prefill": bool,
                  "long_prefill_token_threshold": int}


def _read_profile(path: str | Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: sim profile not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_scheduler_overrides(path: str | Path) -> dict[str, int | bool]:
    """The profile's [scheduler] table: the scheduler limits it sets ({} without one)."""
    table = _read_profile(path).get("scheduler", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [scheduler] must be a table of {', '.join(SCHEDULER_KEYS)}")
    for key, value in table.items():
        kind = SCHEDULER_KEYS.get(key)
        if kind is None:
            raise ConfigError(f"{path}: unknown [scheduler] key '{key}'; known keys: {', '.join(SCHEDULER_KEYS)}")
        if type(value) is not kind or (kind is int and value < (0 if key == "long_prefill_token_threshold" else 1)):
            raise ConfigError(f"{path}: [scheduler] {key} must be {'true or false' if kind is bool else 'a positive integer'}, "
                              f"got {value!r}")
    return dict(table)


def load_sim_profile(path: str | Path) -> SimProfile:
    """Read a TOML profile whose keys are `SimProfile` fields (top level or under [sim]); its
    [scheduler] table is `load_scheduler_overrides`'."""
    data = _read_profile(path)
    data = {k: v for k, v in data.get("sim", data).items() if k != "scheduler"}
    _require_known_keys(data, SimProfile, path, "sim profile")
    try:
        if "step_model" in data:
            data["step_model"] = _step_model_from(data["step_model"], path)
        return replace(SimProfile(), **data)
    except TypeError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _step_model_from(table: object, path: str | Path) -> StepTimeModel:
    """[sim.step_model] with its [sim.step_model.provenance]."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: step_model must be a table, got {table!r}")
    table = dict(table)
    _require_known_keys(table, StepTimeModel, path, "step_model")
    provenance = table.pop("provenance", None)
    if provenance is not None:
        if not isinstance(provenance, dict):
            raise ConfigError(f"{path}: step_model.provenance must be a table, got {provenance!r}")
        _require_known_keys(provenance, Provenance, path, "step_model.provenance")
        try:
            provenance = Provenance(**provenance)
        except TypeError as exc:
            raise ConfigError(f"{path}: step_model.provenance: {exc}") from None
    missing = [f.name for f in fields(StepTimeModel) if f.name != "provenance" and f.name not in table]
    if missing:
        raise ConfigError(f"{path}: step_model is missing '{missing[0]}'")
    return StepTimeModel(**table, provenance=provenance)


def _require_known_keys(data: dict, cls: type, path: str | Path, what: str) -> None:
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{path}: unknown {what} key '{unknown[0]}'; known keys: {', '.join(known)}")


class SimExecutor:
    """Deterministic step times and attention scores; no model, no tensors."""

    name = "sim"
    runs_prompt_chunks = True

    def __init__(self, model: ModelSpec, gpu: GpuSpec, profile: SimProfile, seed: int) -> None:
        self.model = model
        self.gpu = gpu
        self.profile = profile
        self.seed = seed
        self._kv_rate = gpu.hbm_bytes_per_s * profile.hbm_efficiency
        self._weight_s = model.weight_bytes / self._kv_rate
        self._reads_extent = profile.attention_reads == "kv-extent"
        self._compute_rate = gpu.bf16_flop_per_s * profile.mfu
        # QK^T and PV: 2 x head_dim FLOPs each per (query, key) pair, per head and layer
        self._attention_flops_per_pair = 4 * model.num_layers * model.num_attention_heads * model.head_dim
        self._importance: dict[int, _WeightStream] = {}  # request -> w_j
        self._seeded: dict[int, np.random.Generator] = {}  # request -> its generator, seeded ahead, unused
        self._max_ages: dict[int, np.ndarray] = {}  # request -> max_age_j, for the policies that count
        self._recency_tables = (np.zeros(0), np.zeros(0))

    # ---- cost model ----------------------------------------------------------------------

    def execute(self, batch: Batch, load: StepLoad) -> float:
        """The iteration's duration from the cost model; nothing runs."""
        return self.iteration_time_s(load)

    def iteration_time_s(self, load: StepLoad) -> float:
        """The modelled duration of one step with this load: the fitted step model's, else the
        module docstring's roofline."""
        step_model = self.profile.step_model
        if step_model is not None:
            return step_model.forward_time_s(load, self._reads_extent) + self.copy_time_s(load.num_copied_tokens)
        n = load.num_decoding_requests
        kv_tokens_read = (load.num_kv_slots_read if self._reads_extent else load.num_live_kv_tokens) + n
        num_prefill_tokens = num_pairs = 0
        for chunk in load.prefill_chunks:
            context = chunk.num_context_slots if self._reads_extent else chunk.num_context_live_tokens
            c = chunk.num_new_tokens
            kv_tokens_read += context + c
            num_prefill_tokens += c
            num_pairs += prefill_kv_pairs(context, c)
        memory_s = self._weight_s + kv_tokens_read * self.model.kv_bytes_per_token / self._kv_rate
        compute_s = (2.0 * self.model.num_params * num_prefill_tokens + self._attention_flops_per_pair * num_pairs) / self._compute_rate
        return self.profile.overhead_s + memory_s + compute_s + self.copy_time_s(load.num_copied_tokens)

    def raw_copy_time_s(self, num_copied_tokens: int) -> float:
        """Time of relocating tokens, overlapped or not: the fitted price per copied token, else
        a read and a write of their K/V at the HBM rate."""
        step_model = self.profile.step_model
        if step_model is not None:
            return step_model.copy_time_s(num_copied_tokens)
        return 2 * num_copied_tokens * self.model.kv_bytes_per_token / self._kv_rate

    def copy_time_s(self, num_copied_tokens: int) -> float:
        """Critical-path time of relocating tokens: what the post-forward window does not hide."""
        copy_s = self.raw_copy_time_s(num_copied_tokens)
        return copy_s if self.profile.sync_copy else max(0.0, copy_s - self.profile.copy_overlap_s)

    # ---- synthetic attention ---------------------------------------------------------------

    def importance(self, req_idx: int, num_tokens: int) -> np.ndarray:
        """w_j for j < num_tokens: a fixed stream per request, extended as it grows."""
        return self._weights(req_idx, num_tokens)[:num_tokens]

    def _weights(self, req_idx: int, num_tokens: int) -> np.ndarray:
        """w_j for at least `num_tokens` tokens: the first values of the request's stream, drawn
        as it grows. Each draw continues the request's generator, so the values are those one
        draw of the whole length would give (the stream's first values do not depend on how
        many are drawn), and a request draws about its final length once, not again at every
        doubling."""
        stream = self._importance.get(req_idx)
        if stream is None:
            p = self.profile
            stream = self._importance[req_idx] = _WeightStream(self._generator(req_idx), p.pareto_alpha,
                                                              p.num_sink_tokens, p.sink_boost)
        if stream.num_drawn < num_tokens:
            stream.draw(num_tokens + WEIGHTS_DRAWN_AHEAD)
            self._max_ages.pop(req_idx, None)  # computed from the values drawn so far
        return stream.values[: stream.num_drawn]

    def _generator(self, req_idx: int) -> np.random.Generator:
        """A fresh generator seeded by (seed, req_idx), as `np.random.default_rng` gives it: one
        seeded ahead, else seeded now with the next GENERATORS_SEEDED_AHEAD - 1 indices' (those
        waiting further than that from `req_idx` are dropped, so that at most twice as many wait)."""
        seeded = self._seeded
        rng = seeded.pop(req_idx, None)
        if rng is not None:
            return rng
        for idx in [idx for idx in seeded if abs(idx - req_idx) >= GENERATORS_SEEDED_AHEAD]:
            del seeded[idx]
        for idx in range(req_idx + 1, req_idx + GENERATORS_SEEDED_AHEAD):
            if idx not in seeded and idx not in self._importance:
                seeded[idx] = np.random.default_rng([self.seed, idx])
        return np.random.default_rng([self.seed, req_idx])

    def _max_age(self, req_idx: int, weights: np.ndarray) -> np.ndarray:
        """max_age_j, the largest query distance at which a(q, j) >= theta: a function of w_j
        alone, computed once per draw of the weights, and only for a policy that counts."""
        max_age = self._max_ages.get(req_idx)
        if max_age is None:
            p = self.profile
            max_age = np.floor(p.recency_tau * ((weights / p.importance_threshold) ** (1.0 / p.recency_beta) - 1.0))
            self._max_ages[req_idx] = max_age
        return max_age

    def _recency(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(r(d), sum_{d'<=d} r(d')) for every age d < num_tokens, one table for every request
        (elementwise the same numbers as computing them for each request's ages)."""
        tables = self._recency_tables
        if tables[0].size < num_tokens:
            p = self.profile
            age = np.arange(max(num_tokens, 2 * tables[0].size, 1024), dtype=np.float64)
            tables = self._recency_tables = ((1.0 + age / p.recency_tau) ** -p.recency_beta,
                                             _cumulative_recency(age, p.recency_tau, p.recency_beta))
        return tables

    def forget(self, req_idx: int) -> None:
        self._importance.pop(req_idx, None)
        self._seeded.pop(req_idx, None)
        self._max_ages.pop(req_idx, None)

    def attention_stats(self, req_idx: int, token_ids: np.ndarray, num_tokens: int,
                        fields: tuple[str, ...] = SCORE_FIELDS) -> TokenScores:
        """(attention_sum, attention_last, importance_count) of `token_ids` at length `num_tokens`;
        None for those not in `fields`."""
        p = self.profile
        weights = self._weights(req_idx, num_tokens)
        recency, cumulative_recency = self._recency(num_tokens)
        # the tables by age = num_tokens - 1 - token_id
        weighted_by_age = _compiled().weighted_by_age
        attention_sum = (weighted_by_age(weights, cumulative_recency, num_tokens, token_ids)
                         if "attention_sum" in fields else None)
        attention_last = weighted_by_age(weights, recency, num_tokens, token_ids) if "attention_last" in fields else None
        importance_count = None
        if "importance_count" in fields:
            # a(q, j) >= theta  <=>  q - j <= max_age_j ; count the window's queries within that age
            first_query = max(0, num_tokens - p.importance_window)
            last_important = np.minimum(token_ids + self._max_age(req_idx, weights)[token_ids], num_tokens - 1)
            importance_count = np.clip(last_important - np.maximum(token_ids, first_query) + 1, 0,
                                       p.importance_window).astype(np.int32)
        return attention_sum, attention_last, importance_count


def _cumulative_recency(age: np.ndarray, tau: float, beta: float) -> np.ndarray:
    """sum_{d=0}^{age} (1 + d/tau)^-beta, by the integral approximation plus the d=0 term."""
    if beta == 1.0:
        return 1.0 + tau * np.log1p(age / tau)
    return 1.0 + tau * ((1.0 + age / tau) ** (1.0 - beta) - 1.0) / (1.0 - beta)



class _WeightStream:
    """One request's w_j = 1 + Pareto(alpha), the first `num_sink_tokens` times `sink_boost`,
    drawn on demand into a buffer grown by doubling."""

    def __init__(self, rng: np.random.Generator, alpha: float, num_sink_tokens: int, sink_boost: float) -> None:
        self.rng, self.alpha = rng, alpha
        self.num_sink_tokens, self.sink_boost = num_sink_tokens, sink_boost
        self.values = np.zeros(0)
        self.num_drawn = 0

    def draw(self, num_values: int) -> None:
        """Continue the stream up to `num_values` values."""
        start = self.num_drawn
        if num_values > self.values.size:
            grown = np.empty(max(num_values, 2 * self.values.size))
            grown[:start] = self.values[:start]
            self.values = grown
        # rng.pareto(alpha, n) + 1.0, value for value, from the same draws
        _compiled().pareto_plus_one(self.rng.standard_exponential(num_values - start), self.alpha,
                                    self.values[start:num_values])
        if start < self.num_sink_tokens:
            self.values[start : min(self.num_sink_tokens, num_values)] *= self.sink_boost
        self.num_drawn = num_values
