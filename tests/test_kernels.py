# fastgen_kernels.py against its plain-PyTorch references: under Triton's interpreter on CPU (small
# shapes) and on the GPU (marked gpu: real shapes, odd sizes, poisoned outputs).
import pytest
import torch

kernels = pytest.importorskip("fastgen_kernels")
if kernels.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
FMTS = {"float": kernels.FLOAT, "int8": kernels.INT8, "int4": kernels.INT4, "fp8": kernels.FP8}


def make(fmt, N, K, groupsize=32, dtype=torch.float32):
    if fmt == kernels.FLOAT:
        return dict(weight=torch.randn(N, K, device=DEVICE, dtype=dtype))
    if fmt == kernels.INT8:
        w = torch.randint(-127, 128, (N, K), device=DEVICE, dtype=torch.int8)
        return dict(weight=w, scales=torch.rand(N, device=DEVICE) / 100)
    if fmt == kernels.FP8:
        w = torch.randn(N, K, device=DEVICE).to(torch.float8_e4m3fn)
        return dict(weight=w, scales=torch.rand(N, device=DEVICE))
    from quantize import quantize_int4

    weight, scales, zeros = quantize_int4(torch.randn(N, K, device=DEVICE), groupsize)
    return dict(weight=weight, scales=scales, zeros=zeros, groupsize=groupsize)


def poison():
    # Leave NaNs in the allocator's free memory, so an output the kernel fails to write shows.
    if GPU:
        torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE).fill_(255)


SHAPES = [(37, 256), (64, 512), (129, 384)] + (
    [(4096, 4096), (11008, 4096), (4096, 11008)] if GPU else []
)


@pytest.mark.parametrize("fmt", sorted(FMTS))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("stages", [1, 3])  # 3: K steps loaded ahead (on GPU, cp.async)
def test_gemv_matches_reference(fmt, rows, split_k, stages):
    torch.manual_seed(rows + split_k)
    for N, K in SHAPES:
        w = make(FMTS[fmt], N, K)
        x = torch.randn(rows, K, device=DEVICE)
        b = torch.randn(N, device=DEVICE)
        ref = kernels.gemv_reference(x, fmt=FMTS[fmt], bias=b, **w)
        cfg = dict(
            BLOCK_M=1 if rows == 1 else 16,
            BLOCK_N=16,
            BLOCK_K=128,
            SPLIT_K=split_k,
            num_warps=4,
            num_stages=2,
            STAGES=stages,
        )
        poison()
        got = kernels.gemv(x, fmt=FMTS[fmt], bias=b, config=cfg, **w)
        # tf32 tensor cores on GPU for the multi-row path; float32 sums in the interpreter.
        # One row of int8/int4 goes through the 32-bit-word path, exact to about 2^-14 of |y|.
        tol = 2e-3 if GPU and rows > 1 else 1e-4
        if rows == 1 and fmt in ("int8", "int4"):
            tol = 3e-4
        torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.skipif(not GPU or kernels.gluon is None, reason="Gluon kernels run on CUDA only")
@pytest.mark.parametrize("fusion", ["none", "norm", "glu"])
@pytest.mark.parametrize(
    "fmt, groupsize",
    [("int4", 32), ("int4", 128), ("int4 tiles", 32), ("int8", 0), ("bf16", 0), ("float", 0)]
    + [("fp8", 0), ("int4 early", 32), ("int8 early", 0), ("bf16 early", 0)],
)
@pytest.mark.parametrize("block_n, warps", [(4, 2), (8, 4), (16, 8)])
def test_gluon_row_matches_reference(fusion, fmt, groupsize, block_n, warps):
    # The Gluon one-row GEMVs: odd row counts, K not a whole number of steps (per warp: 1024 k
    # for int4, 512 for int8, 256 for bfloat16...), the layer fusions, poisoned outputs. Rows
    # not in whole 16-byte blocks (K = 260: int8 and bfloat16) take the Triton kernel. "int4
    # tiles": 3 tiles of rows per program where K fits one step (K <= 1024 * warps). "early":
    # the first two K steps load before the wait on the kernel before.
    torch.manual_seed(block_n + warps + groupsize)
    tiles = {"tiles": (3,), "early": (1, 2)}.get(fmt.split()[-1], ())
    fmt = fmt.split()[0]
    shapes = [(37, 256), (129, 384), (4096, 4096), (4096, 11008), (12288, 4096)]
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    fmt = "float" if fmt == "bf16" else fmt
    for N, K in shapes + ([(37, 272), (37, 260)] if fmt != "int4" else []):
        w = make(FMTS[fmt], N, K, groupsize, dtype)
        x = torch.randn(1, 2 * K if fusion == "glu" else K, device=DEVICE, dtype=torch.bfloat16)
        fused = dict(residual=torch.randn(1, N, device=DEVICE, dtype=torch.bfloat16))
        if fusion == "norm":
            fused = dict(norm_weight=torch.rand(K, device=DEVICE) + 0.5, eps=1e-5)
        elif fusion == "glu":
            fused["glu"] = True
        ref = kernels.gemv_reference(x.float(), fmt=FMTS[fmt], **w, **fused)
        cfg = kernels.gemv_config(FMTS[fmt], 1, N, K, groupsize)
        cfg["GLUON"] = (block_n, warps, *tiles)
        poison()
        got = kernels.gemv(x, fmt=FMTS[fmt], config=cfg, **w, **fused)
        assert got.dtype == torch.bfloat16 and got.shape == (1, N)
        # int4: x is rounded to int8 as the reference rounds it; what differs is the order of
        # the float32 sums and the final rounding to bfloat16
        tol = 1e-2
        torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.skipif(kernels.gluon is None, reason="this Triton has no Gluon")
