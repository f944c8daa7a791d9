# Mixture-of-Experts (Mixtral): a tiny random HF MixtralForCausalLM converted gives HF's logits and
# greedy tokens; the KV cache and the gather (decode) and per-expert (prefill) paths agree with a
# full forward; quantized expert stacks equal their dequantized weights; Mistral's original
# consolidated files convert to the same tensors as the HF ones; 2 gloo ranks equal one process
# with each expert's hidden units split (tensor) and with the experts split (expert).
#
# The rank side of the last test lives here too: `python tests/test_moe.py tp OUT_DIR`, started
# once per rank by test_tp.launch.
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY

ROOT = Path(__file__).resolve().parents[1]
# helpers.TINY (dim 64, 2 layers, GQA) with 4 experts, top 2: one row decodes by gather (2 < 4),
# two rows and prompts expert by expert.
TINY_MIXTRAL = dict(TINY, num_local_experts=4, num_experts_per_tok=2)
# For tp: 6 heads of 16 dims (test_tp's BASE) and 8 experts, 4 per rank with --moe_parallel expert.
TP_MOE = dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
TP_MODES = ("float32", "int8", "int4")


def make_hf_mixtral(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**TINY_MIXTRAL)).eval()
    model.generation_config.eos_token_id = None  # greedy runs its full length, as ours does
    model.config.eos_token_id = None
    with torch.no_grad():  # default init leaves norms at 1: randomise so every tensor matters
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    # (HF model, its save_pretrained folder, our converted model with caches for batch 2)
    from convert_hf_checkpoint import convert_hf_checkpoint
    from generate import load_model

    hf = make_hf_mixtral()
    path = tmp_path_factory.mktemp("mixtral")
    hf.save_pretrained(path)
    convert_hf_checkpoint(path)
    model = load_model(path / "model.pth", "cpu", torch.float32)
    model.setup_caches(2, 64)
    return hf, path, model


