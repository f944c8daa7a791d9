# Speed benchmark on random weights of real model shapes (speed does not depend on the values).
# Run from the repository root as a module, so that it imports the very code generate.py runs:
#
#   python -m scripts.bench --models Llama-2-7B,Llama-3.1-8B --modes bf16,int8,int4.g32 \
#       --device cuda --out bench.json --plot bench.png
#   python -m scripts.bench --kernels_only --device cuda          # each GEMV alone
#       (a Mixture-of-Experts model's w13 and w2 as expert GEMVs: k of E experts a launch)
#
# Protocol (gpt-fast's): batch size 1, a 5-token prompt, 200 new tokens, top_k 200, temperature
# 0.8, one compile warm-up then 5 samples, average tok/s. Achieved bandwidth counts the weight
# bytes one step reads (embedding table excluded) times tok/s.
import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

import tp
from generate import (
    PRECISIONS,
    UserError,
    compile_steps,
    generate,
    log,
    pick_device,
    setup_for_device,
    weight_bytes,
)
from model import ConfigError, ModelArgs, Transformer

L2_BYTES = 64 << 20  # larger than an H200's 60 MB L2; timed inputs rotate beyond it


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int = 10, warmup: int = 2) -> float:
    # Median seconds of fn() over reps, after warm-up.
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(device, nbytes: int = 4 << 30) -> float:
    # Bytes/s of a pure read: row sums over a bf16 matrix larger than any cache.
    rows = 16384
    x = torch.randn(rows, nbytes // 2 // rows, device=device, dtype=torch.bfloat16)
    dt = timed(lambda: x.sum(dim=1), device, reps=10)
    return x.numel() * 2 / dt


def matmul_tflops(device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    dt = timed(lambda: a @ b, device, reps=10)
    return 2 * n**3 / dt / 1e12


# ---------------------------------------------------------------------------------------------
# Models with random weights
# ---------------------------------------------------------------------------------------------


def random_model(
    name: str, mode: str, device, dtype, use_kernels: bool = True, seed: int = 0
) -> Transformer:
    # Same path as loading a checkpoint: build on meta, materialise, quantize, kernels. The same
    # seed gives the same weights before quantization, whatever the mode. One block at a time:
    # materialised and quantized before the next, so that building a quantized model never
    # holds all of its bfloat16 weights (Mixtral-8x7B's are 93 GB; its int4 model fits an
    # 80 GB GPU).
    config = ModelArgs.from_name(name) if isinstance(name, str) else name
    with torch.device("meta"):
        model = Transformer(config).to(dtype)  # dtype first: materialise once, in the target dtype
    kind, _, group = mode.replace("-gptq", "").partition(".g")  # int4-gptq: int4's format
    names = []  # the linears to quantize, in model order
    if mode != "bf16":
        import quantize

        names = quantize.linear_names(model, skip_output=False)

    def swap(name):  # model's linear `name` -> its quantized form, in place
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = quantize.quantize_linear(getattr(parent, child), kind, int(group or 0) or None)
        setattr(parent, child, linear)

    units = ["tok_embeddings", *(f"layers.{i}" for i in range(config.n_layer)), "norm"]
    if not config.tie_embeddings:
        units.append("output")
    torch.manual_seed(seed)
    for unit in units:
        module = model.get_submodule(unit).to_empty(device=device)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.02)  # random, never zeros: zeros can flatter caches and compressors
        for name in names:
            if name == unit or name.startswith(unit + "."):
                swap(name)
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
        if "output" in names:
            swap("output")
    if mode != "bf16":
        quantize.finalize_model(model, device)
    return setup_for_device(tp.apply_tp(model.eval()), device, use_kernels)  # torchrun: shard


def kv_bytes(model: Transformer, length: int, batch: int = 1) -> int:
    c = model.config
    elt = model.tok_embeddings.weight.element_size()
    return 2 * c.n_layer * c.n_kv_heads * c.head_dim * length * batch * elt


def decode_rate(
    model, device, steps, prompt, new_tokens, batch=1, start_pos=0, samples=5, temperature=0.8,
    stop_ids=frozenset(),
):  # fmt: skip
    # Average tok/s of generate() over `samples` runs (all rows counted). prompt: a length (of
    # random tokens) or the tokens [1, T]. stop_ids end a row early, as generate.py's do.
    if isinstance(prompt, int):
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, 1000, (1, prompt), generator=g)
    prompt = prompt.repeat(batch, 1).to(device)
    sampling = dict(temperature=temperature, top_k=200)
    rates = []
    for _ in range(samples):
        sync(device)
        t0 = time.perf_counter()
        out = generate(
            model, prompt, new_tokens, start_pos=start_pos, stop_ids=stop_ids, **sampling, **steps
        )  # fmt: skip
        sync(device)
        rates.append(sum(len(r) for r in out) / (time.perf_counter() - t0))
    return statistics.mean(rates)


