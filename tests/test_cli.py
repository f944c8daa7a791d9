# Every entry point answers --help, from the folder users run it from.
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_bench_step_breakdown_counts_each_kernel_past_the_one_before():
    # A made-up profile: steps of copy, embedding, two layers of (wqkv, attention, wo), output,
    # chunk, sample. Each kernel is (name, start after the latest end so far, duration): a
    # negative start overlaps, as programmatic dependent launch does.
    from scripts import bench

    layer = [("gemv_wqkv", -0.5, 5), ("decode_attention", -1, 3), ("gemv_wo", -1, 0.5)]
    step = [("copy", 2, 1), ("embed", 0, 2), *layer, *layer, ("output", 0, 10),
            ("chunk", 0.5, 1), ("sample_top_k", 0, 4)]  # fmt: skip
    # effective: 2 + 1, 2, then per layer 4.5, 2 and 0 (wo ends before attention), 10, 1.5, 4
    want = [3, 2, 4.5, 2, 0, 4.5, 2, 0, 10, 1.5, 4]
    kernels, latest = [], 100.0
    for k in range(7):
        # the 6th step recompiled: one kernel more, so it is left out
        for name, after, dur in step + ([("recompile", 0, 50)] if k == 5 else []):
            kernels.append((name, latest + after, latest + after + dur))
            latest = max(latest, latest + after + dur)
    kernels.reverse()  # any order
    res = bench.step_breakdown(kernels, "sample", "attention", skip=1)
    assert res["steps"] == 4 and res["kernels_per_step"] == len(step)
    assert res["step_us"] == pytest.approx(sum(want))
    assert res["layers"] == 2
    assert [(r["name"], r["effective_us"]) for r in res["per_layer"]] == [
        ("gemv_wqkv", pytest.approx(4.5)), ("decode_attention", 2), ("gemv_wo", 0)
    ]  # fmt: skip
    outside = [(r["name"], r["effective_us"]) for r in res["outside_layers"]]
    assert outside == [(name, pytest.approx(w)) for (name, _, _), w in zip(step, want)
                       if name in ("copy", "embed", "output", "chunk", "sample_top_k")]  # fmt: skip
    by_name = {r["name"]: (r["per_step"], r["effective_us"]) for r in res["by_name"]}
    assert by_name["gemv_wqkv"] == (2, pytest.approx(9.0))
    assert bench.step_breakdown(kernels, "no such kernel", "attention") == {}


def test_bench_step_breakdown_times_each_layer_kernel_by_quarter_of_the_run():
    # Attention grows by 1 µs a step, as its reads of the cache grow with the position; wqkv
    # stays. 10 steps: the first has no sampler before it, the second is skipped, and the other
    # 8 make quarters of 2 steps.
    from scripts import bench

    kernels, latest = [], 0.0
    for k in range(10):
        layer = [("wqkv", 3.0), ("attention", 1.0 + k)]
        for name, dur in [*layer, *layer, ("sample_top_k", 1.0)]:
            kernels.append((name, latest, latest + dur))
            latest += dur
    res = bench.step_breakdown(kernels, "sample", "attention", skip=1)
    quarters = {r["name"]: r["quarters_us"] for r in res["per_layer"]}
    assert quarters["attention"] == pytest.approx([3.5, 5.5, 7.5, 9.5])
    assert quarters["wqkv"] == pytest.approx([3.0] * 4)


def test_bench_kernel_resources_count_each_launch_shape():
    # A made-up Chrome trace as Kineto writes it: kernel events carry their launch's resources;
    # the same kernel at two shapes counts twice, host events and memcopies not at all.
    from scripts import bench

    def kernel(name, grid, smem, regs=128):
        args = {"grid": grid, "block": [128, 1, 1], "registers per thread": regs,
                "shared memory": smem}  # fmt: skip
        return {"cat": "kernel", "name": name, "args": args}

    events = [kernel("gemv", [132, 1, 1], 0), kernel("attention", [32, 1, 1], 38912)] * 4
    events += [kernel("gemv", [64, 1, 1], 4096, 96)] * 2
    events += [{"cat": "cpu_op", "name": "aten::mm", "args": {}},
               {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "args": {}}]  # fmt: skip
    res = bench.kernel_resources({"traceEvents": events}, tokens=2)
    got = {(r["name"], r["grid"], r["shared_memory"]): (r["per_token"], r["registers_per_thread"])
           for r in res}  # fmt: skip
    assert got == {
        ("gemv", "[132, 1, 1]", 0): (2.0, 128),
        ("attention", "[32, 1, 1]", 38912): (2.0, 128),
        ("gemv", "[64, 1, 1]", 4096): (1.0, 96),
    }
    assert bench.kernel_resources({}, tokens=1) == []