def prompt(batch: int = 2, length: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Against Hugging Face
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def test_logits_equal_hf(hf_and_ours):
    hf, _, model = hf_and_ours
    x = prompt()
    want = hf(x).logits
    got = model(x, torch.arange(x.shape[1]))
    assert (got - want).abs().max() <= 1e-4
    ff = model.layers[0].feed_forward
    assert type(ff).__name__ == "MOEFeedForward"
    assert ff.w13.weight.shape == (4, 2 * 96, 64) and ff.w2.weight.shape == (4, 64, 96)


@torch.no_grad()
def test_greedy_tokens_equal_hf(hf_and_ours):
    from generate import generate

    hf, _, model = hf_and_ours
    for batch in (1, 2):  # gather path for one row, the expert loop for two
        x = prompt(batch, 6, seed=batch)
        want = hf.generate(x, max_new_tokens=24, do_sample=False)[:, x.shape[1] :].tolist()
        model.setup_caches(batch, 64)
        assert generate(model, x, 24, temperature=0) == want


def test_fused_hf_layout_converts_the_same(hf_and_ours, tmp_path):
    # transformers 5 keeps the experts fused in memory (mlp.experts.gate_up_proj [E, 2I, D]);
    # save_pretrained splits them again, but other tools may write the fused names.
    from safetensors.torch import save_file

    from convert_hf_checkpoint import convert_hf_checkpoint

    hf, path, _ = hf_and_ours
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    convert_hf_checkpoint(tmp_path)
    assert_same_tensors(tmp_path / "model.pth", path / "model.pth")


def assert_same_tensors(a: Path, b: Path):
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_consolidated_files_convert_like_hf(hf_and_ours, tmp_path):
    # Mistral's original release: params.json and consolidated.NN.pth with Meta's names, q/k
    # rows in the interleaved rotary layout, experts one tensor each.
    from convert_hf_checkpoint import convert_hf_checkpoint
    from model import ModelArgs

    hf, path, _ = hf_and_ours
    cfg = TINY_MIXTRAL
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]

    def interleave(w, heads):  # HF's half-split rotary rows -> pairs (Meta's original layout)
        return w.view(heads, 2, hd // 2, -1).transpose(1, 2).reshape(w.shape)

    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
             "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
             "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate": "feed_forward.gate"}  # fmt: skip
    original = {
        "tok_embeddings.weight": hf.model.embed_tokens.weight,
        "norm.weight": hf.model.norm.weight,
        "output.weight": hf.lm_head.weight,
    }
    for i, layer in enumerate(hf.model.layers):
        for hf_name, name in names.items():
            w = layer.get_submodule(hf_name).weight
            if name == "attention.wq":
                w = interleave(w, cfg["num_attention_heads"])
            elif name == "attention.wk":
                w = interleave(w, cfg["num_key_value_heads"])
            original[f"layers.{i}.{name}.weight"] = w
        experts = layer.mlp.experts
        for e in range(cfg["num_local_experts"]):
            w1, w3 = experts.gate_up_proj[e].chunk(2)
            for part, w in (("w1", w1), ("w2", experts.down_proj[e]), ("w3", w3)):
                original[f"layers.{i}.feed_forward.experts.{e}.{part}.weight"] = w
    original = {k: v.detach().clone() for k, v in original.items()}
    # Two files, tensors split between them (whole tensors, as Mistral's releases hold them).
    keys = sorted(original)
    torch.save({k: original[k] for k in keys[::2]}, tmp_path / "consolidated.00.pth")
    torch.save({k: original[k] for k in keys[1::2]}, tmp_path / "consolidated.01.pth")
    params = dict(dim=64, n_layers=2, head_dim=hd, hidden_dim=96, n_heads=4, n_kv_heads=2,
                  norm_eps=1e-5, vocab_size=128, rope_theta=1e6, max_seq_len=256,
                  moe=dict(num_experts=4, num_experts_per_tok=2))  # fmt: skip
    (tmp_path / "params.json").write_text(json.dumps(params))
    out = tmp_path / "out"
    convert_hf_checkpoint(tmp_path, out)
    assert_same_tensors(out / "model.pth", path / "model.pth")
    ours = ModelArgs.from_config(json.loads((out / "config.json").read_text()))
    assert ours == ModelArgs.from_config(json.loads((path / "config.json").read_text()))


# ---------------------------------------------------------------------------------------------
# KV cache and the two expert paths
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(hf_and_ours):
    _, _, model = hf_and_ours
    for batch in (1, 2):
        x = prompt(batch, 12, seed=3)
        model.setup_caches(batch, 64)
        full = model(x, torch.arange(12))
        steps = [model(x[:, :5], torch.arange(5))]
        for i in range(5, 12):
            steps.append(model(x[:, i : i + 1], torch.tensor([i])))
        assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("E,k", [(8, 2), (8, 1), (16, 4)])
def test_route_picks_and_weights_as_topk_does(E, k):
    # route's argmax picks against the rule written with torch.topk (HF's MixtralSparseMoeBlock):
    # the same experts in the same order, the same renormalised weights, eagerly and compiled.
    import moe

    logits = torch.randn(300, E, generator=torch.Generator().manual_seed(E + k)) * 3
    probs = torch.softmax(logits, dim=-1)
    want_w, want_i = torch.topk(probs, k, dim=-1)
    want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    w, i = moe.route(logits, k)
    assert torch.equal(i, want_i) and torch.equal(w, want_w)
    w, i = torch.compile(moe.route, fullgraph=True)(logits, k)  # fused: rounding may differ
    assert torch.equal(i, want_i)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)