def step_breakdown(
    kernels: list[tuple[str, float, float]], last: str, layer: str, skip: int = 3
) -> dict:
    # Where a decode step's time goes. kernels: (name, start, end) in µs of a profiled run, in
    # any order; last and layer: substrings of the names of the kernel that ends each step (the
    # sampler) and of one that runs once per layer (attention); the first `skip` steps (warm-up)
    # are left out. A kernel's effective time is its end minus the latest end of the kernels
    # that started before it, or 0 when it ends earlier: kernels overlap under programmatic
    # dependent launch, so their durations overcount, while the effective times of a step add
    # up to its span, a gap counted to the kernel after it.
    kernels = sorted(kernels, key=lambda k: k[1])
    eff, latest = [], None
    for _, start, end in kernels:
        eff.append(end - start if latest is None else max(0.0, end - latest))
        latest = end if latest is None else max(latest, end)
    ends = [i for i, k in enumerate(kernels) if last in k[0]]
    steps = [range(a + 1, b + 1) for a, b in zip(ends[skip:], ends[skip + 1 :])]
    if not steps:
        return {}
    n = statistics.mode(len(s) for s in steps)
    steps = [s for s in steps if len(s) == n]  # a step with another shape (a recompile) is out
    names = [kernels[i][0] for i in steps[0]]
    avg = [statistics.mean(eff[s[j]] for s in steps) for j in range(n)]
    by_name = {}
    for name, t in zip(names, avg):
        count, total = by_name.get(name, (0, 0.0))
        by_name[name] = (count + 1, total + t)
    res = dict(
        steps=len(steps),
        kernels_per_step=n,
        step_us=sum(avg),
        by_name=[
            dict(name=k[:120], per_step=c, effective_us=t)
            for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])
        ],
    )
    # Layers: the positions repeat with the period between one `layer` kernel and the next. A
    # layer starts `lead` kernels before that one: as many as have the same names before it in
    # every layer (the first layer's come after the embedding, the others' after the layer
    # before). per_layer averages each position over the layers.
    marks = [j for j, name in enumerate(names) if layer in name]
    if len(marks) > 1:
        period = statistics.mode(b - a for a, b in zip(marks, marks[1:]))
        starts = [a for a in marks if (a - marks[0]) % period == 0]
        lead = 0
        while lead + 1 < period and all(
            a > lead and names[a - lead - 1] == names[starts[0] - lead - 1] for a in starts
        ):
            lead += 1
        layers = [a - lead for a in starts if a - lead + period <= n]
        res["layers"] = len(layers)
        # the same by quarter of the run's steps: a kernel that reads the growing cache grows
        quarter = max(1, len(steps) // 4)
        parts = [steps[i : i + quarter] for i in range(0, min(len(steps), 4 * quarter), quarter)]
        by_part = [[statistics.mean(eff[s[j]] for s in part) for j in range(n)] for part in parts]
        res["per_layer"] = [
            dict(offset=o, name=names[layers[0] + o][:120],
                 effective_us=statistics.mean(avg[s + o] for s in layers),
                 quarters_us=[statistics.mean(a[s + o] for s in layers) for a in by_part])
            for o in range(period)
        ]  # fmt: skip
        inside = {s + o for s in layers for o in range(period)}
        res["outside_layers"] = [
            dict(position=j, name=names[j][:120], effective_us=avg[j])
            for j in range(n) if j not in inside
        ]  # fmt: skip
    return res


def run_timeline(
    kernels: list[tuple[str, float, float]], host: tuple[float, float], last: str
) -> dict:
    # Where one generate() run's time goes beyond its steps: host (start, end) in µs is the
    # call's span on the host, in the kernels' clock. A step's span runs from the end of the
    # sampler before it (`last` in the name) to the end of its own, the first from the first
    # kernel; what precedes the first kernel and follows the last is host time.
    kernels = sorted(kernels, key=lambda k: k[1])
    ends = [e for name, _, e in kernels if last in name]
    if not ends:
        return {}
    spans = [ends[0] - kernels[0][1]] + [b - a for a, b in zip(ends, ends[1:])]
    quarter = max(1, len(spans) // 4)
    return dict(
        wall_us=host[1] - host[0],
        before_first_kernel_us=kernels[0][1] - host[0],
        after_last_kernel_us=host[1] - max(e for _, _, e in kernels),
        steps=len(spans),
        step_spans_us=dict(
            first=spans[:5],
            median=statistics.median(spans),
            mean=statistics.mean(spans),
            # the run's quarters in order: later steps attend to more cache slots
            # (fewer than four when the run has fewer than four steps)
            quarters=[
                statistics.mean(spans[i : i + quarter])
                for i in range(0, min(len(spans), quarter * 4), quarter)
            ],
            total=sum(spans),
        ),
    )


def device_spans(events, mark: str) -> tuple[list[tuple[str, float, float]], tuple | None]:
    # Profiler events -> the kernels' (name, start, end) in µs and the host span of the
    # record_function `mark`. The profiler also puts `mark` on the GPU's timeline, as a range
    # from the first kernel under it to the last: counted as a kernel, it would cover every
    # kernel after it and leave them no effective time.
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == cuda and e.name != mark
    ]
    host = [e.time_range for e in events if e.name == mark and e.device_type != cuda]
    return kernels, ((host[0].start, host[0].end) if host else None)


def kernel_resources(trace: dict, tokens: int) -> list[dict]:
    # What each kernel launch asked of an SM, from a profiler's Chrome trace (Kineto's kernel
    # events carry grid, block, registers per thread and shared memory): one entry per kernel
    # name and launch shape, with its launches per token. Kernels of one step that ask for
    # different shared memory may keep each other off an SM under programmatic dependent launch.
    shapes = {}
    for e in trace.get("traceEvents", []):
        args = e.get("args", {})
        if e.get("cat") != "kernel" or "registers per thread" not in args:
            continue
        key = (e["name"][:120], str(args.get("grid")), str(args.get("block")),
               args["registers per thread"], args.get("shared memory"))  # fmt: skip
        shapes[key] = shapes.get(key, 0) + 1
    return [
        dict(name=name, grid=grid, block=block, registers_per_thread=regs, shared_memory=smem,
             per_token=n / tokens)
        for (name, grid, block, regs, smem), n in sorted(shapes.items(), key=lambda kv: -kv[1])
    ]  # fmt: skip


def profile_decode(model, device, steps, tokens: int) -> dict:
    # Where a decode step's time goes: the kernels' effective times per step (step_breakdown),
    # each kernel name's total duration per token, and the run's steps and host time apart
    # (run_timeline). One run as the protocol times it: the same prompt and length.
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("fastgen_run"):
            decode_rate(model, device, steps, 5, tokens, samples=1)
    spans, host = device_spans(prof.events(), "fastgen_run")
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        resources = kernel_resources(json.loads(Path(f"{tmp}/trace.json").read_text()), tokens)
    per_name = {}
    for name, a, b in spans:
        n, t = per_name.get(name, (0, 0.0))
        per_name[name] = (n + 1, t + b - a)
    start = min(k[1] for k in spans)
    end = max(k[2] for k in spans)
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:25]
    last = "_top_k_sample"  # fastgen_kernels' sampler ends a step
    res = dict(
        kernel_us_per_token=sum(t for _, t in per_name.values()) / tokens,
        span_us_per_token=(end - start) / tokens,
        kernels_per_token=len(spans) / tokens,
        top=[
            dict(name=k[:120], per_token=n / tokens, us_per_token=t / tokens) for k, (n, t) in top
        ],
        step=step_breakdown(spans, last, layer="_attn_split"),  # attention: once per layer
        run=run_timeline(spans, host, last) if host else {},
        resources=resources,
    )
    log(
        f"  profile: {res['kernels_per_token']:.0f} kernels, {res['kernel_us_per_token']:.0f} us "
        f"of kernels in a {res['span_us_per_token']:.0f} us span per token"
    )
    run = res["run"]
    if run:
        q = ", ".join(f"{t:.0f}" for t in run["step_spans_us"]["quarters"])
        log(
            f"  the run: {run['wall_us'] / 1e3:.1f} ms, {run['steps']} steps of "
            f"{run['step_spans_us']['mean']:.0f} us on average (by quarter: {q}; first: "
            + ", ".join(f"{t:.0f}" for t in run["step_spans_us"]["first"])
            + f"), {run['before_first_kernel_us']:.0f} us before the first kernel, "
            f"{run['after_last_kernel_us']:.0f} us after the last"
        )
    step = res["step"]
    if step:
        log(f"  a step: {step['step_us']:.1f} us effective over {step['kernels_per_step']} kernels")
        for t in step["by_name"][:25]:
            log(f"    {t['effective_us']:8.1f} us  x{t['per_step']:4d}  {t['name']}")
        for t in step.get("per_layer", []):
            q = " ".join(f"{u:.2f}" for u in t["quarters_us"])
            o, u = t["offset"], t["effective_us"]
            log(f"    layer +{o}: {u:6.2f} us (by quarter {q})  {t['name']}")
    for r in res["resources"][:12]:
        log(
            f"    x{r['per_token']:5.1f} grid {r['grid']} block {r['block']}: "
            f"{r['registers_per_thread']} registers, {r['shared_memory']} B shared  "
            + r["name"][:60]
        )
    return res


