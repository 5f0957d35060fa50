"""The vLLM names the integration relies on that vLLM does not promise to keep.

`missing_names()` imports each module and looks each name up; a test fails with the list of
what is gone, so an upgrade that breaks the integration says where before anything runs. The
second list holds attributes of live objects (set in `__init__`), checked on a running engine
with `missing_instance_names`; the third, code the plugin's hook depends on, with
`missing_source_texts`.
"""

from __future__ import annotations

import importlib

VLLM_VERSION = "0.32.0"

# (module, dotted attribute) pairs the integration reads, overrides or calls.
MODULE_NAMES: tuple[tuple[str, str], ...] = (
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.add_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._free_request_blocks"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.get_num_unfinished_requests"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids"),
    ("vllm.v1.core.block_pool", "BlockPool.free_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks"),
    ("vllm.v1.request", "RequestStatus.RUNNING"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.init_device"),
    ("vllm.v1.worker.gpu_worker", "Worker.init_device"),
    ("vllm.v1.worker.block_table", "MultiGroupBlockTable.compute_slot_mapping"),
    ("vllm.v1.worker.block_table", "BlockTable.get_device_tensor"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend.get_impl_cls"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward"),
    ("vllm.v1.attention.backends.registry", "register_backend"),
    ("vllm.v1.attention.backends.registry", "AttentionBackendEnum.CPU_ATTN"),
    ("vllm.v1.attention.selector", "_cached_get_attn_backend.cache_clear"),
    ("vllm._custom_ops", "cpu_attn_reshape_and_cache"),
    # the plugin (plugin.py): vLLM loads the group, and the platform hook sees every new config
    ("vllm.plugins", "DEFAULT_PLUGINS_GROUP"),
    ("vllm.plugins", "load_general_plugins"),
    ("vllm.platforms.interface", "Platform.check_and_update_config"),
    ("vllm.config.scheduler", "SchedulerConfig.get_scheduler_cls"),
    ("vllm.config.vllm", "VllmConfig.use_v2_model_runner"),
)

# What the plugin relies on beyond names: (module, function, text its source must contain).
SOURCE_TEXTS: tuple[tuple[str, str, str], ...] = (
    ("vllm.config.vllm", "VllmConfig.__post_init__", "current_platform.check_and_update_config(self)"),
    ("vllm.engine.arg_utils", "EngineArgs.__post_init__", "load_general_plugins()"),
    ("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", 'parallel_config.worker_cls == "auto"'),
    ("vllm.platforms.cuda", "CudaPlatformBase.check_and_update_config", 'parallel_config.worker_cls == "auto"'),
)

# Attributes of live objects, checked on an engine: (what, dotted path from that object).
INSTANCE_NAMES: tuple[tuple[str, str], ...] = (
    ("scheduler", "kv_cache_manager.coordinator.single_type_managers"),
    ("scheduler", "kv_cache_manager.block_pool.num_gpu_blocks"),
    ("scheduler", "requests"),
    ("scheduler", "block_size"),
    ("runner", "requests"),
    ("runner", "input_batch.req_ids"),
    ("runner", "input_batch.num_reqs"),
    ("runner", "input_batch.req_id_to_index"),
    ("runner", "input_batch.block_table"),
    ("runner", "input_batch.block_table.block_tables"),
    ("runner", "positions"),
    ("runner", "seq_lens"),
    ("runner", "optimistic_seq_lens_cpu"),
    ("runner", "req_indices"),
    ("runner", "query_start_loc"),
    ("runner", "kv_caches"),
    ("runner", "compilation_config.static_forward_context"),
)


def missing_names() -> list[str]:
    """'module:name' for every entry of MODULE_NAMES that cannot be found."""
    missing = []
    for module_name, dotted in MODULE_NAMES:
        try:
            _lookup(importlib.import_module(module_name), dotted)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{module_name}:{dotted} ({type(exc).__name__}: {exc})")
    return missing


def missing_source_texts() -> list[str]:
    """'module:function' for every entry of SOURCE_TEXTS whose source lacks its text. Read from
    the file, not imported: the CUDA platform module does not import on a CPU build."""
    missing = []
    for module_name, dotted, text in SOURCE_TEXTS:
        source = _function_source(module_name, dotted)
        if source is None:
            missing.append(f"{module_name}:{dotted} not found")
        elif text not in source:
            missing.append(f"{module_name}:{dotted} no longer contains {text!r}")
    return missing


def _function_source(module_name: str, dotted: str) -> str | None:
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return None
    text = Path(spec.origin).read_text()
    nodes: list[ast.AST] = [ast.parse(text)]
    for part in dotted.split("."):
        nodes = [n for parent in nodes for n in getattr(parent, "body", [])
                 if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part]
    return ast.get_source_segment(text, nodes[0]) if nodes else None


def missing_instance_names(objects: dict[str, object]) -> list[str]:
    """'what.name' for every entry of INSTANCE_NAMES missing on `objects[what]`."""
    missing = []
    for what, dotted in INSTANCE_NAMES:
        try:
            _lookup(objects[what], dotted)
        except AttributeError as exc:
            missing.append(f"{what}.{dotted} ({exc})")
    return missing


def _lookup(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
