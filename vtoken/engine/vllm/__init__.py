"""vToken inside vLLM: a scheduler and a worker that plug into stock vLLM 0.32 (no fork, no patches).

With vtoken installed, vLLM's plugin entry point (plugin.py) turns it on from the additional
config alone; the other flags are the settings vToken needs, refused at start when missing:

    python -m vllm.entrypoints.openai.api_server --model MODEL --block-size 32 --enforce-eager \
        --additional-config '{"vtoken": {"variant": "vtoken", "policy": "streaming_llm"}}'

(on CUDA also --no-async-scheduling and VLLM_USE_V2_MODEL_RUNNER=0; `--scheduler-cls
vtoken.engine.vllm.scheduler.VTokenScheduler --worker-cls vtoken.engine.vllm.worker.VTokenWorker`
does the same without the plugin. `vtoken serve MODEL` builds the line and its environment:
serve.py.)

Modules, in data-flow order:

    settings     additional_config["vtoken"] -> VllmSettings                       (no vLLM)
    tracker      token tables, policy, compaction, block release, counters         (no vLLM)
    prefix_cache protected prefixes and dropped hashes with vLLM's prefix caching  (no vLLM)
    compaction   dense packing plans (hole-fill, ordered), naive block counts      (no vLLM)
    scores       attention statistics for H2O / Scissorhands / TOVA                (no vLLM)
    plan         StepPlan: what the scheduler sends the worker each step            (no vLLM)
    scheduler    VTokenScheduler: glue to vLLM's scheduler and KV manager
    worker       VTokenWorker / runner mixin: KV moves, physical lengths, scores
    kv_layout    token copies in the per-ISA CPU layout and the CUDA flash layout
    attention    the scoring wrapper of the CPU attention backend
    metrics      vtoken_* Prometheus metrics                                       (no vLLM)
    support      configurations refused at start-up                                (no vLLM)
    plugin       the vllm.general_plugins entry point: additional_config -> vToken classes
    engine       in-process engines (tests, compare, benchmarks)
    run          replaying a trace per variant: compare and check-invariants on vLLM
    reference    the transformers reference with the eviction mask
    serve        the server command line and environment
    contract     the vLLM private names relied upon
    tiny_model   a tiny random Llama that vLLM's CPU kernels accept

Importing this package, or any module marked "no vLLM", does not import vLLM.
"""