def test_gluon_is_the_default_where_it_measured_faster():
    # One-row int4, int8 and bfloat16 GEMVs default to the Gluon kernels on the shapes where
    # they beat Triton, alone or in decode (gluon_row_shape's comments); the rest, batches,
    # experts and routers stay on Triton. A config that names Gluon still runs where Gluon
    # cannot (CPU, the interpreter): the launch falls back to the Triton kernel with the same
    # result.
    if kernels.gluon is None:
        pytest.skip("this Triton has no Gluon")
    shapes = {
        (kernels.INT4, 1, 256, 256, 32): (4, 2),
        (kernels.INT4, 1, 12288, 4096, 32): (8, 4, 4),  # Llama-2-7B wqkv, tiles
        (kernels.INT4, 1, 12288, 4096, 128): None,
        (kernels.INT4, 1, 22016, 4096, 32): (8, 4, 8),  # Llama-2-7B w13, 8 tiles
        (kernels.INT4, 1, 28672, 4096, 128): None,  # Llama-3.1-8B w13
        (kernels.INT4, 1, 32000, 4096, 32): None,  # an output layer
        (kernels.INT8, 1, 4096, 4096, 0): (8, 4),
        (kernels.INT8, 1, 32000, 4096, 0): (8, 4),
        (kernels.INT8, 1, 12288, 4096, 0): (8, 4),  # wqkv
        (kernels.FLOAT, 1, 4096, 4096, 0): (4, 2),
        (kernels.FLOAT, 1, 4096, 11008, 0): (8, 4),
        (kernels.FLOAT, 1, 12288, 4096, 0): (8, 2),
        (kernels.FLOAT, 1, 22016, 4096, 0): None,  # w13
        (kernels.FLOAT, 1, 8, 4096, 0): None,  # a router
        (kernels.FP8, 1, 4096, 4096, 0): None,
        (kernels.INT8, 3, 256, 256, 0): None,
        (kernels.FLOAT, 3, 256, 256, 0): None,
    }
    for (fmt, *args), rows_warps in shapes.items():
        assert kernels.gemv_config(fmt, *args).get("GLUON") == rows_warps, (fmt, args)
    for fmt in (kernels.INT4, kernels.INT8, kernels.FLOAT):  # experts
        assert "GLUON" not in kernels.gemv_config(fmt, 1, 256, 256, 32, 2)
    sweep = bench_module().sweep_configs(kernels.INT4, 256, 256, 32)
    assert any("GLUON" not in c for c in sweep) and sum("GLUON" in c for c in sweep) > 2
    torch.manual_seed(1)
    for fmt in (kernels.INT4, kernels.INT8, kernels.FLOAT):
        cfg = kernels.gemv_config(fmt, 1, 256, 256, 32)
        assert cfg["GLUON"]
        w = make(fmt, 256, 256)
        x = torch.randn(1, 256, device=DEVICE)
        r = torch.randn(1, 256, device=DEVICE)
        ref = kernels.gemv_reference(x, fmt=fmt, residual=r, **w)
        got = kernels.gemv(x, fmt=fmt, residual=r, config=cfg, **w)
        torch.testing.assert_close(got, ref, atol=3e-4 * ref.abs().max().item(), rtol=3e-4)


def bench_module():
    from scripts import bench

    return bench


@pytest.mark.parametrize("fmt", sorted(FMTS))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("fusion", ["norm", "glu"])
def test_gemv_prologue_and_epilogue(fmt, rows, fusion):
    torch.manual_seed(7)
    N, K = 48, 256
    w = make(FMTS[fmt], N, K)
    x = torch.randn(rows, 2 * K if fusion == "glu" else K, device=DEVICE) * 3
    fused = dict(residual=torch.randn(rows, N, device=DEVICE))
    if fusion == "norm":
        fused.update(norm_weight=torch.rand(K, device=DEVICE) + 0.5, eps=1e-5)
    else:
        fused.update(glu=True)
    ref = kernels.gemv_reference(x, fmt=FMTS[fmt], **w, **fused)
    cfg = dict(
        BLOCK_M=1 if rows == 1 else 16,
        BLOCK_N=16,
        BLOCK_K=128,
        SPLIT_K=1,
        num_warps=4,
        num_stages=2,
    )
    got = kernels.gemv(x, fmt=FMTS[fmt], config=cfg, **w, **fused)
    tol = 2e-3 if GPU and rows > 1 else 1e-4
    torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)
    # and the reference means what it says
    plain = x.float()
    if fusion == "glu":
        plain = torch.nn.functional.silu(plain[:, :K]) * plain[:, K:]
    else:
        plain = torch.nn.functional.rms_norm(plain, (K,), fused["norm_weight"], 1e-5)
    expected = kernels.gemv_reference(plain, fmt=FMTS[fmt], **w) + fused["residual"]
    torch.testing.assert_close(ref, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("fmt, K, words", [
    ("int8", 256, True), ("int8", 256, False), ("int8", 258, None), ("int4", 384, True),
])  # fmt: skip
def test_gemv_quantized_paths(fmt, K, words):
    # One row: the 32-bit-word path and int8's element-wise one, odd row counts, and a K that
    # is not a multiple of 4 for int8 (words=None then picks the element-wise path by itself).
    torch.manual_seed(11)
    w = make(FMTS[fmt], 45, K, groupsize=128 if fmt == "int4" else 32)
    x = torch.randn(1, K, device=DEVICE)
    ref = kernels.gemv_reference(x, fmt=FMTS[fmt], **w)
    cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2)
    if words is not None:
        cfg["WORDS"] = words
    poison()
    got = kernels.gemv(x, fmt=FMTS[fmt], config=cfg, **w)
    torch.testing.assert_close(got, ref, atol=3e-4 * ref.abs().max().item(), rtol=3e-4)