def fill_caches(model):
    # Decoding at a long context reads the cache; random contents, never zeros.
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.kv_cache.k_cache.normal_()
            layer.attention.kv_cache.v_cache.normal_()


def bench_model(
    name, mode, device, dtype, metrics, bandwidth, peak_tflops, compile, new_tokens=200, samples=5,
    use_kernels=True,
):  # fmt: skip
    res = dict(model=name, mode=mode)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = random_model(name, mode, device, dtype, use_kernels)
    if device.type == "cuda":
        # Peak memory from here on: what generating takes. Building a quantized model here
        # holds its bfloat16 weights first, which loading a quantized checkpoint never does.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    res["kernels"] = use_kernels
    nbytes = weight_bytes(model)
    res["weight_gb"] = nbytes / 1e9
    steps = compile_steps(compile, compile_prefill=False)

    # Decode, the protocol: 5-token prompt, 200 new tokens; compile warm-up timed.
    model.setup_caches(1, 256)
    sync(device)
    t0 = time.perf_counter()
    decode_rate(model, device, steps, 5, new_tokens, samples=1)
    res["compile_cold_s"] = time.perf_counter() - t0
    if compile and "compile" in metrics:
        torch._dynamo.reset()
        steps = compile_steps(compile, compile_prefill=False)
        sync(device)
        t0 = time.perf_counter()
        decode_rate(model, device, steps, 5, new_tokens, samples=1)
        res["compile_warm_s"] = time.perf_counter() - t0
    res["tok_s"] = decode_rate(model, device, steps, 5, new_tokens, samples=samples)
    res["gb_s"] = nbytes * res["tok_s"] / 1e9
    res["pct_bandwidth"] = 100 * nbytes * res["tok_s"] / bandwidth
    if device.type == "cuda":
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        res["weights_plus_kv_gb"] = (nbytes + kv_bytes(model, 256)) / 1e9
    log(
        f"{name} {mode}: {res['tok_s']:.1f} tok/s, {res['gb_s']:.0f} GB/s "
        f"({res['pct_bandwidth']:.0f}% of measured), compile {res['compile_cold_s']:.1f} s"
    )

    if "profile" in metrics and device.type == "cuda":
        res["profile"] = profile_decode(model, device, steps, new_tokens)

    if "batch8" in metrics:
        model.setup_caches(8, 256)
        decode_rate(model, device, steps, 5, new_tokens, batch=8, samples=1)
        res["batch8_tok_s"] = decode_rate(model, device, steps, 5, new_tokens, batch=8, samples=3)
        log(f"  batch 8: {res['batch8_tok_s']:.1f} tok/s total")

    if "context" in metrics:
        for ctx in (4096, 32768):
            if ctx + 256 > model.config.block_size or (device.type == "cpu" and ctx > 4096):
                continue
            model.setup_caches(1, ctx + 256)
            fill_caches(model)
            n = min(64, new_tokens)
            decode_rate(model, device, steps, 1, n, start_pos=ctx, samples=1)
            rate = decode_rate(model, device, steps, 1, n, start_pos=ctx, samples=3)
            # bytes per step: the weights plus the filled cache
            moved = nbytes + kv_bytes(model, ctx)
            res[f"ctx{ctx}_tok_s"] = rate
            res[f"ctx{ctx}_gb_s"] = moved * rate / 1e9
            log(f"  context {ctx}: {rate:.1f} tok/s, {moved * rate / 1e9:.0f} GB/s incl. KV")
        if "ctx32768_gb_s" in res:
            res["ctx32768_vs_short_pct"] = 100 * res["ctx32768_gb_s"] / res["gb_s"]

    if "ttft" in metrics:
        model.setup_caches(1, 8192 + 256)
        prefill_steps = compile_steps(compile, compile_prefill=compile)
        c = model.config
        for n in (128, 2048, 8192):
            if n + 1 > model.config.block_size:
                continue
            prompt = torch.randint(0, 1000, (1, n), device=device)

            def first_token(prompt=prompt, model=model):
                return generate(model, prompt, 1, temperature=0.8, top_k=200, **prefill_steps)

            dt = timed(first_token, device, reps=3, warmup=1)
            n_params = nbytes / model.layers[0].attention.wo.weight.element_size()
            flops = 2 * n_params * n + 2 * c.n_layer * c.n_head * c.head_dim * n * n
            res[f"ttft{n}_ms"] = dt * 1e3
            res[f"ttft{n}_tflops"] = flops / dt / 1e12
            log(f"  prefill {n}: {dt * 1e3:.1f} ms, {flops / dt / 1e12:.0f} TFLOP/s")
        if peak_tflops and "ttft2048_tflops" in res:
            res["ttft2048_pct_peak"] = 100 * res["ttft2048_tflops"] / peak_tflops
    del model
    return res


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------

