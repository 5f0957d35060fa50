"""The `hf` executor: a real transformers causal LM over the paged KV cache.

The runtime places the new tokens in the token tables before each forward (prefill: the whole
prompt at admission; decode: one token); `execute` then writes the K/V of those tokens at
their slots and attends over exactly the live slots (`hf_forward.PagedDecoder`). Everything
a variant changes reaches the model only through the token table: the policy's evictions (dead
tokens are no longer read) and vToken's relocations (the copy engine moves the model's real
K/V, the table repoints the tokens). Generation is greedy; the executor keeps each request's
token ids, the log-probability of every generated token and, for the oracle, the query
position from which each token was hidden (`RequestOutput`).

Attention statistics for the policies, accumulated from the real attention probabilities of
every query (prompt queries included), summed over heads and layers into one row per query:

    attention_sum[j]     sum over queries of the attention j received     (H2O)
    attention_last[j]    the latest query's attention to j, / (heads * layers)  (TOVA)
    importance_count[j]  queries among the last W whose mean-over-heads-and-layers attention
                         to j was at least the row's mean (1 / keys read)  (Scissorhands)

Time: `execute` returns the measured wall time of the forward (host bookkeeping of the
scores included); `RunResult.host_time_s` is the whole engine loop, copies and policies included.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from vtoken.engine.batch import Batch, ReqState, TableFactory
from vtoken.engine.executor import SCORE_FIELDS, StepLoad, TokenScores
from vtoken.engine.experiment import Experiment, Run
from vtoken.engine.hf_forward import PagedDecoder
from vtoken.engine.observer import RuntimeObserver
from vtoken.engine.runtime import PlannerFactory, Runtime
from vtoken.engine.scores import AttentionStats
from vtoken.errors import ConfigError
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.kv.reclaim import Reclaimer
from vtoken.kv.token_table import TokenTable
from vtoken.metrics import RunResult
from vtoken.models import LoadedModel
from vtoken.policies import make_policy
from vtoken.trace import Request

NEVER = np.iinfo(np.int64).max  # evicted_at of a token that was never hidden


# ---- prompts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedRequests:
    """Requests whose `num_prompt_tokens` equal the length of their token ids."""

    requests: tuple[Request, ...]
    prompt_ids: tuple[np.ndarray, ...]  # int64, aligned with requests
    is_random: tuple[bool, ...]  # True: no prompt text in the trace, seeded random ids
    notes: tuple[str, ...]


def prepare_requests(requests: Sequence[Request], tokenizer, seed: int) -> PreparedRequests:
    """Token ids for every request: its `prompt` text through the tokenizer (the chat template
    when the tokenizer has one), or, without text, `num_prompt_tokens` ids drawn from a
    generator seeded by (seed, request index) among the non-special tokens.

    Requests sharing a `prefix_id` get the first holder's first `num_prefix_tokens` ids, so
    that their shared KV blocks hold the same tokens.
    """
    allowed = np.setdiff1d(np.arange(len(tokenizer)), np.asarray(tokenizer.all_special_ids, dtype=np.int64))
    prefixes: dict[str, np.ndarray] = {}
    prepared, all_ids, is_random = [], [], []
    for idx, request in enumerate(requests):
        rng = np.random.default_rng([seed, idx])
        ids = _encode(tokenizer, request.prompt) if request.prompt else rng.choice(allowed, request.num_prompt_tokens)
        if request.prefix_id is not None:
            if ids.size <= request.num_prefix_tokens:
                ids = np.concatenate((ids, rng.choice(allowed, request.num_prefix_tokens + 1 - ids.size)))
            shared = prefixes.setdefault(request.prefix_id, ids[: request.num_prefix_tokens].copy())
            ids = np.concatenate((shared, ids[request.num_prefix_tokens :]))
        prepared.append(replace(request, num_prompt_tokens=int(ids.size)))
        all_ids.append(ids.astype(np.int64))
        is_random.append(not request.prompt)
    return PreparedRequests(tuple(prepared), tuple(all_ids), tuple(is_random), _prompt_notes(requests, is_random, seed))


def _encode(tokenizer, text: str) -> np.ndarray:
    if tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
    else:
        encoded = tokenizer(text)
    return np.asarray(encoded["input_ids"], dtype=np.int64)


def _prompt_notes(requests: Sequence[Request], is_random: Sequence[bool], seed: int) -> tuple[str, ...]:
    num_random = sum(is_random)
    notes = []
    if num_random:
        notes.append(f"{num_random} of {len(requests)} requests have no prompt text: their prompts are seeded "
                     f"random token ids (seed {seed}), so their outputs are not meaningful text")
    if num_random < len(requests):
        notes.append(f"{len(requests) - num_random} requests: prompt text tokenized; the token count replaces "
                     "the trace's input length")
    return tuple(notes)


# ---- per-request state -------------------------------------------------------------------


@dataclass(frozen=True)
class RequestOutput:
    """What the model produced for one request, and what it read while doing so."""

    request_id: str
    token_ids: np.ndarray  # int64 [prompt + generated]
    num_prompt_tokens: int
    logprobs: np.ndarray  # float64 [generated]: log-probability of each greedy token
    # int64 [prompt + generated]: the first query position that no longer read the token (NEVER)
    evicted_at: np.ndarray
    # logprobs before this index came from a computation that a preemption threw away
    num_exact_from: int
    is_random_prompt: bool

    @property
    def generated_ids(self) -> np.ndarray:
        return self.token_ids[self.num_prompt_tokens :]


class _Record:
    """Mutable, private: one request's tokens, log-probabilities, eviction history, scores."""

    def __init__(self, request: Request, prompt_ids: np.ndarray, is_random: bool) -> None:
        capacity = prompt_ids.size + request.num_output_tokens
        self.request = request
        self.is_random = is_random
        self.num_prompt_tokens = prompt_ids.size
        self.token_ids = np.zeros(capacity, dtype=np.int64)
        self.token_ids[: prompt_ids.size] = prompt_ids
        self.num_ids = prompt_ids.size
        self.logprobs: list[float] = []
        self.evicted_at = np.full(capacity, NEVER, dtype=np.int64)
        self.num_exact_from = 0
        self.scores: AttentionStats | None = None

    def append(self, token_id: int, logprob: float) -> None:
        self.token_ids[self.num_ids] = token_id
        self.num_ids += 1
        self.logprobs.append(logprob)

    def note_hidden(self, live: np.ndarray, query_pos: int) -> None:
        """Record the tokens this query is the first not to read."""
        dead = ~live
        newly = dead & (self.evicted_at[: live.size] == NEVER)
        self.evicted_at[: live.size][newly] = query_pos

    def output(self) -> RequestOutput:
        n = self.num_ids
        return RequestOutput(self.request.request_id, self.token_ids[:n].copy(), self.num_prompt_tokens,
                             np.asarray(self.logprobs, dtype=np.float64), self.evicted_at[:n].copy(),
                             self.num_exact_from, self.is_random)


