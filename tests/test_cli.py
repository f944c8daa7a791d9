# Every entry point answers --help, from the folder users run it from.
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [
    ["generate.py"],
    ["quantize.py"],
    ["eval.py"],
    ["tokenizer.py"],
    ["scripts/convert_hf_checkpoint.py"],
    ["scripts/convert_gguf.py"],
    ["scripts/download.py"],
    ["-m", "scripts.bench"],
    ["-m", "scripts.perplexity"],
    ["mixtral-moe/generate.py"],
    ["mixtral-moe/quantize.py"],
    ["mixtral-moe/scripts/convert_hf_checkpoint.py"],
]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s[-1])
def test_help(script):
    proc = subprocess.run(
        [sys.executable, *script, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and "--" in proc.stdout


def test_bench_runs_on_cpu_with_a_tiny_model(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "--models", "stories15M", "--device", "cpu",
         "--modes", "bf16,int8", "--metrics", "decode", "--no-compile", "--new_tokens", "4",
         "--samples", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    import json

    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["results"]] == ["bf16", "int8"]
    assert all(r["tok_s"] > 0 and r["weight_gb"] > 0 for r in report["results"])
    # int8 weights are about half the bytes of the float ones (float32 on CPU: a quarter)
    assert report["results"][1]["weight_gb"] < 0.5 * report["results"][0]["weight_gb"]
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "--models", "Llama-3.1-8", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "closest: Llama-3.1-8B" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_checks_its_flags_first():
    # Bad values fail at once with one line, before any model is built.
    import bench

    for bad in (
        dict(modes="int5"),
        dict(modes="int4"),
        dict(metrics="decode,speed"),
        dict(samples=0),
        dict(spec_cases="int4,x"),
        dict(spec_temperatures="hot"),
        dict(prefill_rows="17,x"),
        dict(prefill_rows="0"),
    ):
        args = dict(modes="bf16", metrics="decode", new_tokens=4, samples=1)
        args.update(spec_temperatures="0.8", spec_cases="ngram")
        args.update(bad)
        with pytest.raises(bench.UserError):
            bench.check_arguments(**args)
    bench.check_arguments(
        "bf16,int8,int4.g32,int4-gptq.g128,fp8", "decode,ttft", 1, 1, "0,0.8", "int4", "17,2048"
    )