@pytest.mark.parametrize("groups", [9, 10, 12, 16, 44])
@pytest.mark.parametrize("split_k", [1, 2])
def test_int4_scales_load_in_runs(groups, split_k):
    # One-row int4 loads a step's group scales in runs of 8, 4, 2 or 1 (whatever divides both
    # the row's groups and a step's 8): 9 groups -> runs of 1, 10 -> 2, 12 -> 4, 16 and 44 ->
    # 8, 44 ending in a partial step; with split-K, each split's last step too. A run read
    # past its end, or masked wrongly, moves the sums.
    torch.manual_seed(groups)
    K = 32 * groups
    w = make(FMTS["int4"], 24, K, groupsize=32)
    x = torch.randn(1, K, device=DEVICE)
    ref = kernels.gemv_reference(x, fmt=FMTS["int4"], **w)
    cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=split_k, num_warps=4, num_stages=2)
    poison()
    got = kernels.gemv(x, fmt=FMTS["int4"], config=cfg, **w)
    torch.testing.assert_close(got, ref, atol=3e-4 * ref.abs().max().item(), rtol=3e-4)
    if groups % 16 == 0:  # a step of part of a group (256 groups 512 wide) is refused
        w = make(FMTS["int4"], 24, K, groupsize=512)
        with pytest.raises(ValueError, match="whole number of groups"):
            kernels.gemv(x, fmt=FMTS["int4"], config=cfg, **w)


@pytest.mark.parametrize("fmt", sorted(FMTS))
@pytest.mark.parametrize("fusion", [None, "norm", "glu"])
def test_gemm_tiles_cover_every_row(fmt, fusion):
    # Prefill of a quantized weight: row tiles of BLOCK_M, the last one partial (40 = 16+16+8),
    # each tile dequantized in registers; the fused prologues work per row.
    torch.manual_seed(3)
    N, K, rows = 37, 256, 40
    w = make(FMTS[fmt], N, K, groupsize=64)
    x = torch.randn(rows, 2 * K if fusion == "glu" else K, device=DEVICE)
    fused = dict(residual=torch.randn(rows, N, device=DEVICE))
    if fusion == "norm":
        fused.update(norm_weight=torch.rand(K, device=DEVICE) + 0.5)
    elif fusion == "glu":
        fused.update(glu=True)
    ref = kernels.gemv_reference(x, fmt=FMTS[fmt], **w, **fused)
    # int4 both ways: one group per step (what prefill uses) and several
    for block_k, split_k in ((64, 1), (128, 2)):
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4,
                   num_stages=2)  # fmt: skip
        poison()
        got = kernels.gemv(x, fmt=FMTS[fmt], config=cfg, **w, **fused)
        tol = 2e-3 if GPU else 1e-4
        torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)
    whole_groups = 256 if fmt == "int4" else 1
    assert kernels.gemv_config(FMTS[fmt], 2048, N, K, 256)["BLOCK_K"] % whole_groups == 0


def test_one_row_int4_has_only_the_word_path():
    w = make(kernels.INT4, 16, 256)
    cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="word"):
        kernels.gemv(
            torch.randn(1, 256, device=DEVICE), fmt=kernels.INT4, config=dict(cfg, WORDS=False), **w
        )


def test_one_row_int4_quantizes_x_like_its_reference():
    # One row of int4 runs on dp4a: x rounded to int8 per block of 32 (scale max|x| / 127).
    # Blocks whose max is 127 put x * 127 / max on exact halves: both round them to even.
    x = torch.randn(1, 256)
    x[0, :64] = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 126.5] * 8)
    q = kernels.activation_int8_reference(x)
    assert q[0, :8].tolist() == [127.0, 2.0, 4.0, -2.0, -4.0, 0.0, -0.0, 126.0]
    err = (q - x).abs().reshape(8, 32).amax(1) / x.abs().reshape(8, 32).amax(1)
    assert (err <= 0.5 / 127 + 1e-7).all()  # half a step of each block's scale at most
    w = make(kernels.INT4, 48, 256)
    x = x.to(DEVICE)
    ref = kernels.gemv_reference(x, fmt=kernels.INT4, **w)
    exact = x @ kernels.gemv_reference(torch.eye(256, device=DEVICE), fmt=kernels.INT4, **w)
    assert not torch.allclose(ref, exact, rtol=1e-4, atol=1e-4)  # the rounding is visible
    cfg = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=2)
    got = kernels.gemv(x, fmt=kernels.INT4, config=cfg, **w)
    torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


