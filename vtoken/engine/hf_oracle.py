"""Checks of what the hf executor generated: the reference forward, agreement between
variants, and output quality against native.

The reference (VLLM.md, "A reference that catches any mistake"): transformers itself over
the full prompt + generated sequence, position_ids = arange(T), and a 4-D boolean mask whose
row t hides the tokens evicted before query t:

    allowed[t, j] = j <= t  and  evicted_at[j] > t

An engine that writes, moves and reads its paged KV correctly computes exactly this; in fp32
its log-probabilities agree with the reference to about 1e-5 (SmolLM2) or 1e-6 (tiny model).

ROUGE-L F1 is over whitespace-separated words of the text generated before the first EOS,
LCS by dynamic programming.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vtoken.engine.hf import RequestOutput
from vtoken.models import LoadedModel


@torch.inference_mode()
def reference_logprobs(model: LoadedModel, output: RequestOutput) -> np.ndarray:
    """Log-probability the reference gives each generated token, [generated]."""
    fed = output.token_ids[:-1]  # the last generated token was never fed back
    num_fed = fed.size
    device = next(model.model.parameters()).device
    positions = torch.arange(num_fed, device=device)
    hidden_from = torch.as_tensor(output.evicted_at[:num_fed], device=device)
    allowed = (positions[None, :] <= positions[:, None]) & (hidden_from[None, :] > positions[:, None])
    hidden = model.model.model(input_ids=torch.as_tensor(fed, device=device)[None], attention_mask=allowed[None, None],
                               position_ids=positions[None]).last_hidden_state[0]
    first_row = output.num_prompt_tokens - 1
    logits = model.model.lm_head(hidden[first_row:])
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    generated = torch.as_tensor(output.generated_ids, device=device)
    return logprobs[torch.arange(generated.numel(), device=device), generated].double().cpu().numpy()


def max_reference_error(model: LoadedModel, outputs: Sequence[RequestOutput]) -> float:
    """max |engine - reference| log-probability over every generated token that no preemption
    recomputed away (`RequestOutput.num_exact_from`)."""
    worst = 0.0
    for output in outputs:
        if output.logprobs.size == 0:
            continue
        diff = np.abs(output.logprobs - reference_logprobs(model, output))[output.num_exact_from :]
        worst = max(worst, float(diff.max(initial=0.0)))
    return worst


@dataclass(frozen=True)
class Agreement:
    """Two runs that made the same eviction decisions should generate the same thing."""

    num_requests: int
    num_identical: int  # requests with the same generated token ids
    max_abs_logprob_diff: float  # over the common prefix of generated tokens


def agreement(a: Sequence[RequestOutput], b: Sequence[RequestOutput]) -> Agreement:
    num_identical, worst = 0, 0.0
    for x, y in zip(a, b):
        gx, gy = x.generated_ids, y.generated_ids
        num_identical += int(np.array_equal(gx, gy))
        common = _common_prefix(gx, gy)
        if common:
            worst = max(worst, float(np.abs(x.logprobs[:common] - y.logprobs[:common]).max()))
    return Agreement(len(a), num_identical, worst)


def _common_prefix(x: np.ndarray, y: np.ndarray) -> int:
    n = min(x.size, y.size)
    differs = np.flatnonzero(x[:n] != y[:n])
    return int(differs[0]) if differs.size else n


# ---- quality against native ----------------------------------------------------------------


@dataclass(frozen=True)
class Quality:
    num_requests: int
    rouge_l_f1: float  # mean over requests, against native's text
    length_ratio: float  # mean over requests of (tokens before EOS) / native's; nan if native's are all empty


def quality_vs_native(native: Sequence[RequestOutput], other: Sequence[RequestOutput], model: LoadedModel) -> Quality:
    eos_ids = model.eos_token_ids
    scores, ratios = [], []
    for ref, out in zip(native, other):
        ref_ids, out_ids = until_eos(ref.generated_ids, eos_ids), until_eos(out.generated_ids, eos_ids)
        ref_words = model.tokenizer.decode(ref_ids, skip_special_tokens=True).split()
        out_words = model.tokenizer.decode(out_ids, skip_special_tokens=True).split()
        scores.append(rouge_l_f1(out_words, ref_words))
        if ref_ids.size:
            ratios.append(out_ids.size / ref_ids.size)
    return Quality(len(scores), float(np.mean(scores)) if scores else math.nan,
                   float(np.mean(ratios)) if ratios else math.nan)


def until_eos(token_ids: np.ndarray, eos_ids: frozenset[int]) -> np.ndarray:
    is_eos = np.isin(token_ids, np.fromiter(eos_ids, dtype=np.int64, count=len(eos_ids)))
    return token_ids[: int(np.argmax(is_eos))] if is_eos.any() else token_ids


def rouge_l_f1(candidate: Sequence, reference: Sequence) -> float:
    """ROUGE-L F1 = 2PR / (P + R), P = LCS / |candidate|, R = LCS / |reference|; 1.0 for two
    empty sequences, 0.0 when only one is empty."""
    if not candidate and not reference:
        return 1.0
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence, O(|a| |b|) time, O(|b|) memory."""
    previous = [0] * (len(b) + 1)
    for item in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if item == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]
