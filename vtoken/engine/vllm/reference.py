"""The transformers reference an evicting engine must reproduce, token for token.

One forward over the whole sequence (prompt + generated tokens but the last), with
`position_ids = arange(T)` and a 4-D mask (additive: 0 or the dtype's minimum) whose row t (the query at position t) hides
every token evicted before the step that computed t. An eviction recorded at KV length n
applies to the queries at positions >= n:

    row t, key k:   visible  <=>  k <= t  and  not (k evicted at some length n <= t)

A preempted request is recomputed from all its tokens, so its KV is rebuilt without evictions
and the same tokens are evicted again at the resume length R. The output tokens sampled after a
resume come from a second forward whose rows below R hide nothing ("epochs" below).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vtoken.engine.vllm.tracker import EvictionEvent


def visibility_mask(num_tokens: int, events: Sequence[EvictionEvent], resume_len: int = 0) -> torch.Tensor:
    """bool [T, T]: row t may attend to key k. Rows below `resume_len` hide nothing."""
    evicted_at = np.full(num_tokens, np.iinfo(np.int64).max, dtype=np.int64)  # first length that hides k
    for event in events:
        if event.is_resume:
            continue
        ids = event.token_ids[event.token_ids < num_tokens]
        evicted_at[ids] = np.minimum(evicted_at[ids], event.num_tokens)
    rows = np.arange(num_tokens)[:, None]
    hides = (rows >= np.maximum(evicted_at[None, :], resume_len))
    visible = (np.arange(num_tokens)[None, :] <= rows) & ~hides
    return torch.from_numpy(visible)


def reference_logprobs(model, prompt_ids: Sequence[int], output_ids: Sequence[int],
                       events: Sequence[EvictionEvent] = ()) -> np.ndarray:
    """float64 [len(output_ids)]: log p(output j) as an engine with these evictions computes it.

    `model` is a transformers causal LM (fp32, eager attention for exactness).
    """
    tokens = list(prompt_ids) + list(output_ids)
    num_prompt = len(prompt_ids)
    num_inputs = len(tokens) - 1
    logprobs = np.zeros(len(output_ids), dtype=np.float64)
    resumes = [0] + [e.num_tokens for e in events if e.is_resume]
    for epoch, resume_len in enumerate(resumes):
        end_len = resumes[epoch + 1] if epoch + 1 < len(resumes) else num_inputs + 1
        rows = np.arange(max(num_prompt - 1, resume_len - 1), min(end_len - 1, num_inputs))
        if rows.size == 0:
            continue
        row_logprobs = _forward_logprobs(model, tokens, visibility_mask(num_inputs, events, resume_len))
        logprobs[rows - (num_prompt - 1)] = row_logprobs[rows]
    return logprobs


@torch.no_grad()
def _forward_logprobs(model, tokens: list[int], visible: torch.Tensor) -> np.ndarray:
    """log p(tokens[t + 1] | row t) for the rows t of tokens[:-1], under `visible` [T-1, T-1]."""
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    inputs = ids[:, :-1]
    positions = torch.arange(inputs.shape[1], device=device)[None, :]
    # An additive mask: transformers 5 reads a 4-D boolean mask differently across versions.
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None].to(device)
    logits = model(input_ids=inputs, position_ids=positions, attention_mask=mask).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0].cpu().numpy()


def load_reference_model(model_dir: str):
    """fp32, eager attention (honours any 4-D mask exactly)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