@torch.no_grad()
def test_gather_equals_expert_loop_and_reads_only_chosen_experts(hf_and_ours):
    import moe

    ff = hf_and_ours[2].layers[1].feed_forward
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    weights, idx = moe.route(ff.gate(x), 2)
    together = moe.moe_experts(x, ff.w13, ff.w2, idx, weights)  # 18 pairs >= 4: the loop
    for r in range(9):  # one row: 2 pairs < 4 experts: the gather
        one = moe.moe_experts(x[r : r + 1], ff.w13, ff.w2, idx[r : r + 1], weights[r : r + 1])
        assert (one - together[r]).abs().max() <= 1e-6
    # The gather asks the expert stacks for exactly the chosen experts' weights.
    asked = []
    take = ff.w13.weights
    ff.w13.weights = lambda i: asked.append(i.tolist()) or take(i)
    try:
        moe.moe_experts(x[:1], ff.w13, ff.w2, idx[:1], weights[:1])
    finally:
        del ff.w13.weights
    assert asked == [idx[0].tolist()]
    # Renormalised top-2 of the softmax, as HF's router computes it.
    probs = torch.softmax(ff.gate(x), dim=-1)
    top = probs.topk(2, dim=-1)
    assert torch.allclose(weights, top.values / top.values.sum(-1, keepdim=True))


@torch.no_grad()
def test_compiled_decode_and_prefill_trace_without_breaks(hf_and_ours):
    # fullgraph: the gather path and the compile-time dense expert loop have static shapes.
    from generate import decode_one_token, generate, prefill

    _, _, model = hf_and_ours
    x = prompt(1, 7, seed=5)
    model.setup_caches(1, 64)
    want = generate(model, x, 6, temperature=0)
    steps = dict(
        decode_fn=torch.compile(decode_one_token, fullgraph=True, backend="aot_eager"),
        prefill_fn=torch.compile(prefill, fullgraph=True, backend="aot_eager"),
    )
    assert generate(model, x, 6, temperature=0, **steps) == want


# ---------------------------------------------------------------------------------------------
# Quantized experts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,groupsize", [("int8", None), ("int4", 32), ("fp8", None)])
@torch.no_grad()
def test_quantized_experts_equal_their_dequantized_weights(mode, groupsize):
    import quantize
    from moe import ExpertLinear

    g = torch.Generator().manual_seed(0)
    experts = ExpertLinear(4, 64, 96)
    experts.weight.copy_(torch.randn(4, 96, 64, generator=g))
    q = quantize.quantize_linear(experts, mode, groupsize)
    assert isinstance(q, quantize.QUANTIZED_EXPERTS)
    w = q.weights(torch.arange(4))  # [E, out, in] float32
    x = torch.randn(5, 64, generator=g)
    idx = torch.tensor([3, 0, 0, 2, 1])
    assert (q(x, idx) - torch.einsum("mi,moi->mo", x, w[idx])).abs().max() <= 1e-4
    for e in range(4):
        assert (q.expert(x, e) - F.linear(x, w[e])).abs().max() <= 1e-4
        # Each expert stored exactly as the dense format stores a linear.
        dense = quantize.quantize_weight(experts.weight[e], mode, groupsize)
        for name, t in dense.items():
            assert torch.equal(getattr(q, name)[e], t), (mode, name)
    assert (w - experts.weight).abs().max() <= (1.0 if mode == "int4" else 0.3)


def test_quantize_py_round_trip(hf_and_ours, tmp_path):
    # quantize_checkpoint -> save -> load_model gives exactly the model quantized in memory
    # (experts as *ExpertLinear, the router float) and logits near the float model's; int4-gptq
    # refuses MoE with one line.
    import quantize
    from generate import load_model

    _, path, model = hf_and_ours
    x = prompt(1, 9)
    model.setup_caches(1, 64)
    with torch.no_grad():
        want = model(x, torch.arange(9))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    for mode, groupsize, rel_tol in (("int8", None, 0.05), ("int4", 32, 0.6)):
        state = quantize.quantize_checkpoint(path / "model.pth", mode, groupsize, progress=False)
        assert state["layers.0.feed_forward.gate.weight"].dtype == torch.float32
        torch.save(state, tmp_path / f"model_{mode}.pth")
        loaded = load_model(tmp_path / f"model_{mode}.pth", "cpu", torch.float32)
        in_memory = copy.deepcopy(model)
        for name in quantize.linear_names(in_memory, skip_output=False):
            parent, _, child = name.rpartition(".")
            linear = in_memory.get_submodule(parent).get_submodule(child)
            setattr(in_memory.get_submodule(parent), child, quantize.quantize_linear(
                linear, mode, groupsize))  # fmt: skip
        ff = loaded.layers[0].feed_forward
        assert type(ff.w13).__name__ == type(ff.w2).__name__ == f"{mode.capitalize()}ExpertLinear"
        assert type(ff.gate).__name__ == "Linear"
        with torch.no_grad():
            got = []
            for m in (loaded, in_memory):
                m.setup_caches(1, 64)
                got.append(m(x, torch.arange(9)))
        assert (got[0] - got[1]).abs().max() <= 1e-5
        assert (got[0] - want).abs().mean() <= rel_tol * want.abs().mean(), mode
    with pytest.raises(quantize.QuantizeError, match="int4-gptq does not cover MoE"):
        quantize.quantize_checkpoint(path / "model.pth", "int4-gptq", 32, calibration=x)