# A prompt whose answer mostly repeats the prompt: what prompt lookup is for.
EDIT_PASSAGE = (
    "The old lighthouse stood at the end of the harbour wall. Every evening the keeper climbed "
    "the ninety steps, lit the lamp and wrote the weather in a small green book. Ships passing "
    "in the night saw the beam turn once every twelve seconds, and the fishermen said they could "
    "set their watches by it. When the keeper retired, the town kept the lamp burning and a "
    "volunteer climbed the steps in his place."
)
EDIT_PROMPT = (
    "Repeat the following passage exactly, but replace the word 'keeper' with 'guardian' "
    "everywhere:\n\n" + EDIT_PASSAGE
)


def speculative_rate(sp, prompt, new_tokens, samples, stop_ids=frozenset(), **sampling) -> dict:
    # Mean tok/s and acceptance of speculative.generate over samples runs, after one warm-up.
    import speculative

    speculative.generate(sp, prompt, new_tokens, stop_ids=stop_ids, **sampling)
    rates, kept, plain, lengths, runs = [], [], [], [], []
    for _ in range(samples):
        speculative.generate(sp, prompt, new_tokens, stop_ids=stop_ids, **sampling)
        s = sp.stats
        rates.append(s.tokens / s.seconds)
        kept.append(s.mean_accepted)
        plain.append(s.plain_tokens / max(s.tokens, 1))
        lengths.append(s.tokens)
        # Where the time went: plain steps, and the rest (prefill, speculative rounds).
        runs.append(dict(seconds=s.seconds, plain_tokens=s.plain_tokens,
                         plain_seconds=s.plain_seconds, histogram=s.accepted))  # fmt: skip
    return dict(
        tokens=statistics.mean(lengths),
        tok_s=statistics.mean(rates),
        mean_kept=statistics.mean(kept),
        k=sp.k,
        plain_fraction=statistics.mean(plain),
        runs=runs,
    )


def bench_speculative(
    name,
    device,
    dtype,
    spec_checkpoint,
    new_tokens=200,
    samples=3,
    temperatures=(0.8, 0.0),
    spec_cases=("int4", "other", "ngram"),
) -> list:
    # 1. name in bf16 as target, its own int4 (same random weights) as draft;
    # 2. low acceptance: a draft with other random weights, and prompt lookup on random text
    #    (adaptive k must fall back to plain decoding: at most 5% slower);
    # 3. prompt lookup on a real checkpoint (spec_checkpoint) asked to repeat and edit a passage.
    import speculative

    steps = compile_steps(True, compile_prefill=False)
    results = []
    prompt = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)

    def plain_rate(model, prompt, n, temperature, stop_ids=frozenset()):  # after a warm-up run
        rate = partial(
            decode_rate, model, device, steps, prompt, n, temperature=temperature, stop_ids=stop_ids
        )  # fmt: skip
        rate(samples=1)
        return rate(samples=samples)

    target = random_model(name, "bf16", device, dtype)
    max_len = 5 + new_tokens + 64
    target.setup_caches(1, max_len)
    for temperature in temperatures:
        sampling = dict(temperature=temperature, top_k=200)
        base = plain_rate(target, prompt, new_tokens, temperature)
        cases = {
            "int4": ("draft int4.g32, same weights", dict(mode="int4.g32", seed=0), None),
            "other": ("draft bf16, other weights", dict(mode="bf16", seed=1), None),
            "ngram": ("3-gram lookup, random text", None, 3),
        }
        for label, draft_spec, ngram in (cases[c] for c in spec_cases):
            draft = None
            if draft_spec is not None:
                draft = random_model(name, device=device, dtype=dtype, **draft_spec)
            sp = speculative.setup(
                target, None, None, 5 if draft else 8, ngram, device, max_len, True, draft=draft
            )
            r = speculative_rate(sp, prompt, new_tokens, samples, **sampling)
            r.update(target=f"{name} bf16", case=label, temperature=temperature, plain_tok_s=base)
            r["speedup"] = r["tok_s"] / base
            log(
                f"speculative {name} {label} T={temperature}: {r['tok_s']:.1f} tok/s vs plain "
                f"{base:.1f} ({r['speedup']:.2f}x), mean kept {r['mean_kept']:.2f} of {r['k']}"
            )
            results.append(r)
            del sp, draft
    del target

    if spec_checkpoint is not None:
        from generate import load_model
        from tokenizer import get_tokenizer

        path = Path(spec_checkpoint)
        tok = get_tokenizer(path.parent)
        model = load_model(path, device, dtype)
        ids = tok.encode_chat([{"role": "user", "content": EDIT_PROMPT}])
        prompt = torch.tensor([ids], device=device)
        n = 160
        model.setup_caches(1, len(ids) + n + 64)
        # The reply ends at the chat's end-of-turn token, as in generate.py: past it the model
        # writes new text that no lookup can propose.
        stops = frozenset(tok.stop_ids)
        for temperature in temperatures:
            sampling = dict(temperature=temperature, top_k=200)
            base = plain_rate(model, prompt, n, temperature, stops)
            sp = speculative.setup(model, tok, None, 8, 3, device, len(ids) + n + 64, True)
            r = speculative_rate(sp, prompt, n, samples, stops, **sampling)
            r.update(target=str(path), case="3-gram lookup, repeat-and-edit prompt",
                     temperature=temperature, plain_tok_s=base)  # fmt: skip
            r["speedup"] = r["tok_s"] / base
            log(
                f"speculative {path.parent.name} 3-gram T={temperature}: {r['tok_s']:.1f} tok/s "
                f"vs plain {base:.1f} ({r['speedup']:.2f}x), mean kept {r['mean_kept']:.2f}"
            )
            results.append(r)
    return results


# ---------------------------------------------------------------------------------------------
# Kernels alone
# ---------------------------------------------------------------------------------------------