def test_one_row_int4_divides_like_its_reference():
    # x * 127 / max lands next to halves in blocks whose max has all sorts of mantissas: were
    # the kernel's reciprocal of max one unit in the last place off the IEEE one, some products
    # would round the other way (each such flip moves the output ~20x the tolerance).
    g = torch.Generator().manual_seed(7)
    blocks = 8192 if GPU else 128
    top = 0.5 + 1.5 * torch.rand(blocks, 1, generator=g)  # [blocks, 1] each block's max
    n = torch.randint(-126, 126, (blocks, 32), generator=g).float()
    x = (n + 0.5) / 127 * top  # [blocks, 32], |x| < top
    x[:, 0] = top[:, 0]
    x = x.reshape(1, -1).to(DEVICE)
    w = make(kernels.INT4, 48, blocks * 32)
    ref = kernels.gemv_reference(x, fmt=kernels.INT4, **w)
    cfg = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=2)
    got = kernels.gemv(x, fmt=kernels.INT4, config=cfg, **w)
    torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FMTS))
@pytest.mark.parametrize("case", ["plain", "glu", "shared_rows_norm"])
def test_expert_gemv_reads_each_rows_expert(fmt, case):
    # Weights stacked [E, N, K]: output row m goes through expert idx[m] (Mixtral decode). With
    # shared rows, x has 2 rows for 4 outputs: rows 2t and 2t + 1 both read token t's row (a
    # token's two experts, no copy of x), here with the RMSNorm prologue (Mixtral's w13).
    torch.manual_seed(5)
    E, N, K = 3, 40, 256
    parts = [make(FMTS[fmt], N, K) for _ in range(E)]
    w = {k: torch.stack([p[k] for p in parts]) for k in parts[0] if torch.is_tensor(parts[0][k])}
    if fmt == "int4":
        w["groupsize"] = 32
    idx = torch.tensor([2, 0, 2, 1], device=DEVICE, dtype=torch.int32)
    fused = dict(glu=case == "glu")
    share = 2 if case == "shared_rows_norm" else 1
    if share > 1:
        fused.update(norm_weight=torch.rand(K, device=DEVICE) + 0.5, eps=1e-5)
    x = torch.randn(4 // share, 2 * K if fused["glu"] else K, device=DEVICE) * 3
    expected = torch.cat(
        [
            kernels.gemv_reference(
                x[m // share : m // share + 1], fmt=FMTS[fmt], **fused, **parts[e]
            )
            for m, e in enumerate(idx.tolist())
        ]
    )
    ref = kernels.gemv_reference(x, fmt=FMTS[fmt], expert_idx=idx, **fused, **w)
    torch.testing.assert_close(ref, expected)
    cfg = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=2)
    poison()
    got = kernels.gemv(x, fmt=FMTS[fmt], config=cfg, expert_idx=idx, **fused, **w)
    assert got.shape == (4, N)
    torch.testing.assert_close(got, ref, atol=3e-4 * ref.abs().max().item(), rtol=3e-4)


@pytest.mark.parametrize("fmt", sorted(FMTS))
@pytest.mark.parametrize("split_k", [1, 2])
def test_expert_gemv_routes_and_mixes_like_moe_route(fmt, split_k):
    # Router logits instead of expert ids: the kernel picks each token's top 2 of 5 experts as
    # moe.route does (token 1's logits tie for second place: the first index wins), w13-like
    # with the RMSNorm prologue, then w2-like: SwiGLU prologue, the two picks mixed by their
    # renormalised softmax weights, plus the residual.
    import moe

    torch.manual_seed(11)
    E, N, K, T, k = 5, 40, 256, 2, 2
    parts = [make(FMTS[fmt], N, K) for _ in range(E)]
    w = {n: torch.stack([p[n] for p in parts]) for n in parts[0] if torch.is_tensor(parts[0][n])}
    if fmt == "int4":
        w["groupsize"] = 32
    logits = torch.tensor([[0.3, -1.0, 2.0, 0.1, 1.2], [0.5, 1.5, -0.2, 1.5, 0.9]], device=DEVICE)
    weights, idx = moe.route(logits, k)
    assert idx.tolist() == [[2, 4], [1, 3]]
    cfg = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, SPLIT_K=split_k, num_warps=4, num_stages=2)
    tol = dict(rtol=3e-4)

    norm = dict(norm_weight=torch.rand(K, device=DEVICE) + 0.5, eps=1e-5)
    x = torch.randn(T, K, device=DEVICE) * 3
    pairs = kernels.gemv_reference(x, fmt=FMTS[fmt], expert_idx=idx.flatten(), **norm, **w)
    ref = kernels.gemv_reference(x, fmt=FMTS[fmt], router_logits=logits, top_k=k, **norm, **w)
    torch.testing.assert_close(ref, pairs)
    poison()
    got = kernels.gemv(x, fmt=FMTS[fmt], config=cfg, router_logits=logits, top_k=k, **norm, **w)
    assert got.shape == (T * k, N)
    torch.testing.assert_close(got, ref, atol=3e-4 * ref.abs().max().item(), **tol)

    h = torch.randn(T * k, 2 * K, device=DEVICE)  # each pair's gate | up
    res = torch.randn(T, N, device=DEVICE)
    rows = kernels.gemv_reference(h, fmt=FMTS[fmt], expert_idx=idx.flatten(), glu=True, **w)
    mixed = res + (rows.view(T, k, N) * weights[..., None]).sum(dim=1)
    route = dict(router_logits=logits, top_k=k, mix=True, glu=True, residual=res)
    ref = kernels.gemv_reference(h, fmt=FMTS[fmt], **route, **w)
    torch.testing.assert_close(ref, mixed)
    poison()
    got = kernels.gemv(h, fmt=FMTS[fmt], config=cfg, **route, **w)
    assert got.shape == (T, N)
    torch.testing.assert_close(got, ref, atol=3e-4 * ref.abs().max().item(), **tol)


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@torch.no_grad()
def test_moe_decode_through_expert_gemv_equals_moe_py(mode):
    # kernels.moe_experts (what use_kernels puts into MOEFeedForward) against moe.py's own
    # gather, including another rank's expert ids (expert parallelism) that count as absent.
    import moe
    import quantize
    from model import ModelArgs, rms_norm

    torch.manual_seed(2)
    cfg = ModelArgs(dim=64, intermediate_size=96, n_layer=1, n_head=4, vocab_size=64)
    cfg.num_experts, cfg.num_activated_experts = 4, 2
    ff = moe.MOEFeedForward(cfg).to(DEVICE)
    for p in ff.parameters():
        p.normal_(0, 0.1)
    if mode != "float":
        ff.w13 = quantize.quantize_linear(ff.w13, mode, 32 if mode == "int4" else None)
        ff.w2 = quantize.quantize_linear(ff.w2, mode, 32 if mode == "int4" else None)
    x = torch.randn(1, 64, device=DEVICE)
    weights, idx = moe.route(ff.gate(x), 2)
    for ids in (idx, torch.tensor([[idx[0, 0].item(), 7]], device=DEVICE)):
        ref = moe.moe_experts(x, ff.w13, ff.w2, ids, weights)
        if mode == "int4":  # one-row int4 quantizes x to int8: the gemv reference does that too
            ref = torch.zeros_like(x)
            for e, wt in zip(ids[0].tolist(), weights[0].tolist(), strict=True):
                if e < cfg.num_experts:
                    w13, w2 = ((m.weight[e], m.scales[e], m.zeros[e], 32) for m in (ff.w13, ff.w2))
                    h = kernels.gemv_reference(x, w13[0], kernels.INT4, *w13[1:])
                    ref += wt * kernels.gemv_reference(h, w2[0], kernels.INT4, *w2[1:], glu=True)
        got = kernels.moe_experts(x, ff.w13, ff.w2, ids, weights)
        # the int8/int4 word paths are exact to about 2^-14 of |y| (see test_gemv_*)
        torch.testing.assert_close(got, ref, atol=3e-4 * ref.abs().max().item(), rtol=3e-4)
        # the block's RMSNorm left to w13's prologue: as if x came normalised
        nw = torch.rand(64, device=DEVICE) + 0.5
        unnormed = x * 4 + 1
        normed = rms_norm(unnormed, nw, 1e-5)
        want = kernels.moe_experts(normed, ff.w13, ff.w2, ids, weights)
        got = kernels.moe_experts(unnormed, ff.w13, ff.w2, ids, weights, norm_weight=nw, eps=1e-5)
        torch.testing.assert_close(got, want, atol=3e-4 * want.abs().max().item(), rtol=3e-4)


