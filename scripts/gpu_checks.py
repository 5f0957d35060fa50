"""GPU checks of the vLLM integration (issue 7, item 8), for a machine with a CUDA GPU.

    python scripts/gpu_checks.py --out DIR        (scripts/gpu_checks.sh wraps it)

Each check prints one line and writes DIR/gpu_checks.json; a check that cannot run (no vLLM with
CUDA, no SmolLM2) is reported as skipped with the reason, never as passed.

1. copy-layout   cuda_slot_copy on a [2, blocks, block, heads, dim] tensor, on a side stream with
                 an event the compute stream waits on, equals plain indexing byte for byte
2. copy-kernel   (vLLM) the same against vLLM's reshape_and_cache_flash writing the tokens at the
                 destinations, byte for byte
3. exactness     (vLLM) tiny Llama, fp16: native, naive-evict and vtoken (StreamingLLM, both
                 reclaim modes) against the transformers reference with the eviction mask
4. plugin-launch (vLLM) a plain `python -m vllm.entrypoints.openai.api_server` with
                 --additional-config '{"vtoken": ...}' (the vllm.general_plugins entry point; vtoken
                 must be pip-installed), prefix caching on and no PROMETHEUS_MULTIPROC_DIR: one
                 completion, vtoken_* evictions at /metrics; and the same launch without
                 --no-async-scheduling exits at start with the one `vtoken:` line
5. prefix-cache  (vLLM) tiny Llama, fp16, prefix caching on: a hit after a miss gives the miss's
                 tokens (prompt protection), a compacted prompt is never a hit (shared protection),
                 two concurrent sharers agree; each against the reference like check 3
6. soak          (vLLM) the vLLM tier's soak (tests/vllm_tier/soak.py) against a plain launch:
                 24 streaming clients for 45 s, a quarter disconnecting, a 40-block pool; nothing
                 failed or hung, vtoken_invariant_violations_total 0, the pool empty afterwards
7. tensor-parallel (vLLM, 2 GPUs) tiny Llama at --tensor-parallel-size 2, StreamingLLM, against
                 the reference (H2O's attention rows are collected on the CPU backend only; their
                 reduction over the TP group is tested on two CPU ranks); skipped on one GPU
8. speed         (vLLM + SmolLM2) benchmarks/bench_vllm.py at batch 4, fp16, block size 16
9. calibrate     (vLLM + SmolLM2) `vtoken calibrate --executor vllm` on the GPU (DIR/gpu-smollm2.toml,
                 its plot and steps), then `vtoken validate examples/validation_trace.jsonl` against
                 it: passes when every validated figure of native and vtoken is within 10%
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def check_copy_layout() -> dict:
    from vtoken.engine.vllm.kv_layout import cuda_slot_copy

    g = torch.Generator(device="cuda").manual_seed(0)
    blocks, block_size, heads, dim = 64, 16, 8, 128
    kv = torch.randn(2, blocks, block_size, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(blocks * block_size, device="cuda", generator=g)[:2048]
    src, dst = slots[:1024], slots[1024:]
    expected = kv.clone().view(2, -1, heads, dim)
    expected[:, dst] = expected[:, src]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.cuda.stream(stream):
        num_bytes = cuda_slot_copy([kv], src, dst, block_size)
        done = torch.cuda.Event()
        done.record(stream)
    torch.cuda.current_stream().wait_event(done)
    result = kv.view(2, -1, heads, dim).clone()  # on the compute stream: after the event
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    ok = torch.equal(result.view(torch.int16), expected.view(torch.int16))
    return {"passed": ok, "bytes": num_bytes, "GB_per_s": num_bytes / elapsed / 1e9}


def check_copy_kernel() -> dict:
    try:
        from vllm import _custom_ops as ops
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"vLLM with CUDA not importable: {exc}"}
    from vtoken.engine.vllm.kv_layout import cuda_slot_copy

    blocks, block_size, heads, dim = 32, 16, 4, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    key = torch.randn(200, heads, dim, device="cuda", generator=g, dtype=torch.float16)
    value = torch.randn(200, heads, dim, device="cuda", generator=g, dtype=torch.float16)
    slots = torch.randperm(blocks * block_size, device="cuda", generator=g)[:400]
    src, dst = slots[:200], slots[200:]
    moved = torch.zeros(2, blocks, block_size, heads, dim, device="cuda", dtype=torch.float16)
    expected = moved.clone()
    scale = torch.ones((), device="cuda")

    def write(cache, at):
        ops.reshape_and_cache_flash(key, value, cache[0], cache[1], at, "auto", scale, scale)

    write(moved, src)
    cuda_slot_copy([moved], src, dst, block_size)
    write(expected, src)
    write(expected, dst)
    return {"passed": torch.equal(moved.view(torch.int16), expected.view(torch.int16))}


def check_exactness() -> dict:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"vLLM not importable: {exc}"}
    import numpy as np

    from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of
    from vtoken.engine.vllm.reference import reference_logprobs
    from vtoken.engine.vllm.settings import settings_from_additional_config
    from vtoken.engine.vllm.tiny_model import make_tiny_llama
    from transformers import AutoModelForCausalLM

    model_dir = str(make_tiny_llama(Path("/tmp/vtoken-gpu-tiny")))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (50, 70, 90)]
    errors = {}
    spec = EngineSpec(model_dir, block_size=16, kv_cache_memory_bytes=64 << 20, max_model_len=1024, dtype="float16")
    base = {"policy": "streaming_llm", "budget": 40, "num_sink_tokens": 4, "num_recent_tokens": 16,
            "interval_tokens": 8, "theta_f": 0.01, "check_invariants": True}
    with open_llm(spec, settings_from_additional_config({"vtoken": base}), record_events=True) as llm:
        for variant, mode in (("native", "hole-fill"), ("naive-evict", "hole-fill"), ("vtoken", "hole-fill"), ("vtoken", "ordered")):
            scheduler_of(llm).reconfigure(settings_from_additional_config({"vtoken": {**base, "variant": variant, "reclaim_mode": mode}}))
            worst = 0.0
            for gen in generate(llm, prompts, 40):
                expected = reference_logprobs(reference, gen.prompt_ids, gen.token_ids, gen.events)
                worst = max(worst, float(np.abs(np.array(gen.logprobs) - expected).max()))
            errors[f"{variant}/{mode}"] = worst
    native = errors["native/hole-fill"]
    return {"passed": all(e <= max(2 * native, 1e-3) for e in errors.values()), "max_abs_logprob_error": errors,
            "note": "fp16 in vLLM against an fp32 reference: evicting variants must stay within 2x native's error"}


PLUGIN_SETTINGS = {"budget": 48, "num_recent_tokens": 16, "interval_tokens": 8, "theta_f": 0.01}
PLUGIN_START_TIMEOUT_S = 240


def check_plugin_launch(out: Path) -> dict:
    try:
        import vllm  # noqa: F401
        from importlib.metadata import entry_points

        from vtoken.engine.vllm.tiny_model import make_tiny_llama
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"vLLM not importable: {exc}"}
    if not any(e.name == "vtoken" for e in entry_points(group="vllm.general_plugins")):
        return {"passed": False, "error": "no vllm.general_plugins entry point 'vtoken': pip install -e . first"}
    model_dir = str(make_tiny_llama(Path("/tmp/vtoken-gpu-tiny")))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float16", "--block-size", "16", "--kv-cache-memory-bytes", str(64 << 20),
            "--max-model-len", "1024", "--additional-config", json.dumps({"vtoken": PLUGIN_SETTINGS})]
    flags = ["--enforce-eager", "--no-async-scheduling"]  # prefix caching stays on
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    refusal_code, refusal_stderr = _run_group(argv + flags[:1], env, timeout_s=180)
    refusal = [line for line in refusal_stderr.splitlines() if line.startswith("vtoken: ")]
    result = {"refusal_exit_code": refusal_code, "refusal": refusal[:1]}
    with open(out / "plugin_server.log", "wb") as log:
        server = subprocess.Popen(argv + flags, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            result.update(_one_completion_and_metrics(f"http://127.0.0.1:{port}", model_dir, server))
        finally:
            _stop_group(server)
    result["passed"] = (refusal_code not in (0, None) and len(refusal) == 1 and "--no-async-scheduling" in refusal[0]
                        and result.get("completion_tokens") == 40 and result.get("vtoken_tokens_evicted_total", 0) > 0)
    return result


def _tiny_reference():
    from transformers import AutoModelForCausalLM

    from vtoken.engine.vllm.tiny_model import make_tiny_llama

    model_dir = str(make_tiny_llama(Path("/tmp/vtoken-gpu-tiny")))
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()


def _worst_error(reference, generations) -> float:
    import numpy as np

    from vtoken.engine.vllm.reference import reference_logprobs

    return max(float(np.abs(np.array(g.logprobs) - reference_logprobs(reference, g.prompt_ids, g.token_ids,
                                                                        g.events)).max()) for g in generations)


def check_prefix_cache() -> dict:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"vLLM not importable: {exc}"}
    import numpy as np

    from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of
    from vtoken.engine.vllm.settings import settings_from_additional_config

    model_dir, reference = _tiny_reference()
    base = {"policy": "streaming_llm", "budget": 40, "num_recent_tokens": 16, "interval_tokens": 8, "theta_f": 0.01,
            "check_invariants": True}
    spec = EngineSpec(model_dir, block_size=16, kv_cache_memory_bytes=64 << 20, max_model_len=1024, dtype="float16",
                      enable_prefix_caching=True)
    rng = np.random.default_rng(7)
    result = {}
    with open_llm(spec, settings_from_additional_config({"vtoken": base}), record_events=True) as llm:
        for protection in ("prompt", "shared"):
            scheduler_of(llm).reconfigure(settings_from_additional_config({"vtoken": {**base, "prefix_protection": protection}}))
            prompt = rng.integers(3, 500, 136).tolist()
            miss = generate(llm, [prompt], 48)[0]
            hit = generate(llm, [prompt], 48)[0]
            together = generate(llm, [rng.integers(3, 500, 136).tolist()] * 2, 48)
            result[protection] = {"cached_tokens": [miss.num_cached_tokens, hit.num_cached_tokens,
                                                    together[1].num_cached_tokens],
                                  "same_tokens": hit.token_ids == miss.token_ids and together[0].token_ids == together[1].token_ids,
                                  "max_abs_logprob_error": _worst_error(reference, [miss, hit, *together]),
                                  "violations": scheduler_of(llm).vtoken.counters.invariant_violations}
    prompt, shared = result["prompt"], result["shared"]
    result["passed"] = (prompt["cached_tokens"][:2] == [0, 128] and shared["cached_tokens"][:2] == [0, 0]
                        and shared["cached_tokens"][2] == 128 and prompt["same_tokens"] and shared["same_tokens"]
                        and all(r["max_abs_logprob_error"] < 1e-2 and r["violations"] == 0 for r in (prompt, shared)))
    result["note"] = "fp16 against an fp32 reference: errors are fp16's (compare check 3's native)"
    return result


def check_soak(out: Path) -> dict:
    try:
        import vllm  # noqa: F401

        from tests.vllm_tier.soak import Load, run_load
        from vtoken.endpoint import scrape
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"needs vLLM and httpx: {exc}"}
    model_dir, _ = _tiny_reference()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = {"policy": "streaming_llm", "budget": 64, "num_recent_tokens": 16, "interval_tokens": 8,
                "theta_f": 0.01, "prefix_protection": "shared"}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float16", "--block-size", "16", "--kv-cache-memory-bytes", str(64 << 20),
            "--num-gpu-blocks-override", "80", "--max-model-len", "512", "--max-num-seqs", "16", "--enforce-eager",
            "--no-async-scheduling", "--additional-config", json.dumps({"vtoken": settings})]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    base_url = f"http://127.0.0.1:{port}"
    with open(out / "soak_server.log", "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**env, "VLLM_USE_V2_MODEL_RUNNER": "0"})
        try:
            started = _one_completion_and_metrics(base_url, model_dir, server)
            if "error" in started:
                return {"passed": False, **started}
            tally = run_load(base_url, model_dir, Load(duration_s=45, vocab=(3, 500)))
            deadline = time.monotonic() + 120
            while True:
                metrics = scrape(base_url).metrics
                if (metrics.num_requests_running == 0 and metrics.kv_cache_usage == 0.0) or time.monotonic() > deadline:
                    break
                time.sleep(1)
            alive = server.poll() is None
        finally:
            _stop_group(server)
    vtoken = metrics.vtoken_metrics
    return {"passed": alive and not tally.failures and tally.num_hung == 0 and metrics.kv_cache_usage == 0.0
            and vtoken.get("vtoken_invariant_violations_total") == 0 and tally.num_disconnected > 0,
            "summary": tally.summary(45), "failures": tally.failures[:5], "preemptions": metrics.num_preemptions,
            "kv_cache_usage_after": metrics.kv_cache_usage, "vtoken_metrics": vtoken}


def check_tensor_parallel() -> dict:
    if torch.cuda.device_count() < 2:
        return {"skipped": f"--tensor-parallel-size 2 needs 2 GPUs, found {torch.cuda.device_count()}"}
    from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of
    from vtoken.engine.vllm.settings import settings_from_additional_config

    model_dir, reference = _tiny_reference()
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (50, 70, 90)]
    settings = settings_from_additional_config({"vtoken": {"policy": "streaming_llm", "budget": 40,
                                                           "num_recent_tokens": 16, "interval_tokens": 8,
                                                           "theta_f": 0.01, "check_invariants": True}})
    spec = EngineSpec(model_dir, block_size=16, kv_cache_memory_bytes=64 << 20, max_model_len=1024, dtype="float16",
                      extra_llm_kwargs={"tensor_parallel_size": 2})
    with open_llm(spec, settings, record_events=True) as llm:
        generations = generate(llm, prompts, 40)
        counters = scheduler_of(llm).vtoken.counters
    error = _worst_error(reference, generations)
    return {"passed": error < 1e-2 and counters.invariant_violations == 0 and counters.tokens_moved > 0,
            "max_abs_logprob_error": error, "tokens_moved": counters.tokens_moved}


def _run_group(argv: list[str], env: dict, timeout_s: float) -> tuple[int | None, str]:
    """Run argv in its own process group; (exit code, stderr), code None when it ran past timeout_s."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        stderr = process.communicate(timeout=timeout_s)[1]
        return process.returncode, stderr
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        return None, process.communicate()[1]


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group (the server and its engine core), SIGKILL after 60 s."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _one_completion_and_metrics(base_url: str, model: str, server: subprocess.Popen) -> dict:
    deadline = time.monotonic() + PLUGIN_START_TIMEOUT_S
    while True:
        if server.poll() is not None:
            return {"error": f"server exited with {server.returncode} (plugin_server.log)"}
        try:
            urllib.request.urlopen(f"{base_url}/health", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                return {"error": f"server not healthy after {PLUGIN_START_TIMEOUT_S} s (plugin_server.log)"}
            time.sleep(1)
    body = json.dumps({"model": model, "prompt": "the quick brown fox jumps over the lazy dog " * 8, "max_tokens": 40,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    metrics = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    evicted = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vtoken_tokens_evicted_total")]
    return {"completion_tokens": answer["usage"]["completion_tokens"], "vtoken_tokens_evicted_total": sum(evicted),
            "num_vtoken_lines": sum(line.startswith("vtoken_") for line in metrics.splitlines())}


def check_speed(out: Path) -> dict:
    try:
        import vllm  # noqa: F401
        from vtoken.models.smollm2 import smollm2_dir

        model = str(smollm2_dir())
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"needs vLLM and SmolLM2: {exc}"}
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "--model", model, "--dtype", "float16",
            "--block-size", "16", "--json", "--variants", "native,naive-evict,vtoken"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=420)
    (out / "bench_vllm.stderr.txt").write_text(done.stderr[-20000:])
    if done.returncode:
        return {"passed": False, "error": done.stderr[-2000:]}
    result = json.loads(done.stdout)
    ratio = result["results"]["vtoken"]["x_native"]
    return {"passed": ratio <= 1.10, "x_native": ratio, "bench": result}


def check_calibrate(out: Path) -> dict:
    try:
        import vllm  # noqa: F401
        from vtoken.models.smollm2 import smollm2_dir

        smollm2_dir()
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"needs vLLM and SmolLM2: {exc}"}
    profile = out / "gpu-smollm2.toml"
    vtoken = [sys.executable, "-c", "from vtoken_cli.app import main; main()"]
    calibrate = subprocess.run([*vtoken, "calibrate", "--executor", "vllm", "--model", "smollm2-135m", "--rounds", "3",
                                "--output", str(profile), "--json"], capture_output=True, text=True, timeout=600)
    if calibrate.returncode:
        return {"passed": False, "step": "calibrate", "error": calibrate.stderr[-2000:]}
    validate = subprocess.run([*vtoken, "validate", str(ROOT / "examples" / "validation_trace.jsonl"), "--executor",
                               "vllm", "--model", "smollm2-135m", "--sim-profile", str(profile), "--json"],
                              capture_output=True, text=True, timeout=600)
    if validate.returncode:
        return {"passed": False, "step": "validate", "error": validate.stderr[-2000:]}
    printed = json.loads(validate.stdout)
    variants = printed["variants"]
    errors = {f"{v}/{figure}": cell["rel_error"] for v, figures in variants.items() for figure, cell in figures.items()}
    worst = max(errors, key=lambda k: abs(errors[k]))
    return {"passed": abs(errors[worst]) <= 0.10, "largest_error": {worst: errors[worst]},
            "calibration": json.loads(calibrate.stdout), "validation": variants,
            "step_check": printed["steps"]}  # the step model on vLLM's own native steps (GPU drift, grid gaps)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/vtoken-gpu")))
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    checks = [("copy-layout", check_copy_layout), ("copy-kernel", check_copy_kernel), ("exactness", check_exactness),
              ("plugin-launch", lambda: check_plugin_launch(args.out)), ("prefix-cache", check_prefix_cache),
              ("soak", lambda: check_soak(args.out)), ("tensor-parallel", check_tensor_parallel)]
    if not args.skip_speed:
        checks.append(("speed", lambda: check_speed(args.out)))
    checks.append(("calibrate", lambda: check_calibrate(args.out)))
    if not torch.cuda.is_available():
        for name, _ in checks:
            print(f"SKIP {name}: no CUDA device")
        print("no CUDA device: nothing to check")
        return 2
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, check in checks:
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001  (report every check, whatever breaks)
            results[name] = {"passed": False, "error": traceback.format_exc()[-3000:]}
        status = "SKIP" if "skipped" in results[name] else ("PASS" if results[name].get("passed") else "FAIL")
        print(f"{status:4s} {name}: {json.dumps({k: v for k, v in results[name].items() if k not in ('bench', 'calibration', 'validation')})[:400]}", flush=True)
    (args.out / "gpu_checks.json").write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(r.get("passed", True) for k, r in results.items() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
