"""Bad input to every command, as one table: exit code 2, exactly one line on stderr that names
the input, no traceback, nothing on stdout, and the scratch directory (the working directory of
the run) exactly as it was: nothing created, nothing removed, whatever `--output` and `--force`
say. Then the one `--force` that is allowed: replacing a directory vtoken wrote itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import vtoken.audit as audit_module
from vtoken.nvml import NvmlReport
from vtoken_cli.app import app

DATA = Path(__file__).parent / "data"
HOME = str(Path("~").expanduser())
runner = CliRunner()

BENCH = json.loads((DATA / "vllm-0.32-bench-serve.json").read_text())
REQUEST = '{{"request_id": "{id}", "timestamp": {t}, "input_length": {n}, "output_length": 10}}'
SCRATCH_FILES = {
    "notes.txt": "the user's own file\n",
    "afile": "a regular file\n",
    "mine/keep.txt": "a directory vtoken did not write\n",
    "trace.jsonl": "\n".join(REQUEST.format(id=i, t=i, n=100 + 20 * i) for i in range(4)) + "\n",
    "long.jsonl": REQUEST.format(id="a", t=0, n=9000) + "\n",
    "bad.jsonl": REQUEST.format(id="a", t=0, n=50) + '\n{"timestamp": 1, "input_length": -2\n',
    "empty.jsonl": "",
    "wrong.csv": "start,prompt,output\n1,2,3\n",
    "azure.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,100,5\n2023-11-16 18:15:47.0,80,9\n",
    "deploy.toml": (DATA / "audit_small.toml").read_text(),
    "low-budget.toml": (DATA / "audit_small.toml").read_text().replace('budget = "50%"', 'budget = "10"'),
    "bad-policy.toml": (DATA / "audit_small.toml").read_text().replace('"streaming_llm"', '"lru"'),
    # vllm bench serve results (vtoken.vllm_bench): without --save-detailed, broken lists, appended
    "bench-summary.json": json.dumps({k: v for k, v in BENCH.items() if k not in ("input_lens", "output_lens", "ttfts",
                                                                                 "itls", "start_times", "errors")}),
    "bench-uneven.json": json.dumps({**BENCH, "ttfts": BENCH["ttfts"][:-1]}),
    "bench-bad-length.json": json.dumps({**BENCH, "input_lens": [-3, *BENCH["input_lens"][1:]]}),
    "bench-bad-itls.json": json.dumps({**BENCH, "itls": [["x"], *BENCH["itls"][1:]]}),
    "bench-all-failed.json": json.dumps({**BENCH, "output_lens": [0] * len(BENCH["output_lens"])}),
    "bench-appended.json": json.dumps(BENCH) + "\n" + json.dumps(BENCH),
    "bench-truncated.json": json.dumps(BENCH)[:500],
    "profile-broken.toml": "[sim\noverhead_s = 1\n",
    "profile-roofline.toml": "[sim]\nmfu = 0.4\n",
    "profile-negative.toml": ("[sim.step_model]\noverhead_s = -0.01\nper_decode_token_s = 0.001\nper_kv_slot_s = 0.0\n"
                              "per_prefill_token_s = 0.0\nper_prefill_request_s = 0.0\nper_prefill_kv_pair_s = 0.0\n"
                              "per_copied_token_s = 0.0\n"),
    "profile-vllm.toml": ("[sim.step_model]\noverhead_s = 0.01\nper_decode_token_s = 0.001\nper_kv_slot_s = 0.0\n"
                          "per_prefill_token_s = 0.0\nper_prefill_request_s = 0.0\nper_prefill_kv_pair_s = 0.0\n"
                          "per_copied_token_s = 0.0\n[sim.step_model.provenance]\nengine = \"vllm\"\nmodel = \"m\"\n"
                          "cpu = \"c\"\nnum_cores = 2\ntorch_version = \"t\"\nvllm_version = \"v\"\ndevice = \"cpu\"\n"
                          "date = \"d\"\n"),
}

FAST_COMPARE = ["--max-requests", "3", "--no-sweep", "--no-frontier"]
COMPARE = ["compare", "trace.jsonl", *FAST_COMPARE]
CHECK = ["check-invariants", "trace.jsonl", "--policy", "h2o", "--reclaim-mode", "ordered"]
AUDIT = ["audit", "deploy.toml", "--max-requests", "3", "--policy", "h2o", "--frontier-max", "4"]
SERVE = ["serve", "some-model", "--print-command"]
CALIBRATE = ["calibrate", "--executor", "hf", "--model", "smollm2-135m"]
VALIDATE = ["validate", "trace.jsonl", "--executor", "hf", "--model", "smollm2-135m"]

# (argv, the text the one error line must hold): every case exits 2.
CASES = {
    # --output: never a file, a link, the working directory, its parents, home or /; nothing
    # vtoken did not write; a parent that cannot be written is found before any work.
    "compare-output-cwd-forced": ([*COMPARE, "--output", ".", "--force"], "--output .: is the working directory"),
    "compare-output-cwd": ([*COMPARE, "--output", "."], "--output .: is the working directory"),
    "compare-output-parent-forced": ([*COMPARE, "--output", "..", "--force"], "--output ..: is a parent"),
    "compare-output-root-forced": ([*COMPARE, "--output", "/", "--force"], "--output /:"),
    "compare-output-home-forced": ([*COMPARE, "--output", HOME, "--force"], f"--output {HOME}: is the home"),
    "compare-output-file-forced": ([*COMPARE, "--output", "afile", "--force"], "--output afile: is a file"),
    "compare-output-file": ([*COMPARE, "--output", "afile"], "--output afile: is a file"),
    "compare-output-foreign-dir-forced": ([*COMPARE, "--output", "mine", "--force"], "--output mine: exists and is not empty"),
    "compare-output-foreign-dir": ([*COMPARE, "--output", "mine"], "--output mine: exists and is not empty"),
    "compare-output-link-forced": ([*COMPARE, "--output", "link", "--force"], "--output link: is a symbolic link"),
    "compare-output-under-a-file": ([*COMPARE, "--output", "afile/run"], "--output afile/run:"),
    "compare-output-proc": ([*COMPARE, "--output", "/proc/x"], "--output /proc/x: cannot create"),
    # the run cache: a directory, or one that can be made, before any work
    "compare-cache-dir-is-a-file": ([*COMPARE, "--cache-dir", "afile"], "--cache-dir afile: afile is a file, not a directory"),
    "audit-cache-dir-under-a-file": ([*AUDIT, "--cache-dir", "afile/runs"],
                                     "--cache-dir afile/runs: afile is a file, not a directory"),
    # flags
    "compare-seed": ([*COMPARE, "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    "compare-num-blocks-huge": ([*COMPARE, "--num-blocks", "1000000000"], "--num-blocks 1000000000 is more than h100-80gb"),
    "compare-num-blocks-huge-no-fit": ([*COMPARE, "--model", "llama-3.1-70b", "--gpu", "l40s", "--num-blocks", "100000000"],
                                       "--num-blocks 100000000 is more than 16777216"),
    "compare-num-blocks-zero": ([*COMPARE, "--num-blocks", "0"], "--num-blocks must be > 0"),
    "compare-budget-below-protected": ([*COMPARE, "--budget", "10"], "--budget 10 is below the 68 tokens"),
    "compare-budget-ratio": ([*COMPARE, "--budget", "150%"], "--budget must be"),
    "compare-budget-word": ([*COMPARE, "--budget", "lots"], "got 'lots'"),
    "compare-policy": ([*COMPARE, "--policy", "lru"], "--policy: unknown policy 'lru'"),
    "compare-model": ([*COMPARE, "--model", "gpt-9"], "'gpt-9'"),
    "compare-gpu": ([*COMPARE, "--gpu", "tpu"], "'tpu'"),
    "compare-gpu-mem-util": ([*COMPARE, "--gpu-mem-util", "2"], "--gpu-mem-util must be in (0, 1]"),
    "compare-theta-f": ([*COMPARE, "--theta-f", "1.5"], "--theta-f must be in (0, 1)"),
    "compare-block-size": ([*COMPARE, "--block-size", "0"], "--block-size must be > 0"),
    "compare-eviction-interval": ([*COMPARE, "--eviction-interval", "0"], "--eviction-interval must be > 0"),
    "compare-concurrency": ([*COMPARE, "--concurrency", "0"], "--concurrency must be > 0"),
    "compare-reclaim-budget": ([*COMPARE, "--reclaim-budget", "0"], "--reclaim-budget must be an integer > 0, 'auto' or 'none'"),
    "compare-reclaim-interval": ([*COMPARE, "--reclaim-interval", "0"], "--reclaim-interval must be > 0, got 0"),
    "compare-reclaim-batch-blocks": ([*COMPARE, "--reclaim-batch-blocks", "1"], "--reclaim-batch-blocks must be >= 2"),
    "compare-reclaim-mode": ([*COMPARE, "--reclaim-mode", "magic"], "'magic'"),
    "compare-executor": ([*COMPARE, "--executor", "tpu"], "'tpu'"),
    "compare-concurrencies": ([*COMPARE, "--concurrencies", "1,x"], "--concurrencies"),
    "compare-repeats": ([*COMPARE, "--repeats", "0"], "--repeats must be > 0"),
    "compare-sla-factor": ([*COMPARE, "--sla-factor", "0"], "SLA factor"),
    "compare-sim-profile": ([*COMPARE, "--sim-profile", "nope.toml"], "nope.toml"),
    "compare-max-requests": (["compare", "trace.jsonl", "--max-requests", "0"], "--max-requests"),
    "compare-format-unknown": ([*COMPARE, "--format", "nope"], "'nope'"),
    "compare-time-unit-unknown": ([*COMPARE, "--time-unit", "h"], "'h'"),
    "compare-time-unit-on-csv": (["compare", "azure.csv", *FAST_COMPARE, "--time-unit", "s"], "azure.csv: a time unit"),
    "compare-jsonl-on-csv": (["compare", "azure.csv", *FAST_COMPARE, "--format", "jsonl"],
                             "azure.csv line 1: not JSON, so not a JSONL trace"),
    "compare-wrong-csv-header": (["compare", "wrong.csv", *FAST_COMPARE], "wrong.csv line 1: a CSV trace is an Azure"),
    "compare-truncated-line": (["compare", "bad.jsonl", *FAST_COMPARE], "bad.jsonl line 2"),
    "compare-empty-trace": (["compare", "empty.jsonl", *FAST_COMPARE], "empty.jsonl"),
    "compare-missing-trace": (["compare", "missing.jsonl", *FAST_COMPARE], "missing.jsonl: trace file not found"),
    "compare-a-directory-as-trace": (["compare", "mine", *FAST_COMPARE], "mine"),
    "compare-bench-not-detailed": (["compare", "bench-summary.json", *FAST_COMPARE],
                                   "bench-summary.json: a vllm bench serve result without its per-request fields"),
    "compare-bench-uneven": (["compare", "bench-uneven.json", *FAST_COMPARE],
                             "bench-uneven.json: per-request lists of different lengths: input_lens 24, ttfts 23"),
    "compare-bench-bad-length": (["compare", "bench-bad-length.json", *FAST_COMPARE],
                                 "bench-bad-length.json: input_lens[0] must be an integer >= 1, got -3"),
    "compare-bench-bad-itls": (["compare", "bench-bad-itls.json", *FAST_COMPARE],
                               "bench-bad-itls.json: itls[0] must be a list of seconds >= 0"),
    "compare-bench-all-failed": (["compare", "bench-all-failed.json", *FAST_COMPARE],
                                 "bench-all-failed.json: no request of the benchmark succeeded (24 failed)"),
    "compare-bench-appended": (["compare", "bench-appended.json", "--format", "vllm-bench", *FAST_COMPARE],
                               "bench-appended.json line 2: more than one JSON object"),
    "compare-bench-truncated": (["compare", "bench-truncated.json", "--format", "vllm-bench", *FAST_COMPARE],
                                "bench-truncated.json line 1: malformed JSON"),
    "compare-bench-time-unit": (["compare", "bench-uneven.json", *FAST_COMPARE, "--time-unit", "ms"],
                                "a time unit (--time-unit) applies only to jsonl and mooncake"),
    "compare-bench-as-jsonl": (["compare", "bench-truncated.json", *FAST_COMPARE],
                               "bench-truncated.json line 1: not JSON"),
    "compare-sim-rounds": ([*COMPARE, "--rounds", "3"], "--rounds and --warmup apply to measured executors"),
    "compare-sim-warmup": ([*COMPARE, "--warmup", "1"], "the sim is deterministic"),
    "compare-rounds-zero": ([*COMPARE, "--rounds", "0"], "--rounds must be > 0"),
    "compare-longer-than-context": (["compare", "long.jsonl", *FAST_COMPARE, "--model", "smollm2-135m"],
                                    "long.jsonl: every request is longer than the model's context of 8192"),
    # runs that measured nothing
    "compare-nothing-measured": ([*COMPARE, "--num-blocks", "1"], "nothing measured: native, naive-evict, vtoken"),
    "check-nothing-checked": ([*CHECK, "--num-blocks", "1"], "nothing checked: 0 invariant checks"),
    "check-fault-never-injected": ([*CHECK, "--inject-fault", "shared-block"],
                                   "--inject-fault shared-block: never injected"),
    "audit-nothing-measured": ([*AUDIT, "--num-blocks", "1"], "nothing measured: native, naive-evict, vtoken"),
    # check-invariants
    "check-seed": ([*CHECK, "--seed", "-1"], "--seed must be an integer >= 0"),
    "check-fault-unknown": ([*CHECK, "--inject-fault", "nope"], "'nope'"),
    "check-policy": (["check-invariants", "trace.jsonl", "--policy", "lru"], "--policy: unknown policy 'lru'"),
    "check-reclaim-mode": (["check-invariants", "trace.jsonl", "--reclaim-mode", "magic"], "'magic'"),
    "check-executor": ([*CHECK, "--executor", "tpu"], "'tpu'"),
    "check-reclaim-interval": ([*CHECK, "--reclaim-interval", "0"], "--reclaim-interval must be > 0"),
    "check-budget-below-protected": ([*CHECK, "--budget", "10"], "--budget 10 is below"),
    "check-num-blocks-huge": ([*CHECK, "--num-blocks", "1000000000"], "--num-blocks 1000000000"),
    "check-theta-f": ([*CHECK, "--theta-f", "0"], "--theta-f"),
    "check-fuzz": ([*CHECK, "--fuzz", "-1"], "--fuzz"),
    "check-max-prompt-tokens": ([*CHECK, "--max-prompt-tokens", "-1"], "--max-prompt-tokens"),
    "check-missing-trace": (["check-invariants", "missing.jsonl"], "missing.jsonl"),
    "check-output-cwd-forced": ([*CHECK, "--output", ".", "--force"], "--output .: is the working directory"),
    "check-output-file-forced": ([*CHECK, "--output", "afile", "--force"], "--output afile: is a file"),
    "check-output-foreign-dir-forced": ([*CHECK, "--output", "mine", "--force"], "--output mine:"),
    # audit
    "audit-seed": ([*AUDIT, "--seed", "-1"], "--seed must be an integer >= 0"),
    "audit-num-blocks-huge": ([*AUDIT, "--num-blocks", "1000000000"], "--num-blocks 1000000000"),
    "audit-num-blocks-zero": ([*AUDIT, "--num-blocks", "0"], "--num-blocks must be > 0"),
    "audit-budget-below-protected": ([*AUDIT, "--budget", "10"], "--budget 10 is below"),
    "audit-policy": (["audit", "deploy.toml", "--policy", "lru"], "--policy: unknown policy 'lru'"),
    "audit-model-and-config": ([*AUDIT, "--model", "llama-3.1-8b", "--model-config", "afile"], "--model"),
    "audit-gpu": ([*AUDIT, "--gpu", "tpu"], "'tpu'"),
    "audit-block-size": ([*AUDIT, "--block-size", "0"], "--block-size"),
    "audit-concurrency": ([*AUDIT, "--concurrency", "0"], "--concurrency"),
    "audit-format": ([*AUDIT, "--format", "nope"], "'nope'"),
    "audit-missing-toml": (["audit", "missing.toml"], "missing.toml"),
    "compare-num-blocks-not-a-number": ([*COMPARE, "--num-blocks", "abc"], "'--num-blocks'"),
    "compare-unknown-flag": ([*COMPARE, "--bogus"], "--bogus"),
    "compare-no-trace-argument": (["compare"], "Missing argument 'TRACE'"),
    "check-seed-not-a-number": ([*CHECK, "--seed", "x"], "'--seed'"),
    "audit-toml-is-a-directory": (["audit", "mine"], "mine: is a directory"),
    "audit-toml-budget-below-protected": (["audit", "low-budget.toml"], "eviction.budget 10 is below"),
    "audit-toml-policy": (["audit", "bad-policy.toml"], "eviction.policies: unknown policy 'lru'"),
    "audit-missing-trace": ([*AUDIT, "--trace", "missing.jsonl"], "missing.jsonl"),
    "audit-output-cwd-forced": ([*AUDIT, "--output", ".", "--force"], "--output .: is the working directory"),
    "audit-output-file-forced": ([*AUDIT, "--output", "afile", "--force"], "--output afile: is a file"),
    "audit-output-foreign-dir-forced": ([*AUDIT, "--output", "mine", "--force"], "--output mine:"),
    # serve: what fails before vLLM is needed
    "serve-variant": ([*SERVE, "--variant", "foo"], "--variant: unknown variant 'foo'"),
    "serve-policy": ([*SERVE, "--policy", "lru"], "--policy: unknown policy 'lru'"),
    "serve-budget-below-protected": ([*SERVE, "--budget", "10"], "--budget 10 is below the 68 tokens"),
    "serve-budget-form": ([*SERVE, "--budget", "0"], "--budget must be"),
    "serve-sink-tokens": ([*SERVE, "--sink-tokens", "-1"], "--sink-tokens must be >= 0"),
    "serve-theta-f": ([*SERVE, "--theta-f", "3"], "--theta-f must be in (0, 1)"),
    "serve-prefix-protection": ([*SERVE, "--prefix-protection", "all"], "--prefix-protection: unknown value 'all'"),
    "serve-port": ([*SERVE, "--port", "0"], "--port"),
    "serve-block-size": ([*SERVE, "--block-size", "0"], "--block-size"),
    "serve-num-blocks": ([*SERVE, "--num-blocks", "0"], "--num-blocks must be > 0"),
    "serve-max-model-len": ([*SERVE, "--max-model-len", "0"], "--max-model-len must be > 0"),
    "serve-kv-cache-bytes": ([*SERVE, "--kv-cache-bytes", "0"], "--kv-cache-bytes must be > 0"),
    "serve-reclaim-mode": ([*SERVE, "--reclaim-mode", "x"], "'x'"),
    # calibrate and validate: what fails before an engine starts
    "calibrate-executor-sim": (["calibrate", "--executor", "sim", "--model", "smollm2-135m"],
                               "--executor 'sim': calibrate runs a real engine, one of vllm, hf"),
    "calibrate-rounds": ([*CALIBRATE, "--rounds", "0"], "--rounds must be > 0, got 0"),
    "calibrate-batch-sizes": ([*CALIBRATE, "--decode-batch-sizes", "4,0"],
                              "--decode-batch-sizes must be positive integers, got '4,0'"),
    "calibrate-contexts": ([*CALIBRATE, "--decode-contexts", "64,x"],
                           "--decode-contexts must be comma-separated integers, got '64,x'"),
    "calibrate-model": (["calibrate", "--executor", "hf", "--model", "gpt-9"], "--model 'gpt-9': not 'smollm2-135m'"),
    "calibrate-output-not-toml": ([*CALIBRATE, "--output", "afile"], "--output afile: a sim profile is a .toml file"),
    "calibrate-output-exists": ([*CALIBRATE, "--output", "deploy.toml"], "deploy.toml exists; give --force"),
    "calibrate-output-is-a-directory": ([*CALIBRATE, "--output", "dir.toml"], "dir.toml is a directory"),
    "calibrate-output-no-folder": ([*CALIBRATE, "--output", "nowhere/p.toml"], "folder nowhere does not exist"),
    "validate-executor-sim": (["validate", "trace.jsonl", "--executor", "sim", "--model", "smollm2-135m",
                               "--sim-profile", "profile-vllm.toml"], "--executor 'sim': validate measures a real engine"),
    "validate-missing-profile": ([*VALIDATE, "--sim-profile", "nope.toml"], "nope.toml: sim profile not found"),
    "validate-malformed-profile": ([*VALIDATE, "--sim-profile", "profile-broken.toml"],
                                   "profile-broken.toml: not valid TOML"),
    "validate-uncalibrated-profile": ([*VALIDATE, "--sim-profile", "profile-roofline.toml"],
                                      "profile-roofline.toml: not calibrated"),
    "validate-negative-coefficient": ([*VALIDATE, "--sim-profile", "profile-negative.toml"],
                                      "overhead_s must be a number >= 0"),
    "validate-profile-of-another-engine": ([*VALIDATE, "--sim-profile", "profile-vllm.toml"],
                                           "calibrated against vllm, not --executor hf"),
    "validate-rounds": ([*VALIDATE, "--sim-profile", "profile-vllm.toml", "--rounds", "0"], "--rounds must be > 0"),
    "validate-missing-trace": (["validate", "missing.jsonl", "--executor", "vllm", "--model", "smollm2-135m",
                                "--sim-profile", "profile-vllm.toml"], "missing.jsonl: trace file not found"),
    "compare-sim-profile-malformed": ([*COMPARE, "--sim-profile", "profile-broken.toml"], "not valid TOML"),
}


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The run's working directory, with the files the cases name (and a link to mine/)."""
    for name, text in SCRATCH_FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "link").symlink_to("mine")
    (tmp_path / "dir.toml").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(audit_module, "probe_gpus", lambda: NvmlReport((), "NVML not available: test"))
    return tmp_path