def gemv_shapes(config: ModelArgs) -> dict:
    # layer -> (N, K) of one decode step's GEMVs; a Mixture-of-Experts model's w13 and w2 are
    # expert GEMVs ("w13_experts", "w2_experts": one expert's shape, k rows each its own expert).
    c = config
    mlp = "_experts" if c.num_experts else ""
    return {
        "wqkv": ((c.n_head + 2 * c.n_kv_heads) * c.head_dim, c.dim),
        "wo": (c.dim, c.n_head * c.head_dim),
        "w13" + mlp: (2 * c.intermediate_size, c.dim),
        "w2" + mlp: (c.dim, c.intermediate_size),
        "output": (c.vocab_size, c.dim),
    }


def make_weight(fmt, N, K, device, groupsize=32):
    import fastgen_kernels as kernels

    if fmt == kernels.FLOAT:
        return dict(weight=torch.randn(N, K, device=device, dtype=torch.bfloat16))
    if fmt == kernels.INT8:
        w = torch.randint(-127, 128, (N, K), device=device, dtype=torch.int8)
        return dict(weight=w, scales=torch.rand(N, device=device, dtype=torch.bfloat16))
    if fmt == kernels.FP8:
        w = torch.randn(N, K, device=device).to(torch.float8_e4m3fn)
        return dict(weight=w, scales=torch.rand(N, device=device, dtype=torch.float32))
    from quantize import quantize_int4

    weight, scales, zeros = quantize_int4(torch.randn(N, K, device=device), groupsize)
    words = kernels.int4_group_words(scales, zeros)  # as GemvLinear passes them
    return dict(weight=weight, scales=words, zeros=None, groupsize=groupsize)


def layer_fusion(layer: str, K: int, device) -> dict:
    # What a decode step fuses into each GEMV (kernels.FusedBlock): RMSNorm before wqkv and w13,
    # SwiGLU before w2, the residual add after wo and w2.
    g = torch.Generator(device=device).manual_seed(3)
    if layer in ("wqkv", "w13", "w13_experts"):  # MoE: the router's and w13's prologue
        return dict(norm_weight=torch.rand(K, device=device, generator=g).to(torch.bfloat16))
    if layer == "w2":
        return dict(glu=True, residual=True)
    if layer == "w2_experts":  # the experts' outputs are mixed after, not added in place
        return dict(glu=True)
    if layer == "wo":
        return dict(residual=True)
    return {}


def expert_stack(fmt, n_experts, N, K, device, groupsize=32) -> dict:
    # make_weight's tensors for n_experts experts, stacked [E, ...] as quantize.py stores them.
    parts = [make_weight(fmt, N, K, device, groupsize) for _ in range(n_experts)]
    names = [k for k in parts[0] if torch.is_tensor(parts[0][k])]
    stack = {k: torch.stack([p[k] for p in parts]) for k in names}
    return dict(stack, groupsize=groupsize) if "groupsize" in parts[0] else stack


def time_launches(launch, device, n: int = 20) -> float:
    # Seconds per kernel launch: launch(i) for i < n, each on its own rotating inputs, in one
    # CUDA graph, as a decode step runs them; timing replays measures the GPU, not Python's
    # launch overhead. On CPU (Triton's interpreter or references): plain calls.
    def run_many():
        for i in range(n):
            launch(i)

    if device.type != "cuda":
        return timed(run_many, device, reps=1, warmup=0) / n
    run_many()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_many()
    return timed(graph.replay, device, reps=10) / n