@pytest.mark.skipif(not GPU, reason="default launch configurations are for CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", sorted(FMTS))
def test_gemv_default_config_bf16(fmt):
    torch.manual_seed(0)
    for N, K in [
        (4096, 4096),
        (32000, 4096),
        (12288, 4096),
        (22016, 4096),
        (4096, 11008),
        (577, 576),
    ]:
        w = make(FMTS[fmt], N, K, dtype=torch.bfloat16)
        for rows in (1, 8, 40):
            x = torch.randn(rows, K, device=DEVICE, dtype=torch.bfloat16)
            ref = kernels.gemv_reference(x, fmt=FMTS[fmt], **w).float()
            poison()
            got = kernels.gemv(x, fmt=FMTS[fmt], **w).float()
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-2


ATTN = [(1, 4, 4, 128, 64, 5), (2, 8, 2, 1024, 64, 700), (1, 6, 3, 4096, 64, 4095)]
if GPU:
    ATTN += [(1, 32, 8, 33024, 128, 32768), (8, 32, 32, 256, 128, 200), (1, 9, 3, 8192, 64, 17)]


# Launch options besides the default: splits of 32 slots, so that short caches split and go
# through the combine kernel too, on 4 warps and on 8. Round 31 (H100) timed
# 8 warps and 64-slot splits in decode: both slower than the default. AHEAD loads each block a
# step before it attends to it (16-slot blocks: many steps); PREFETCH asks L2 for the filled
# slots first (PTX: the GPU only; elsewhere the launch leaves it off), also per split; STREAMS
# runs one program per query head (a group's programs read the same keys and values; one
# writes the cache slot), an online softmax per row of the block, no tl.dot.
ATTN_CONFIGS = [
    None,
    dict(CHUNK=32),
    dict(CHUNK=32, num_warps=8),
    dict(AHEAD=True, BLOCK_S=16),
    dict(PREFETCH=True),
    dict(PREFETCH=True, AHEAD=True, CHUNK=64, BLOCK_S=16),
    dict(STREAMS=True, BLOCK_S=16),
    dict(STREAMS=True, CHUNK=64, BLOCK_S=32),
]


def skip_slow_split(S, config):
    # Long caches split by default; under the interpreter their 32-slot splits only cost time.
    if not GPU and S > 1024 and config and "CHUNK" in config:
        pytest.skip("32-slot splits of a long cache: GPU only")