def test_bench_kernels_times_expert_gemvs():
    # scripts/bench.py --kernels_only on a Mixture-of-Experts model times w13 and w2 as expert
    # GEMVs (k of E experts per launch); an explicit launch configuration (as --sweep passes)
    # runs the kernel itself (Triton's interpreter on CPU) against the reference.
    import bench
    import fastgen_kernels as kernels
    from model import ModelArgs

    config = ModelArgs(vocab_size=128, n_layer=2, n_head=4, n_kv_heads=2, dim=64,
                       intermediate_size=96, num_experts=4, num_activated_experts=2)  # fmt: skip
    cpu = torch.device("cpu")
    res = bench.bench_kernels([config], cpu, 1e9, modes=["int4.g32"])
    by_layer = {r["layer"]: r for r in res}
    assert set(by_layer) == {"wqkv", "wo", "w13_experts", "w2_experts", "output"}
    for layer, (N, K) in (("w13_experts", (192, 64)), ("w2_experts", (64, 96))):
        r = by_layer[layer]
        assert (r["N"], r["K"]) == (N, K)
        # two experts' int4 bytes per launch: nibbles plus bf16 scale and offset per group of 32
        assert r["bytes"] == 2 * (N * K // 2 + 2 * 2 * N * K // 32)
    cfg = bench.sweep_configs(kernels.INT4, 64, 96, 32, experts=2)[0]
    fusion = bench.layer_fusion("w2_experts", 96, cpu)
    r = bench.bench_gemv(kernels.INT4, 64, 96, cpu, 1e9, cfg, 32, fusion=fusion, experts=(4, 2))
    assert r["rel_err"] < 1e-2


def test_bench_random_model_builds_mixtral_modes():
    # scripts/bench.py --models Mixtral-8x7B --modes bf16,int8,int4.g32, on a tiny config of the
    # same kind (the real one needs 90 GB).
    import bench
    from generate import weight_bytes
    from model import ModelArgs

    config = ModelArgs(vocab_size=128, n_layer=2, n_head=4, n_kv_heads=2, dim=64,
                       intermediate_size=96, num_experts=8, num_activated_experts=2)  # fmt: skip
    assert ModelArgs.from_name("Mixtral-8x7B").num_experts == 8
    for mode, kind in (("bf16", "ExpertLinear"), ("int8", "Int8ExpertLinear"),
                       ("int4.g32", "Int4ExpertLinear")):  # fmt: skip
        model = bench.random_model(config, mode, torch.device("cpu"), torch.float32)
        assert type(model.layers[0].feed_forward.w13).__name__ == kind
        # Bandwidth counts the 2 of 8 experts a token reads.
        experts = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                      if ".w13." in n or ".w2." in n)  # fmt: skip
        others = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                     if not (".w13." in n or ".w2." in n or n.startswith("tok_emb")))  # fmt: skip
        assert weight_bytes(model) == others + experts // 4
        assert type(model.layers[0].feed_forward.gate).__name__ == "Linear"  # router stays float
        model.setup_caches(1, 16)
        with torch.no_grad():
            assert torch.isfinite(model(prompt(1, 5), torch.arange(5))).all()


