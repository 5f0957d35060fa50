"""How far SmolLM2 in vLLM (fp32, CPU) is from transformers, and how much of that is vToken's.
A measurement, not a test (tests/vllm_tier/test_smollm2.py asserts the bound).

    .venv-vllm/bin/python benchmarks/exactness_vllm.py
    .venv-vllm/bin/python benchmarks/exactness_vllm.py --llm-kwargs '{"compilation_config": {"custom_ops": ["none"]}}'

The prompts, the eviction settings and the variants are those of test_smollm2.py (3 requests
decoding 16 tokens together, three of the variants evicting every 8 tokens). For each variant,
max |log p(vLLM) - log p(reference)| over every generated token, against:

    fp32  the reference the tests use: transformers fp32, eager attention, the engine's
          evictions replayed as an attention mask, log-softmax in float64
    fp64  the same reference run in float64 (the closest thing to exact)

and, for scale, transformers fp32 against transformers fp64 on the same tokens (native's).
`--llm-kwargs` adds keyword arguments to vllm.LLM (a setting to try).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the prompts and settings of the test

from tests.vllm_tier.test_smollm2 import CONFIGS, TEXTS, settings  # noqa: E402
from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of  # noqa: E402
from vtoken.engine.vllm.reference import load_reference_model, reference_logprobs  # noqa: E402
from vtoken.models.smollm2 import smollm2_dir  # noqa: E402


def max_error(generations, reference) -> float:
    return max(float(np.abs(np.array(g.logprobs) - reference_logprobs(reference, g.prompt_ids, g.token_ids, g.events)).max())
               for g in generations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm-kwargs", default="{}", help="JSON: extra keyword arguments of vllm.LLM")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = str(smollm2_dir())
    prompt_ids = [AutoTokenizer.from_pretrained(model_dir)(text).input_ids for text in TEXTS]
    ref32 = load_reference_model(model_dir)
    ref64 = load_reference_model(model_dir).double()
    spec = EngineSpec(model_dir, kv_cache_memory_bytes=128 << 20, max_model_len=1024,
                      extra_llm_kwargs=json.loads(args.llm_kwargs))
    print(f"{'variant / policy / mode':<38} {'vs fp32':>9} {'vs fp64':>9}")
    with open_llm(spec, settings(*CONFIGS[0]), record_events=True) as llm:
        for config in CONFIGS:
            scheduler_of(llm).reconfigure(settings(*config))
            generations = generate(llm, prompt_ids, 16)
            print(f"{' / '.join(config):<38} {max_error(generations, ref32):>9.2e} {max_error(generations, ref64):>9.2e}", flush=True)
            if config[0] == "native":
                native = generations
    fp32_vs_fp64 = max(float(np.abs(reference_logprobs(ref32, g.prompt_ids, g.token_ids) - reference_logprobs(ref64, g.prompt_ids, g.token_ids)).max())
                       for g in native)
    print(f"{'transformers fp32 vs fp64':<38} {fp32_vs_fp64:>9.2e}")


if __name__ == "__main__":
    main()