@pytest.mark.parametrize("config", ATTN_CONFIGS)
@pytest.mark.parametrize("B, H, H_kv, S, D, pos", ATTN)
def test_decode_attention_matches_sdpa(B, H, H_kv, S, D, pos, config):
    skip_slow_split(S, config)
    torch.manual_seed(pos)
    dtype = torch.bfloat16 if GPU else torch.float32
    q = torch.randn(B, H, 1, D, device=DEVICE, dtype=dtype)
    k = torch.randn(B, H_kv, S, D, device=DEVICE, dtype=dtype)
    v = torch.randn(B, H_kv, S, D, device=DEVICE, dtype=dtype)
    k[:, :, pos + 1 :] = float("nan")  # slots past the position must never be read
    v[:, :, pos + 1 :] = float("nan")
    ip = torch.tensor([pos], device=DEVICE)
    ref = kernels.decode_attention_reference(
        q.float(), k[:, :, : pos + 1].float(), v[:, :, : pos + 1].float(), ip
    )
    poison()
    got = kernels._decode_attention_launch(q, k, v, ip, config=config)
    tol = 2e-2 if GPU else 1e-5
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("B, H, H_kv, S, pos", [
    (1, 4, 4, 128, 0), (1, 4, 4, 128, 77), (2, 8, 2, 2048, 1500), (1, 6, 3, 4096, 4095),
])  # fmt: skip
@pytest.mark.parametrize("config", ATTN_CONFIGS)
def test_decode_attention_from_qkv_equals_attend_qkv(B, H, H_kv, S, pos, config):
    # The fused decode path (rotary embedding, cache write and attention in the kernel) against
    # model.Attention.attend_qkv: the same output and the same cache afterwards.
    from model import Attention, KVCache, ModelArgs, precompute_freqs_cis

    skip_slow_split(S, config)

    torch.manual_seed(pos)
    D = 64
    dtype = torch.bfloat16 if GPU else torch.float32
    attn = Attention(ModelArgs(dim=H * D, n_head=H, n_kv_heads=H_kv, head_dim=D, n_layer=1))
    attn.kv_cache = KVCache(B, S, H_kv, D, dtype, DEVICE)
    attn.kv_cache.k_cache.normal_()
    attn.kv_cache.v_cache.normal_()
    k_cache, v_cache = attn.kv_cache.k_cache.clone(), attn.kv_cache.v_cache.clone()
    qkv = torch.randn(B, 1, (H + 2 * H_kv) * D, device=DEVICE, dtype=dtype)
    ip = torch.tensor([pos], device=DEVICE)
    freqs = precompute_freqs_cis(S, D, 500000.0).to(DEVICE)  # [S, D/2, 2]
    mask = torch.arange(S, device=DEVICE)[None, :] <= ip[:, None]
    ref = attn.attend_qkv(qkv, freqs, ip[None], mask, ip)  # writes attn.kv_cache
    poison()
    got = kernels._decode_attention_launch(qkv, k_cache, v_cache, ip, freqs, H, config)
    tol = 2e-2 if GPU else 1e-5
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache, attn.kv_cache.k_cache, atol=tol, rtol=tol)
    torch.testing.assert_close(v_cache, attn.kv_cache.v_cache)


@pytest.mark.parametrize("experts", [0, 4])
def test_model_with_kernels_matches_plain(experts):
    # The swapped-in kernels give the same logits as the plain model, prefill and decode; a
    # Mixture-of-Experts model's blocks fuse their attention half too.
    from helpers import random_model
    from model import sdpa_attention

    cfg = dict(num_key_value_heads=2, hidden_size=256)  # head_dim 64
    if experts:
        cfg.update(num_local_experts=experts, num_experts_per_tok=2)
    plain = random_model(**cfg).to(DEVICE)
    fast = random_model(**cfg).to(DEVICE)
    kernels.use_kernels(fast)
    assert all(isinstance(layer, kernels.FusedBlock) for layer in fast.layers)
    if not GPU:
        # use_kernels routes through the references on CPU; call the Triton code directly.
        def attend(q, k, v, mask, pos):
            if q.shape[2] == 1:
                return kernels._decode_attention_launch(q, k, v, pos)
            return sdpa_attention(q, k, v, mask, pos)

        for m in fast.modules():
            if hasattr(m, "attend"):
                m.attend = attend
    assert any(isinstance(m, kernels.GemvLinear) for m in fast.modules())
    x = torch.randint(0, 128, (1, 9), device=DEVICE)
    with torch.no_grad():
        for m in (plain, fast):
            m.setup_caches(1, 64)
        ref = plain(x[:, :8], torch.arange(8, device=DEVICE))
        got = fast(x[:, :8], torch.arange(8, device=DEVICE))
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)
        ip = torch.tensor([8], device=DEVICE)
        torch.testing.assert_close(fast(x[:, 8:], ip), plain(x[:, 8:], ip), atol=1e-3, rtol=1e-3)