def bench_gemv(
    fmt, N, K, device, bandwidth, config=None, groupsize=32, rows=1, fusion=None, experts=(0, 0)
):  # fmt: skip
    # Achieved read bandwidth of one GEMV (with its layer's fusion), weights rotated through
    # copies larger than L2. experts (E, k): an expert GEMV as Mixtral decodes a token, the
    # weights a stack of E experts of which each launch reads k (a new random pick each time):
    # w13 has one row of x shared by the k experts, w2 (glu) a row per expert.
    import fastgen_kernels as kernels

    fused = dict(fusion or {})
    E, k = experts
    if E:
        one = expert_stack(fmt, E, N, K, device, groupsize)
        nbytes = sum(t[0].numel() * t.element_size() for t in one.values() if torch.is_tensor(t))
        nbytes *= k  # the bytes one launch reads
        copies = [one]  # different experts each launch
        rows = k if fused.get("glu") else 1
        g = torch.Generator().manual_seed(0)
        picks = [torch.randperm(E, generator=g)[:k].to(device, torch.int32) for _ in range(20)]
    else:
        one = make_weight(fmt, N, K, device, groupsize)
        nbytes = sum(t.numel() * t.element_size() for t in one.values() if torch.is_tensor(t))
        copies = [one]
        copies += [make_weight(fmt, N, K, device, groupsize) for _ in range(L2_BYTES // nbytes)]
        picks = [None] * 20
    x = torch.randn(rows, 2 * K if fused.get("glu") else K, device=device, dtype=torch.bfloat16)
    if fused.get("residual"):
        fused["residual"] = torch.randn(rows, N, device=device, dtype=torch.bfloat16)
    ref = kernels.gemv_reference(x, **one, fmt=fmt, expert_idx=picks[0], **fused)
    got = kernels.gemv(x, **one, fmt=fmt, config=config, expert_idx=picks[0], **fused)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    def launch(i):
        w = copies[i % len(copies)]
        kernels.gemv(x, **w, fmt=fmt, config=config, expert_idx=picks[i], **fused)

    dt = time_launches(launch, device)
    return dict(
        N=N,
        K=K,
        bytes=nbytes,
        us=dt * 1e6,
        gb_s=nbytes / dt / 1e9,
        pct=100 * nbytes / dt / bandwidth,
        rel_err=err,
    )


PREFILL_LAYERS = ("wo", "w13")


def bench_kernels(models, device, bandwidth, sweep=False, modes=None):
    # Each GEMV of the models alone, in the given modes (default: all); a sweep tries many
    # launch configurations per shape and keeps the best.
    import fastgen_kernels as kernels

    fmts = {
        "bf16": kernels.FLOAT,
        "int8": kernels.INT8,
        "int4.g32": kernels.INT4,
        "int4.g128": kernels.INT4,
        "fp8": kernels.FP8,
    }
    if modes:
        fmts = {m: kernels.INT4 if m.startswith("int4") else fmts[m] for m in modes}
    results = []
    for name in models:
        config = ModelArgs.from_name(name) if isinstance(name, str) else name
        for layer, (N, K) in gemv_shapes(config).items():
            fusion = layer_fusion(layer, K, device)
            experts = (0, 0)
            if layer.endswith("_experts"):
                experts = (config.num_experts, config.num_activated_experts)
            for mode, fmt in fmts.items():
                g = int(mode.partition(".g")[2] or 32)
                if fmt == kernels.INT4 and K % g:
                    continue
                configs = sweep_configs(fmt, N, K, g, experts[1]) if sweep else [None]
                best = None
                for cfg in configs:
                    try:
                        r = bench_gemv(fmt, N, K, device, bandwidth, cfg, g, fusion=fusion,
                                       experts=experts)  # fmt: skip
                    except Exception as e:  # noqa: BLE001 - a sweep config may not compile
                        log(f"  config {cfg} failed: {str(e).splitlines()[0][:100]}")
                        continue
                    r.update(model=name, layer=layer, mode=mode, config=cfg)
                    if sweep:
                        log(f"    {cfg}: {r['us']:.1f} us ({r['pct']:.0f}%)")
                    if best is None or r["pct"] > best["pct"]:
                        best = r
                if best is None:
                    continue
                results.append(best)
                log(
                    f"{name} {layer} [{N}x{K}] {mode}: {best['us']:.1f} us, "
                    f"{best['gb_s']:.0f} GB/s ({best['pct']:.0f}%), err {best['rel_err']:.1e}"
                    + (f", best {best['config']}" if sweep else "")
                )
    return results


# (cache slots, position) at which decode attention is timed alone: the protocol's short
# context, a 1024-slot cache near full (one program per kv head walks all of it), and 4k and
# 32k as the context metric decodes them.
ATTENTION_CONTEXTS = ((256, 200), (1024, 1000), (4352, 4096), (33024, 32768))


def attention_sweep(slots: int) -> list:
    # Launch parameters for decode attention: sequence slots per program (fewer: more programs
    # and a combine step), slots per loop step, warps, pipeline depth, the loop's options
    # (fastgen_kernels._decode_attention_launch). The default comes first.
    import fastgen_kernels as kernels

    default = kernels.attention_chunk(slots)
    chunks = sorted({default, max(64, default // 4), max(64, default // 2)})
    configs = [None]
    for chunk in chunks:
        for block_s in (32, 64, 128):
            if block_s > chunk:
                continue
            for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 2)):
                configs.append(dict(CHUNK=chunk, BLOCK_S=block_s, num_warps=warps,
                                    num_stages=stages))  # fmt: skip
    # the loop's options at the default chunk (STREAMS: one program per query head)
    for option in ("STREAMS", "AHEAD", "PREFETCH"):
        for block_s in (32, 64):
            configs.append({"CHUNK": default, "BLOCK_S": min(block_s, default), option: True})
    return configs


def bench_attention(models, device, bandwidth, sweep=False) -> list:
    # Decode attention alone as a step runs it (FusedBlock's kernel: rotary embedding, cache
    # write, attention over the filled slots) for each model's heads. A sweep keeps the fastest
    # launch whose output matches the default's.
    import os

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        log("attention: timed on CUDA (or in Triton's interpreter) only")
        return []
    results = []
    for name in models:
        c = ModelArgs.from_name(name) if isinstance(name, str) else name
        contexts = ATTENTION_CONTEXTS if device.type == "cuda" else ((64, 40),)
        for slots, pos in contexts:
            if pos >= c.block_size and c.rope_scaling is None and device.type == "cuda":
                continue  # beyond what the model was trained for (Llama-2: 4096)
            best = attention_case(c, slots, pos, device, bandwidth, sweep)
            if best is None:
                continue
            best["model"] = name if isinstance(name, str) else "custom"
            results.append(best)
            log(
                f"{best['model']} attention, {slots} slots at position {pos}: "
                f"{best['us']:.1f} us, {best['gb_s']:.0f} GB/s ({best['pct']:.0f}%)"
                + (f", best {best['config']}" if sweep else "")
            )
    return results


def attention_case(c: ModelArgs, slots, pos, device, bandwidth, sweep) -> dict | None:
    # One model's heads, a cache of `slots` filled up to `pos`, caches rotated beyond L2;
    # bandwidth counts the keys and values read.
    import fastgen_kernels as kernels

    H, H_kv, D = c.n_head, c.n_kv_heads, c.head_dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elt = torch.finfo(dtype).bits // 8
    copies = min(16, L2_BYTES // (2 * H_kv * slots * D * elt) + 1)
    shape = (1, H_kv, slots, D)
    caches = [(torch.randn(shape, device=device, dtype=dtype),
               torch.randn(shape, device=device, dtype=dtype)) for _ in range(copies)]  # fmt: skip
    qkv = torch.randn(1, 1, (H + 2 * H_kv) * D, device=device, dtype=dtype)
    angle = torch.rand(slots, D // 2, device=device) * 6.28
    freqs = torch.stack([angle.cos(), angle.sin()], dim=-1)  # the rotary table [slots, D/2, 2]
    input_pos = torch.tensor([pos], device=device)
    nbytes = 2 * H_kv * (pos + 1) * D * elt

    def run(cfg, i=0):
        k, v = caches[i % copies]
        return kernels._decode_attention_launch(qkv, k, v, input_pos, freqs, H, config=cfg)

    want = run(None).float()
    best = None
    for cfg in attention_sweep(slots) if sweep else [None]:
        try:
            err = ((run(cfg).float() - want).abs().max() / want.abs().max()).item()
        except Exception as e:  # noqa: BLE001 - a sweep config may not compile
            log(f"  attention config {cfg} failed: {str(e).splitlines()[0][:100]}")
            continue

        dt = time_launches(lambda i, cfg=cfg: run(cfg, i), device)
        r = dict(layer="attention", slots=slots, pos=pos, bytes=nbytes, us=dt * 1e6,
                 gb_s=nbytes / dt / 1e9, pct=100 * nbytes / dt / bandwidth, rel_err=err,
                 config=cfg)  # fmt: skip
        if sweep:
            log(f"    {cfg}: {r['us']:.1f} us, err {err:.1e}")
        if err < 1e-2 and (best is None or r["us"] < best["us"]):
            best = r
    return best


def bench_prefill(models, device, rows_list, peak_tflops=None) -> list:
    # Quantized weights against many rows (prefill): gemv's GEMM tiles, which dequantize each
    # tile in registers, against dequantizing the whole weight for a cuBLAS matmul, per layer.
    import fastgen_kernels as kernels
    import quantize

    plain = {kernels.INT8: quantize.int8_linear, kernels.FP8: quantize.fp8_linear}
    results = []
    for name in models:
        for layer, (N, K) in gemv_shapes(ModelArgs.from_name(name)).items():
            if layer not in PREFILL_LAYERS:
                continue
            for mode, fmt in (("int8", kernels.INT8), ("int4.g32", kernels.INT4),
                              ("int4.g128", kernels.INT4), ("fp8", kernels.FP8)):  # fmt: skip
                g = int(mode.partition(".g")[2] or 32)
                if fmt == kernels.INT4 and K % g:
                    continue
                w = make_weight(fmt, N, K, device, g)
                if fmt == kernels.INT4:
                    scales, zeros = kernels.int4_group_pairs(w["scales"])
                    dense = partial(quantize.int4_linear, weight=w["weight"], scales=scales,
                                    zeros=zeros, groupsize=g)  # fmt: skip
                else:
                    dense = partial(plain[fmt], weight=w["weight"], scales=w["scales"])
                for rows in rows_list:
                    x = torch.randn(rows, K, device=device, dtype=torch.bfloat16)
                    ref = kernels.gemv_reference(x, fmt=fmt, **w).float()
                    got = kernels.gemv(x, fmt=fmt, **w).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    t_tiles = timed(partial(kernels.gemv, x, fmt=fmt, **w), device)
                    t_dense = timed(partial(dense, x), device)
                    flops = 2 * rows * N * K
                    r = dict(model=name, layer=layer, mode=mode, N=N, K=K, rows=rows,
                             tiles_us=t_tiles * 1e6, dequant_cublas_us=t_dense * 1e6,
                             tiles_tflops=flops / t_tiles / 1e12, rel_err=err)  # fmt: skip
                    results.append(r)
                    log(
                        f"prefill {name} {layer} [{N}x{K}] {mode} rows {rows}: tiles "
                        f"{r['tiles_us']:.0f} us ({r['tiles_tflops']:.0f} TFLOP/s), dequantize + "
                        f"cuBLAS {r['dequant_cublas_us']:.0f} us, err {err:.1e}"
                    )
    return results


def sweep_configs(fmt, N, K, groupsize=32, experts=0):
    # The launch parameters that matter most: rows per program, columns per step, warps, K steps
    # loaded ahead; for int8 also the element-wise path against the 32-bit-word one. The
    # default comes first.
    # experts: the rows of an expert GEMV (each its own expert).
    import fastgen_kernels as kernels

    default = kernels.gemv_config(fmt, 1, N, K, groupsize, experts)
    if fmt == kernels.FLOAT:
        grid = [(bn, bk, 4) for bn in (4, 8, 16) for bk in (512, 1024)]
    elif fmt == kernels.INT4:  # columns per step no wider than K
        grid = [(8, 1024, 2), (16, 1024, 2), (16, 1024, 4), (32, 1024, 4), (32, 1024, 8)]
        grid += [(64, 1024, 8), (64, 1024, 16), (16, 512, 2), (32, 512, 4), (16, 2048, 8)]
        grid += [(8, 2048, 4), (16, 2048, 4)]
        grid = [(bn, bk, w) for bn, bk, w in grid if bk <= K]
    else:
        grid = [(8, 1024, 4), (8, 2048, 4), (16, 2048, 4), (32, 512, 4), (32, 1024, 4)]
        grid += [(16, 1024, 8), (16, 2048, 8)]
    configs = [default]
    triton_default = {k: v for k, v in default.items() if k != "GLUON"}  # no Gluon kernel
    configs += [dict(triton_default, STAGES=s) for s in (1, 2, 3, 4)
                if s != default["STAGES"] or "GLUON" in default]  # fmt: skip
    if fmt == kernels.INT8:  # one-row int4 has the word path only
        configs.append(dict(triton_default, WORDS=False))
    if not experts and kernels.gluon is not None:
        # the Gluon kernels: rows per program, and warps (each warp 512 bytes of a row per
        # step: 1024 k for int4, 512 for int8, 256 for bfloat16)
        for rows_warps in [(4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 2), (16, 4), (32, 4)]:
            configs.append(dict(triton_default, GLUON=rows_warps))
        for rows_warps in [(4, 2), (8, 2), (8, 4)]:  # two K steps loaded before the wait
            configs.append(dict(triton_default, GLUON=(*rows_warps, 1, 2)))
        if fmt == kernels.INT4 and K <= 4096:  # and tiles of rows per program (one K step)
            for tiles in [(8, 4, 4), (8, 4, 8), (16, 4, 2), (16, 4, 4), (16, 4, 8)]:
                configs.append(dict(triton_default, GLUON=tiles))
    for bn, bk, warps in grid:
        split = kernels.split_k(N, K, bn, bk, max(experts, 1))
        for stages in (1, 3):  # a plain loop, and K steps loaded ahead through shared memory
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, SPLIT_K=split, STAGES=stages)
            configs.append(dict(triton_default, **cfg))
    return configs


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def plot(results: list[dict], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "tok_s" in r]
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    ax.bar(labels, [r["pct_bandwidth"] for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["pct_bandwidth"] + 1, f"{r['tok_s']:.0f} tok/s", ha="center", fontsize=8)
    ax.set_ylabel("% of measured read bandwidth")
    ax.set_ylim(0, 110)
    ax.set_title("fastgen decode, batch size 1")
    fig.tight_layout()
    fig.savefig(path)


METRICS = ("decode", "compile", "batch8", "context", "ttft", "profile")
SPEC_CASES = ("int4", "other", "ngram")


def check_arguments(
    modes, metrics, new_tokens, samples, spec_temperatures, spec_cases, prefill_rows=None
):  # fmt: skip
    # Bad flags fail before minutes of model building, each with one line.
    for mode in (modes or "bf16").split(","):
        kind, _, group = mode.replace("-gptq", "").partition(".g")
        if kind not in ("bf16", "int8", "int4", "fp8") or (kind == "int4") != group.isdigit():
            raise UserError(f"unknown mode {mode!r} (bf16, int8, int4.gN, int4-gptq.gN, fp8)")
    for metric in metrics.split(","):
        if metric not in METRICS:
            raise UserError(f"unknown metric {metric!r} (one of {', '.join(METRICS)})")
    if new_tokens < 1 or samples < 1:
        raise UserError(f"--new_tokens and --samples must be >= 1, got {new_tokens}, {samples}")
    for case in spec_cases.split(","):
        if case not in SPEC_CASES:
            raise UserError(f"unknown --spec_cases entry {case!r} (one of {', '.join(SPEC_CASES)})")
    try:
        [float(t) for t in spec_temperatures.split(",")]
    except ValueError:
        raise UserError(f"--spec_temperatures takes numbers, got {spec_temperatures!r}") from None
    if prefill_rows is not None:
        rows = prefill_rows.split(",")
        if not all(r.isdigit() and int(r) > 0 for r in rows):
            raise UserError(f"--prefill_rows takes positive row counts, got {prefill_rows!r}")


def main(
    models, modes, device, out, plot_path, metrics, kernels_only, sweep, compile, precision,
    new_tokens, samples, kernels, speculative, spec_checkpoint, spec_temperatures,
    spec_cases, prefill_rows=None,
):  # fmt: skip
    try:
        dev = pick_device(device)
        if tp.maybe_init_distributed(dev)[0] > 0:  # torchrun: one rank per GPU
            out = plot_path = None  # rank 0 writes the files
        dtype = PRECISIONS[precision or ("bfloat16" if dev.type == "cuda" else "float32")]
        names = models.split(",")
        for name in names:
            ModelArgs.from_name(name)
        check_arguments(
            modes, metrics, new_tokens, samples, spec_temperatures, spec_cases, prefill_rows
        )  # fmt: skip
    except (UserError, ConfigError) as e:
        sys.exit(f"error: {e}")
    report = dict(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
    )
    report["read_gb_s"] = read_bandwidth(dev, (4 << 30) if dev.type == "cuda" else (64 << 20)) / 1e9
    log(f"measured read bandwidth {report['read_gb_s']:.0f} GB/s")
    peak = None
    if dev.type == "cuda":
        peak = report["bf16_tflops"] = matmul_tflops(dev)
        log(f"measured bf16 matmul {peak:.0f} TFLOP/s")
    if kernels_only or sweep:
        kernel_modes = modes.split(",") if modes else None
        report["kernels"] = bench_kernels(
            names, dev, report["read_gb_s"] * 1e9, sweep, kernel_modes
        )  # fmt: skip
        report["attention"] = bench_attention(names, dev, report["read_gb_s"] * 1e9, sweep)
        if prefill_rows:
            rows = [int(r) for r in prefill_rows.split(",")]
            report["prefill"] = bench_prefill(names, dev, rows, peak)
    elif speculative:
        temps = tuple(float(t) for t in spec_temperatures.split(","))
        report["speculative"] = bench_speculative(
            names[0],
            dev,
            dtype,
            spec_checkpoint,
            temperatures=temps,
            spec_cases=spec_cases.split(","),
        )
    else:
        report["results"] = []
        for name in names:
            for mode in (modes or "bf16").split(","):
                r = bench_model(
                    name,
                    mode,
                    dev,
                    dtype,
                    metrics.split(","),
                    report["read_gb_s"] * 1e9,
                    peak,
                    compile,
                )
                report["results"].append(r)
                if out:  # write as we go: a long run that dies still leaves its numbers
                    Path(out).write_text(json.dumps(report, indent=1))
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    if plot_path and report.get("results"):
        plot(report["results"], plot_path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark fastgen decoding on random weights.")
    p.add_argument("--models", default="Llama-2-7B", help="comma-separated names from model.py")
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated: bf16, int8, int4.gN, int4-gptq.gN (as int4), fp8 (default: bf16; "
        "with --kernels_only: bf16, int8, int4.g32, int4.g128, fp8)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--plot",
        dest="plot_path",
        type=Path,
        default=None,
        help="draw the table as a PNG (needs matplotlib)",
    )
    p.add_argument(
        "--metrics",
        default="decode,compile,batch8,context,ttft",
        help="which measurements beyond decode tok/s",
    )
    p.add_argument(
        "--kernels_only",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="benchmark each GEMV alone on the models' shapes",
    )
    p.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --kernels_only: try many launch configurations, report the best",
    )
    p.add_argument(
        "--prefill_rows",
        default=None,
        help="with --kernels_only: also time quantized weights against these comma-separated "
        "row counts (gemv's GEMM tiles vs dequantize + cuBLAS)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the decode step as generate.py --compile does",
    )
    p.add_argument("--precision", choices=sorted(PRECISIONS), default=None)
    p.add_argument("--new_tokens", type=int, default=200, help="tokens per decode sample")
    p.add_argument("--samples", type=int, default=5, help="timed decode samples")
    p.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="benchmark speculative decoding: the first model in bf16 with its own int4 as "
        "draft, low-acceptance cases, and prompt lookup on --spec_checkpoint",
    )
    p.add_argument(
        "--spec_checkpoint",
        type=Path,
        default=None,
        help="with --speculative: a real model.pth for the prompt-lookup (repeat and edit) case",
    )
    p.add_argument(
        "--spec_temperatures",
        default="0.8,0",
        help="with --speculative: comma-separated sampling temperatures to measure",
    )
    p.add_argument(
        "--spec_cases",
        default="int4,other,ngram",
        help="with --speculative: int4 (the model's own int4 as draft), other (a draft with "
        "other random weights), ngram (prompt lookup on random text)",
    )
    p.add_argument(
        "--kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="use fastgen's Triton kernels (off: plain torch.compile)",
    )
    return p


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))
