"""Every default of vtoken's commands and library entry points, written once.

Pure constants: this module imports nothing, so the CLI can build its `--help` from it without
torch, and any layer may read it. Where one command's default differs from another's, each has
its own name here and a comment saying why; changing a value here changes results (the golden
CLI tests pin them).
"""

# ---- what is simulated -------------------------------------------------------------------------

MODEL = "llama-3.1-8b"  # a catalog name of vtoken.model_spec.MODELS
GPU = "h100-80gb"  # a catalog name of vtoken.hardware.GPUS
GPU_MEMORY_UTILIZATION = 0.9  # share of GPU memory for weights + KV: vLLM's gpu_memory_utilization default
BLOCK_SIZE = 16  # tokens per KV block: vLLM's default on CUDA
# vLLM's CPU attention kernels need a block size that is a multiple of 32: the default of
# `vtoken serve`, the vLLM settings and `check-invariants --executor vllm`.
VLLM_BLOCK_SIZE = 32

# ---- scheduling (vLLM V1) ----------------------------------------------------------------------

# What vLLM 0.32 gives a server (`vllm serve`, UsageContext.OPENAI_API_SERVER) that sets none of
# them, by the GPU's memory: vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults. Rows are
# (least device memory in GiB, max_num_batched_tokens, max_num_seqs); the first row the GPU
# reaches applies. That function excludes A100s from the 70 GiB row (vLLM PR #17885: a larger
# token budget lowers their throughput), hence the name check in engine/scheduler_config.py.
# Used when vLLM cannot be read (`engine.scheduler_config.vllm_batch_defaults`).
VLLM_BATCH_DEFAULTS = ((160, 16384, 1024), (70, 8192, 1024), (0, 2048, 256))
VLLM_BATCH_DEFAULTS_NOT_70GIB = ("a100",)  # device names that never take the 70 GiB row
# vllm/config/scheduler.py SchedulerConfig: `enable_chunked_prefill: bool = True` (and
# ModelConfig.is_chunked_prefill_supported is True for decoder-only generate models), and
# `long_prefill_token_threshold: int = 0` (0: no cap on a prompt chunk).
ENABLE_CHUNKED_PREFILL = True
LONG_PREFILL_TOKEN_THRESHOLD = 0

# ---- eviction ----------------------------------------------------------------------------------

POLICY = "h2o"  # a name of vtoken.policies.POLICIES
# Inside vLLM (`vtoken serve`, additional_config): a policy that needs no attention scores, so
# that it runs on any attention backend (the score wrapper exists for the CPU backend only).
VLLM_POLICY = "streaming_llm"
BUDGET = "50%"  # tokens each request keeps, as vtoken.policies.base.Budget.parse reads it
NUM_SINK_TOKENS = 4  # protected first tokens
NUM_RECENT_TOKENS = 64  # protected most recent tokens
EVICTION_INTERVAL_TOKENS = 32  # the policy runs after prefill and every this many generated tokens

# ---- reclamation -------------------------------------------------------------------------------

RECLAIM_MODE = "hole-fill"  # a name of vtoken.kv.reclaim.RECLAIM_MODES
THETA_F = 0.25  # reclaim only when the pool's waste ratio F is at least this
# check-invariants: low, so that many relocations run and every one of them is checked.
CHECK_THETA_F = 0.05
RECLAIM_INTERVAL_STEPS = 4  # reclaim eligibility is checked every this many engine iterations
RECLAIM_BATCH_BLOCKS = 64  # B: source blocks one request's relocation plan takes at most
# A lazy reclamation round moves at most this many tokens a step (one request's plan at least,
# B x S = 1,024 tokens at most) and goes on at the next steps: about 0.6-1 ms of host
# bookkeeping (bench_substrate.py), and for Llama-3.1-8B on an H100 a 0.2 ms copy, inside the
# sim's 0.5 ms post-forward window. Twice the steady need of 1,024 requests that each lose a
# token every step (hole-fill moves about one token per dead one).
RECLAIM_MOVES_PER_STEP = 2048
# `--reclaim-budget auto`: a lazy round step moves at most this many tokens per millisecond of
# the step it follows (vtoken.kv.reclaim.StepShare): 0.5% of that step at 0.5 us of host
# bookkeeping a moved token, a 33.6 ms step of 64 requests x 8K tokens 336 moves.
RECLAIM_MOVES_PER_STEP_MS = 10.0
# check-invariants: every iteration, so that as many relocations as possible run and are checked.
CHECK_RECLAIM_INTERVAL_STEPS = 1
# Inside vLLM: every iteration; a compaction runs after every eviction there anyway, and this
# only gates handing the blocks it emptied back to vLLM's pool.
VLLM_RECLAIM_INTERVAL_STEPS = 1

# ---- load --------------------------------------------------------------------------------------

CONCURRENCY = 16  # closed-loop clients of `compare`'s headline run and of `audit`
# check-invariants: fewer clients; its default block budget is sized from the `concurrency`
# largest requests, so a smaller batch keeps the pool small and every checked run short.
CHECK_CONCURRENCY = 8
CONCURRENCIES = (1, 2, 4, 8, 12, 16, 22, 32, 48)  # of `compare`'s sweep and capacity frontier
FRONTIER_MAX_CONCURRENCY = 64  # largest concurrency `audit`'s capacity search tries

# ---- SLA ---------------------------------------------------------------------------------------

SLA_METRIC = "e2e"  # the latency the SLA is set on: e2e, ttft or tpot
SLA_FACTOR = 1.05  # SLA = factor x naive-evict p95 at the reference concurrency
SLA_REF_CONCURRENCY = 8  # the reference concurrency C_ref of the SLA

# ---- runs --------------------------------------------------------------------------------------

EXECUTOR = "sim"  # the cost model: no model weights, any trace length
TRACE_FORMAT = "auto"  # detected from the file (vtoken.trace.detect_format)
SEED = 0
REPEATS = 1
# A real engine's (hf, vllm) measurement: rounds that alternate the variants, after warm-up
# replays of every variant whose figures are dropped (vtoken.rounds). The sim takes 1 and 0.
MEASURED_ROUNDS = 3
MEASURED_WARMUP = 1
# In sample_traces/: what `audit` and `check-invariants --executor vllm` replay when given no trace.
SAMPLE_TRACE = "azure_conv_sample.csv"
SCRAPE_TIMEOUT_S = 5.0  # how long reading a server's /metrics and /v1/models may take
WATCH_INTERVAL_S = 2.0  # seconds between two refreshes of `audit --watch`

# ---- vtoken serve ------------------------------------------------------------------------------

VARIANT = "vtoken"  # what `vtoken serve` and a vLLM engine given no variant run

SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8000
SERVE_KV_CACHE_BYTES = 1 << 30  # vLLM's --kv-cache-memory-bytes: 1 GiB, enough for a small model on CPU
SERVE_DTYPE = "auto"