def listing(root: Path) -> dict[str, str]:
    """Every entry under `root`: a file's content hash, a link's target, 'dir' for a folder."""
    def describe(path: Path) -> str:
        if path.is_symlink():
            return f"-> {path.readlink()}"
        return "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()

    return {str(p.relative_to(root)): describe(p) for p in sorted(root.rglob("*"))}


def test_the_table_is_large_and_covers_every_command():
    assert len(CASES) >= 60
    assert {argv[0] for argv, _ in CASES.values()} == {"compare", "check-invariants", "audit", "serve", "calibrate",
                                                        "validate"}


PROGRESS_LINE = re.compile(r"^[a-z-]+: (\d+% of \S+ tokens|\S+ done), \d+ s elapsed")


@pytest.mark.parametrize("argv, fragment", list(CASES.values()), ids=list(CASES))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(scratch: Path, argv: list[str], fragment: str):
    before = listing(scratch)
    result = runner.invoke(app, argv)

    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.stdout.strip() == ""
    # a run that takes over 10 s prints plain progress lines first ("compare: 40% of 1.2M tokens, ...")
    lines = [line for line in result.stderr.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert listing(scratch) == before


def test_force_replaces_a_directory_vtoken_wrote(scratch: Path):
    args = [*COMPARE, "--output", "run", "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    written = ["report.json", "requests_naive-evict.csv", "requests_native.csv", "requests_vtoken.csv",
               "utilization_histogram.csv", "utilization_histograms.png", "variants.csv"]
    assert first.stderr.strip().endswith(f"wrote run/ ({', '.join(written)})")
    manifest = json.loads((scratch / "run" / ".vtoken-output.json").read_text())
    assert manifest["files"] == written
    report = json.loads((scratch / "run" / "report.json").read_text())
    assert set(report.pop("provenance")) == {"vtoken_version", "command_line", "written_at"}
    assert report == json.loads(first.stdout)

    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "pass --force" in refused.stderr

    (scratch / "run" / "variants.csv").unlink()  # a file it listed may be gone already
    forced = runner.invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert sorted(p.name for p in (scratch / "run").iterdir()) == [".vtoken-output.json", *manifest["files"]]
    assert sorted(p.name for p in scratch.iterdir() if p.name.startswith(".")) == []  # no staging left behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_parent_fails_before_any_work(scratch: Path):
    (scratch / "locked").mkdir(mode=0o555)
    before = listing(scratch)
    result = runner.invoke(app, [*COMPARE, "--output", "locked/run"])
    assert result.exit_code == 2 and result.stdout.strip() == ""
    assert "--output locked/run: cannot create a directory in" in result.stderr
    assert listing(scratch) == before


def test_output_directories_get_the_umask_permissions(scratch: Path):
    previous = os.umask(0o022)
    try:
        result = runner.invoke(app, [*COMPARE, "--output", "run"])
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    assert (scratch / "run").stat().st_mode & 0o777 == 0o755


def test_a_request_longer_than_the_context_is_skipped_with_a_note(scratch: Path):
    (scratch / "mixed.jsonl").write_text((scratch / "trace.jsonl").read_text() + (scratch / "long.jsonl").read_text())
    result = runner.invoke(app, ["compare", "mixed.jsonl", "--no-sweep", "--no-frontier", "--model", "smollm2-135m",
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["trace"] == {
        "source": "mixed.jsonl", "format": "jsonl", "num_requests": 4,
        "notes": ["1 request longer than the model's context of 8192 tokens skipped"]}