def test_int4_linear_interleaves_its_groups_for_the_kernels():
    # GemvLinear keeps an int4 linear's scales and zeros (same names, values, state_dict) as
    # views of its group words, the buffer group_words the kernels read in place (one 32-bit
    # load per group). The words decode back to the bfloat16 values.
    import quantize

    torch.manual_seed(5)
    dense = torch.nn.Linear(128, 24, bias=False, device=DEVICE)
    linear = quantize.quantize_linear(dense, "int4", 32)
    scales, zeros = linear.scales.clone(), linear.zeros.clone()
    layer = kernels.GemvLinear(linear, kernels.INT4, 32)
    assert set(layer.state_dict()) == {"weight", "scales", "zeros"}
    assert torch.equal(layer.scales, scales) and torch.equal(layer.zeros, zeros)
    words = layer.group_words
    assert words.dtype == torch.int32 and words.shape == (24, 4)
    assert layer.scales.data_ptr() == words.data_ptr()  # views: the memory is held once
    assert layer.zeros.data_ptr() == words.data_ptr() + 2
    assert torch.equal((words << 16).view(torch.float32), scales.float())
    assert torch.equal((words & -65536).view(torch.float32), zeros.float())
    assert torch.equal(kernels.int4_group_words(scales, zeros), words)
    x = torch.randn(1, 128, device=DEVICE)
    ref = kernels.gemv_reference(x, linear.weight, kernels.INT4, scales, zeros, 32)
    torch.testing.assert_close(
        kernels.gemv_reference(x, layer.weight, kernels.INT4, words, None, 32), ref
    )
    cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=2)
    poison()
    got = kernels.gemv(x, layer.weight, kernels.INT4, words, None, 32, config=cfg)
    torch.testing.assert_close(got, ref, atol=3e-4 * ref.abs().max().item(), rtol=3e-4)
    # the prefill fallback (more than TILE_ROWS rows) reads the views as the separate tensors
    xs = torch.randn(kernels.TILE_ROWS + 1, 128, device=DEVICE)
    expected = quantize.int4_linear(xs, linear.weight, scales, zeros, 32)
    torch.testing.assert_close(layer(xs), expected)


@pytest.mark.parametrize("experts", [0, 4])
def test_int4_model_with_kernels_keeps_its_bytes_and_logits(experts):
    # use_kernels on an int4 model (linears and expert stacks interleaved into group words):
    # weight_bytes counts the same bytes (the words are the scales' and zeros' memory), the
    # state_dict is the same, and a prompt (gemv's row tiles, which read the words) gives the
    # logits of the model before the swap. (One row rounds x to int8: other tests cover it.)
    import quantize
    from generate import weight_bytes
    from helpers import random_model

    cfg = dict(num_key_value_heads=2, hidden_size=256)
    if experts:
        cfg.update(num_local_experts=experts, num_experts_per_tok=2)
    models = []
    for _ in range(2):
        model = random_model(**cfg).to(DEVICE)
        for layer in model.layers:
            for parent in (layer.attention, layer.feed_forward):
                for name, child in list(parent.named_children()):
                    if name in ("wqkv", "wo", "w13", "w2"):
                        setattr(parent, name, quantize.quantize_linear(child, "int4", 32))
        model.setup_caches(1, 64)
        models.append(model)
    plain, fast = models
    kernels.use_kernels(fast)
    assert weight_bytes(fast) == weight_bytes(plain)
    assert weight_bytes(fast, per_token=False) == weight_bytes(plain, per_token=False)
    state, fast_state = plain.state_dict(), fast.state_dict()
    assert set(fast_state) == set(state)
    assert all(torch.equal(fast_state[k], t) for k, t in state.items())
    words = [m for m in fast.modules() if hasattr(m, "group_words")]
    assert len(words) == 4 * len(fast.layers)  # wqkv, wo, w13 and w2 (or the expert stacks)
    x = torch.randint(0, 128, (1, 8), device=DEVICE)
    with torch.no_grad():
        pos = torch.arange(8, device=DEVICE)
        torch.testing.assert_close(fast(x, pos), plain(x, pos), atol=1e-3, rtol=1e-3)


def test_gemv_linear_routes_quantized_rows_by_count(monkeypatch):
    # One row and quantized inputs up to TILE_ROWS rows go to gemv; longer ones to the
    # dequantizing linear (whose output must then be the same).
    import quantize

    torch.manual_seed(4)
    linear = quantize.quantize_linear(torch.nn.Linear(64, 32, bias=False), "int8", None)
    layer = kernels.GemvLinear(linear, kernels.INT8)
    calls = []

    def spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        return kernels.gemv_reference(x, *args, **kwargs)

    monkeypatch.setattr(kernels, "gemv", spy)
    for rows in (1, 40, kernels.TILE_ROWS, kernels.TILE_ROWS + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), linear(x), atol=1e-4, rtol=1e-4)
    assert calls == [1, 40, kernels.TILE_ROWS]


def test_bench_times_decode_attention_and_sweeps_it():
    # scripts/bench.py --kernels_only also times decode attention alone (the fused kernel as a
    # step runs it); --sweep tries its launch shapes (sequence chunks, loop steps, warps) and
    # keeps the fastest whose output matches the default's.
    import bench
    from model import ModelArgs

    config = ModelArgs(dim=256, n_head=4, n_kv_heads=2, n_layer=1, vocab_size=64)  # head_dim 64
    device = torch.device(DEVICE)
    configs = bench.attention_sweep(64)
    assert configs[0] is None and {c["BLOCK_S"] for c in configs[1:]} == {32, 64}
    split = [c for c in bench.attention_sweep(256)[1:] if c["CHUNK"] < 256]  # 64 and 128
    assert {c["CHUNK"] for c in split} == {64, 128}
    options = {o for c in configs[1:] for o in ("STREAMS", "AHEAD", "PREFETCH") if c.get(o)}
    assert options == {"STREAMS", "AHEAD", "PREFETCH"}  # the loop's options at the default chunk
    results = bench.bench_attention([config], device, 1e9, sweep=not GPU)
    # CPU: 64 slots filled up to position 40, float32 keys and values; the GPU: each of
    # bench.ATTENTION_CONTEXTS within the model's trained length
    want = [c for c in bench.ATTENTION_CONTEXTS if c[1] < config.block_size] if GPU else [(64, 40)]
    assert [(r["slots"], r["pos"]) for r in results] == want
    assert all(r["layer"] == "attention" and r["rel_err"] < 1e-2 for r in results)
    res = results[0]
    if not GPU:
        assert res["bytes"] == 2 * 2 * 41 * 64 * 4