# ---------------------------------------------------------------------------------------------
# Tensor and expert parallelism (2 gloo ranks)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def one_row_logits(model) -> torch.Tensor:
    # One row: prefill, then 3 greedy steps, each gathering 2 experts (fewer than a rank holds).
    x = prompt(1, 5, seed=7)
    model.setup_caches(1, 32)
    out = [model(x, torch.arange(5))]
    for i in range(3):
        out.append(model(out[-1][:, -1:].argmax(-1), torch.tensor([5 + i])))
    return torch.cat(out, dim=1)


def check_tp(out_dir: Path):
    # Rank side: each mode x parallelism, sharded logits against the same model unsharded, for
    # a padded batch of two (test_tp's) and for one row.
    from test_tp import all_logits, build_model

    import tp

    rank, world = tp.maybe_init_distributed("cpu")
    report = {}
    for parallel in tp.MOE_PARALLEL:
        for mode in TP_MODES:
            model = build_model(TP_MOE, mode)
            sharded = tp.apply_tp(copy.deepcopy(model), rank, world, moe_parallel=parallel)
            want = torch.cat([all_logits(model).flatten(), one_row_logits(model).flatten()])
            got = torch.cat([all_logits(sharded).flatten(), one_row_logits(sharded).flatten()])
            ff = sharded.layers[0].feed_forward
            report[f"{parallel}/{mode}"] = dict(
                max_diff=float((want - got).abs().max()),
                scale=float(want.abs().max()),
                n_experts=ff.w13.n_experts,
                expert_offset=ff.expert_offset,
                w13_rows=ff.w13.out_features,
                w2_cols=ff.w2.in_features,
            )
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


def test_two_ranks_equal_one_process(tmp_path):
    from test_tp import assert_all_ok, launch

    assert_all_ok(launch("tp", 2, tmp_path, script=__file__))
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(report) == 2 * len(TP_MODES)
        for case, r in report.items():
            assert r["max_diff"] <= 1e-5 * max(1.0, r["scale"]), (rank, case, r)
            if case.startswith("tensor/"):  # every expert, half of its hidden units
                assert (r["n_experts"], r["w13_rows"], r["w2_cols"]) == (8, 96, 48), case
            else:  # half of the experts, whole
                assert (r["n_experts"], r["w13_rows"], r["w2_cols"]) == (4, 192, 96), case
                assert r["expert_offset"] == 4 * rank, case


def test_expert_parallel_world_size_error():
    from test_tp import build_model

    import tp

    model = build_model(dict(TP_MOE, num_local_experts=3, num_key_value_heads=6), "float32")
    with pytest.raises(tp.TPError, match=r"3 experts do not split over 2 ranks \(valid: 1, 3\)"):
        tp.apply_tp(model, 0, 2, moe_parallel="expert")


# ---------------------------------------------------------------------------------------------
# mixtral-moe/ entry points
# ---------------------------------------------------------------------------------------------


def run_in_folder(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT / "mixtral-moe",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_folder_scripts_run_end_to_end(hf_and_ours, tmp_path):
    # From inside mixtral-moe/: convert the HF checkpoint (the same model.pth as the root script
    # wrote), then generate text with a tiny MoE checkpoint that has a tokenizer.
    from helpers import save_tiny_checkpoint

    _, path, _ = hf_and_ours
    proc = run_in_folder("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", str(path),
                         "--output_dir", str(tmp_path / "converted"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert_same_tensors(tmp_path / "converted" / "model.pth", path / "model.pth")
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", num_local_experts=4)
    proc = run_in_folder("generate.py", "--checkpoint_path", str(checkpoint), "--device", "cpu",
                         "--temperature", "0", "--max_new_tokens", "8")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "loaded" in proc.stderr


if __name__ == "__main__":
    {"tp": check_tp}[sys.argv[1]](Path(sys.argv[2]))