# ---- the executor ------------------------------------------------------------------------


class HFExecutor:
    """Runs the model for each runtime iteration; owns the paged KV tensor the copy engine moves."""

    name = "hf"
    runs_prompt_chunks = False  # a prompt is computed whole: hf runs with chunked prefill off

    def __init__(self, model: LoadedModel, prepared: PreparedRequests, num_blocks: int, block_size: int, *,
                 collect_scores: bool, importance_window: int = 64) -> None:
        spec = model.spec
        parameter = next(model.model.parameters())
        shape = KVShape(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_cache = PagedKVCache(shape, dtype=parameter.dtype, device=parameter.device)
        self.decoder = PagedDecoder(model.model, self.kv_cache, collect_scores)
        self.device = parameter.device
        self.collect_scores = collect_scores
        self.importance_window = importance_window
        self.notes = prepared.notes
        self._num_heads_layers = spec.num_attention_heads * spec.num_layers
        self._records = [_Record(r, ids, rnd) for r, ids, rnd in zip(prepared.requests, prepared.prompt_ids, prepared.is_random)]
        self.forward_s = 0.0
        self.num_forwards = 0

    def execute(self, batch: Batch, load: StepLoad) -> float:
        """Prefill the admitted requests, then one batched decode step; the measured seconds."""
        started = time.perf_counter()
        for chunk in batch.prefill:
            self._prefill(chunk.state)
        if batch.decode:
            self._decode(batch.decode)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed_s = time.perf_counter() - started
        self.forward_s += elapsed_s
        self.num_forwards += 1
        return elapsed_s

    def _prefill(self, state: ReqState) -> None:
        record, table = self._records[state.req_idx], state.table
        num_tokens = table.num_tokens
        assert record.num_ids == num_tokens and table.num_live_tokens == num_tokens, "prefill of a partial request"
        record.evicted_at[:] = NEVER  # a (re)prefill recomputes every token with full attention
        record.num_exact_from = len(record.logprobs)
        record.scores = self._new_scores(record)
        out = self.decoder.prefill(self._tensor(record.token_ids[:num_tokens]), self._tensor(table.slots()))
        self._emit([record], out.logprobs)
        if record.scores is not None:
            record.scores.add(np.arange(num_tokens), out.attention[0].cpu().numpy(), np.arange(1, num_tokens + 1))

    def _decode(self, states: Sequence[ReqState]) -> None:
        records = [self._records[s.req_idx] for s in states]
        tables = [s.table for s in states]
        key_slots, num_keys = _padded_slots(tables)
        positions = np.array([t.num_tokens - 1 for t in tables])
        assert all(r.num_ids == t.num_tokens for r, t in zip(records, tables)), "decode out of step with the tables"
        token_ids = np.array([r.token_ids[p] for r, p in zip(records, positions)])
        out = self.decoder.decode(self._tensor(token_ids), self._tensor(positions), self._tensor(key_slots),
                                  self._tensor(num_keys))
        self._emit(records, out.logprobs)
        attention = out.attention[:, 0].cpu().numpy() if out.attention is not None else None
        for row, (record, table) in enumerate(zip(records, tables)):
            if table.num_live_tokens < table.num_tokens:
                record.note_hidden(table.live_mask, int(positions[row]))
            if record.scores is not None:
                record.scores.add(table.live_token_ids(), attention[row : row + 1, : num_keys[row]], num_keys[row : row + 1])

    def _emit(self, records: Sequence[_Record], logprobs: torch.Tensor) -> None:
        """Greedy: the most likely token of each row, with its log-probability."""
        values, indices = logprobs.max(dim=-1)
        for record, token_id, value in zip(records, indices.tolist(), values.tolist()):
            record.append(token_id, value)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, device=self.device)

    def _new_scores(self, record: _Record) -> AttentionStats | None:
        if not self.collect_scores:
            return None
        return AttentionStats(self._num_heads_layers, self.importance_window)

    # ---- what the runtime asks -------------------------------------------------------------

    def attention_stats(self, req_idx: int, token_ids: np.ndarray, num_tokens: int,
                        fields: tuple[str, ...] = SCORE_FIELDS) -> TokenScores:
        """(attention_sum, attention_last, importance_count) of `token_ids`, as of the latest
        query (position num_tokens - 1: the hf executor never fuses steps). All three, whatever
        `fields`: they are accumulated anyway."""
        scores = self._records[req_idx].scores
        if scores is None:
            raise ConfigError("the policy needs attention scores but the hf executor was built with collect_scores=False")
        return scores.of(token_ids)

    def forget(self, req_idx: int) -> None:
        """The request left: drop its scores (its tokens and log-probabilities stay for `outputs`)."""
        self._records[req_idx].scores = None

    def outputs(self) -> tuple[RequestOutput, ...]:
        return tuple(record.output() for record in self._records)