def test_bench_device_spans_leave_out_the_runs_mark_on_the_gpu_timeline():
    # On CUDA the profiler lists the record_function around the run twice: on the host, and on
    # the GPU's timeline from the first kernel to the last (seen on an H100, round 31). Counted
    # as a kernel, that range made every later kernel's effective time 0.
    from types import SimpleNamespace

    from scripts import bench

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, device_type, start, end):
        return SimpleNamespace(name=name, device_type=device_type,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    kernels = [("gemv", 50, 190), ("attention", 191, 195), ("sample_top_k", 196, 200)] * 6
    kernels = [(n, a + 200 * (i // 3), b + 200 * (i // 3)) for i, (n, a, b) in enumerate(kernels)]
    events = [
        event("run", cpu, 0, 1300),
        event("run", cuda, 50, 1200),
        event("aten::mm", cpu, 5, 9),
    ]
    events += [event(n, cuda, a, b) for n, a, b in kernels]
    spans, host = bench.device_spans(events, "run")
    assert sorted(spans) == sorted(kernels) and host == (0, 1300)
    step = bench.step_breakdown(spans, "sample", "attention", skip=1)
    assert step["step_us"] == pytest.approx(200.0)  # with the mark counted: 0
    assert bench.device_spans(events[2:], "run") == (spans, None)


def test_bench_run_timeline_parts_a_run_into_host_time_and_steps():
    # A made-up run: the host starts at 0 and returns at 1000 µs; the first kernel starts at 40;
    # four steps end with the sampler at 200, 400, 650 and 900; the last kernel ends at 905.
    from scripts import bench

    kernels = [("seed", 40, 41), ("gemv", 50, 190), ("sample_top_k", 195, 200),
               ("gemv", 210, 390), ("sample_top_k", 395, 400), ("gemv", 410, 640),
               ("sample_top_k", 645, 650), ("gemv", 660, 890), ("sample_top_k", 895, 900),
               ("cat", 902, 905)]  # fmt: skip
    kernels.reverse()  # any order
    res = bench.run_timeline(kernels, (0.0, 1000.0), "sample")
    assert res["wall_us"] == 1000 and res["steps"] == 4
    assert res["before_first_kernel_us"] == 40 and res["after_last_kernel_us"] == 95
    spans = res["step_spans_us"]
    assert spans["first"] == [160, 200, 250, 250]
    assert spans["quarters"] == [160, 200, 250, 250]
    assert spans["total"] == 860 and spans["mean"] == 215 and spans["median"] == 225
    assert bench.run_timeline(kernels, (0.0, 1000.0), "no such kernel") == {}
    short = bench.run_timeline(kernels[-5:], (0.0, 500.0), "sample")  # two steps: two quarters
    assert short["steps"] == 2 and short["step_spans_us"]["quarters"] == [160, 200]


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


def test_bench_builds_a_quantized_model_a_block_at_a_time(monkeypatch):
    # bench.random_model quantizes each block before it materialises the next, so that a
    # quantized Mixtral never holds all of its bfloat16 weights (93 GB); and the seed still gives
    # the weights a whole-model build gives, block by block.
    import bench
    import quantize
    from model import ModelArgs

    cfg = ModelArgs(dim=64, intermediate_size=96, n_layer=3, n_head=4, vocab_size=64)
    cfg.num_experts, cfg.num_activated_experts = 4, 2
    plain = bench.random_model(cfg, "bf16", torch.device("cpu"), torch.bfloat16, use_kernels=False)
    materialised, seen = [0], []  # to_empty calls so far; that count at each quantize call
    to_empty, quantize_linear = torch.nn.Module.to_empty, quantize.quantize_linear

    def count_to_empty(module, **kwargs):
        materialised[0] += 1
        return to_empty(module, **kwargs)

    def spy(*args):
        seen.append(materialised[0])
        return quantize_linear(*args)

    monkeypatch.setattr(torch.nn.Module, "to_empty", count_to_empty)
    monkeypatch.setattr(quantize, "quantize_linear", spy)
    model = bench.random_model(cfg, "int4.g32", torch.device("cpu"), torch.bfloat16, False)
    # the embedding, then each block's 4 quantized linears (wqkv, wo, w13, w2 experts) before
    # the next block, then the norm and the output layer
    assert seen == [2] * 4 + [3] * 4 + [4] * 4 + [6]
    torch.testing.assert_close(model.tok_embeddings.weight, plain.tok_embeddings.weight)
    for i in range(3):
        w, want = model.layers[i].attention.wqkv, plain.layers[i].attention.wqkv.weight.float()
        deq = quantize.dequantize_int4(w.weight, w.scales, w.zeros, 32).float()
        assert (deq - want).abs().max() < 0.1 * want.abs().max()  # int4 of the same weights