def draw_counts(logits, temperature, top_k, draws, pos=None, **launch):
    # draws rows of the same logits [V] through the top-k sampling kernels, one seed each (and
    # the step's position pos, an int, when given) -> (how often each token came, the tokens)
    torch.manual_seed(draws)
    seeds = torch.randint(1 << 31, (draws,), device=DEVICE)
    rows = logits[None].expand(draws, -1)
    if pos is not None:
        pos = torch.tensor([pos], device=DEVICE)
    poison()
    tokens = kernels._sample_top_k_launch(rows, seeds, pos, temperature, top_k, **launch).flatten()
    return torch.bincount(tokens, minlength=logits.shape[0]).double().cpu(), tokens


def assert_draws_follow(counts, want):
    # never a token outside the kept set; the rest by a chi-square test against want [V]
    from scipy.stats import chisquare

    kept = want > 0
    assert counts[~kept].sum() == 0
    expected = want[kept].double() / want[kept].double().sum() * counts.sum()
    assert chisquare(counts[kept], expected).pvalue > 1e-3


# (V, top_k, ties): ties rounds the logits to halves, so many tie with the k-th largest
SAMPLE = [(300, 6, False), (300, 9, True)] + (
    [(32000, 200, False), (128256, 200, False), (32000, 50, True), (5000, 256, True)] if GPU else []
)


@pytest.mark.parametrize("V, top_k, ties", SAMPLE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_top_k_draws_from_logits_to_probs(V, top_k, ties, dtype):
    # The kernels' draws against generate.logits_to_probs (top_k and ties with the k-th kept),
    # bfloat16 logits as the model gives them (the bisection drops the 16 mantissa bits they
    # never use) and float32. On CPU (the interpreter) small tiles, and the same seeds again
    # with room for only 16 candidates in registers: the rest must load from memory in every
    # pass, and the draws must not change.
    from generate import logits_to_probs

    g = torch.Generator().manual_seed(V + top_k)
    logits = torch.randn(V, generator=g) * 2
    if ties:
        logits = (logits * 2).round() / 2
    logits = logits.to(DEVICE, dtype)
    want = logits_to_probs(logits[None].float(), 0.7, top_k=top_k)[0].cpu()
    if ties:
        assert (want > 0).sum() > top_k  # the test means something
    launch = {} if GPU else dict(block=128, cap=64)
    counts, tokens = draw_counts(logits, 0.7, top_k, 40000 if GPU else 60, **launch)
    assert_draws_follow(counts, want)
    if not GPU:
        assert torch.equal(draw_counts(logits, 0.7, top_k, 60, block=128, cap=16)[1], tokens)
    # Hot, on logits a few units of the last place apart near the k-th: every kept token about
    # as likely, so one kept in excess (keys cut too coarse) would show.
    dense = (torch.randn(V, generator=g) * 0.5 + 5).to(DEVICE, dtype)
    kept = logits_to_probs(dense[None].float(), 1e3, top_k=top_k)[0].cpu() > 0
    hot, _ = draw_counts(dense, 1e3, top_k, 60 if not GPU else 4000, **launch)
    assert hot[~kept].sum() == 0 and (hot > 0).sum() >= min(kept.sum(), 10)


def test_sample_top_k_keyed_by_position_draws_from_logits_to_probs():
    # generate()'s steps key each row's draw by its seed and the step's position: the draws
    # still follow the distribution, the same position draws the same tokens, and another
    # position draws others.
    from generate import logits_to_probs

    V, top_k = (32000, 200) if GPU else (300, 9)
    logits = (torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE)
    want = logits_to_probs(logits[None], 0.7, top_k=top_k)[0].cpu()
    launch = {} if GPU else dict(block=128, cap=64)
    draws = 40000 if GPU else 60
    counts, tokens = draw_counts(logits, 0.7, top_k, draws, pos=17, **launch)
    assert_draws_follow(counts, want)
    assert torch.equal(draw_counts(logits, 0.7, top_k, draws, pos=17, **launch)[1], tokens)
    for other in (18, 1 << 20):
        again = draw_counts(logits, 0.7, top_k, draws, pos=other, **launch)[1]
        assert (again != tokens).float().mean() > 0.5
    unkeyed = draw_counts(logits, 0.7, top_k, draws, **launch)[1]
    assert (unkeyed != tokens).float().mean() > 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="the candidate list outgrows the registers at full size")
def test_sample_top_k_with_more_candidates_than_registers_hold():
    # All logits equal but a few: every chunk's maximum is 0, so all 100k tokens are
    # candidates (past TOP_K_CAP) and the zeros tie with the k-th: the draw is over all of them.
    V = 100_000
    logits = torch.zeros(V, device=DEVICE)
    logits[[7, 5000, 99_999]] = 6.0
    from generate import logits_to_probs

    want = logits_to_probs(logits[None], 1.0, top_k=10)[0].cpu()
    counts, _ = draw_counts(logits, 1.0, 10, 20000)
    top = torch.tensor([7, 5000, 99_999])
    # the three large ones, and the zeros as one class
    got = torch.cat([counts[top], counts.sum(0, keepdim=True) - counts[top].sum()])
    p = torch.cat([want[top], 1 - want[top].sum(0, keepdim=True)])
    assert_draws_follow(got, p)