def _padded_slots(tables: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Each table's live slots (Eq. 2) in logical order, one row per table, padded with the
    row's last slot: ([B, Lmax] slots, [B] number of live slots)."""
    slots = [t.slots() for t in tables]
    num_keys = np.array([s.size for s in slots])
    key_slots = np.empty((len(slots), int(num_keys.max())), dtype=np.int64)
    for row, (table, row_slots) in enumerate(zip(tables, slots)):
        new_token = table.num_tokens - 1
        assert row_slots[-1] == table.token_slots[new_token], \
            f"request {table.req_id}: the new token is not the last live slot"
        key_slots[row, : row_slots.size] = row_slots
        key_slots[row, row_slots.size :] = row_slots[-1]
    return key_slots, num_keys


# ---- building and running --------------------------------------------------------------


def build_hf_runtime(run: Run, requests: Sequence[Request], model: LoadedModel, *,
                     make_copy_engine: Callable[[PagedKVCache], CopyEngine] | None = None,
                     observer: RuntimeObserver | None = None, collect_scores: bool | None = None,
                     planner_factory: PlannerFactory = Reclaimer, table_factory: TableFactory = TokenTable) -> Runtime:
    """A runtime whose executor runs `model` and whose copy engine moves the model's KV.

    `requests` are prepared here (prompt text tokenized, or seeded random ids); the executor
    (`runtime.executor`, an HFExecutor) keeps the outputs and owns the KV tensor
    (`runtime.executor.kv_cache`). `make_copy_engine(kv_cache)` builds the copy engine
    (default: synchronous). The experiment's model is replaced by the loaded model's KV geometry;
    `collect_scores` defaults to whether the variant evicts with a policy that needs attention.
    `observer`, `planner_factory` and `table_factory` go to the runtime (the checker's parts).
    """
    prepared = prepare_requests(requests, model.tokenizer, run.experiment.seed)
    experiment = whole_prompts(replace(run.experiment, model=model.spec), prepared.requests)
    if collect_scores is None:
        collect_scores = run.spec.evicts and make_policy(experiment.eviction.policy).needs_attention
    executor = HFExecutor(model, prepared, experiment.num_blocks, experiment.block_size, collect_scores=collect_scores,
                          importance_window=experiment.sim.importance_window)
    copy_engine = make_copy_engine(executor.kv_cache) if make_copy_engine else CopyEngine(executor.kv_cache, "sync")
    return Runtime(Run(experiment, run.spec), prepared.requests, executor, copy_engine=copy_engine, observer=observer,
                   planner_factory=planner_factory, table_factory=table_factory)


def whole_prompts(experiment: Experiment, requests: Sequence[Request]) -> Experiment:
    """The executor computes whole prompts: chunked prefill off, and a token budget that holds
    the longest request, as vLLM sets it then (`max(max_model_len, default)`, vllm/engine/
    arg_utils.py `_set_default_max_num_seqs_and_batched_tokens_args`)."""
    experiment = experiment.with_scheduler_defaults()
    longest = max((r.num_prompt_tokens + r.num_output_tokens for r in requests), default=1)
    scheduler = replace(experiment.scheduler, enable_chunked_prefill=False,
                        max_num_batched_tokens=max(experiment.scheduler.max_num_batched_tokens, longest))
    return replace(experiment, scheduler=scheduler)


@dataclass(frozen=True)
class HFRun:
    """One variant replayed on the model."""

    result: RunResult
    outputs: tuple[RequestOutput, ...]
    forward_s: float  # measured forward wall time, all iterations
    num_forwards: int
    collects_scores: bool
    notes: tuple[str, ...]


def run_hf(run: Run, requests: Sequence[Request], model: LoadedModel, *,
           collect_scores: bool | None = None, copy_mode: str = "sync",
           on_progress: Callable[[int], None] | None = None) -> HFRun:
    """Replay `requests` through `run` on the model."""
    runtime = build_hf_runtime(run, requests, model, make_copy_engine=lambda kv: CopyEngine(kv, copy_mode),
                               collect_scores=collect_scores)
    executor: HFExecutor = runtime.executor
    result = runtime.run(on_progress)
    return HFRun(result, executor.outputs(), executor.forward_s, executor.num_forwards, executor.collect_scores, executor.notes)


def default_num_blocks(requests: Sequence[Request], concurrency: int | None, block_size: int) -> int:
    """Enough blocks for the `concurrency` longest requests at full length, plus one."""
    lengths = sorted((r.num_prompt_tokens + r.num_output_tokens for r in requests), reverse=True)
    resident = lengths[: concurrency or len(lengths)]
    return sum(-(-n // block_size) for n in resident) + 1
