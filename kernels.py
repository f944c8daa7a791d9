# Triton kernels for batch-size-1 decoding, where every step is bound by reading the weights:
#   - gemv: y = x @ W^T for a few rows of x, W in bfloat16/float16, int8 (per-channel scale),
#     grouped int4 (per-group scale and offset) or float8 (per-channel scale), the
#     dequantization fused into the loads, optional split-K for narrow outputs;
#   - decode_attention: one query token against the KV cache, the sequence split across programs
#     (flash-decoding) and only the filled part of the cache read.
# Each has a plain-PyTorch reference (`*_reference`) that runs on CPU and is what tests compare
# against. `use_kernels(model)` swaps them into a loaded model on CUDA.
#
# int4 runtime layout (see repack_int4): byte j of group g in row n holds k = g*G + j in its low
# nibble and k = g*G + G/2 + j in its high nibble, so one 16-byte load feeds two half-groups of x
# without any interleaving shuffle.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below still work
    triton = None

FLOAT, INT8, INT4, FP8 = 0, 1, 2, 3
MAX_GEMV_ROWS = 16  # above this many rows of x, cuBLAS matmuls win


# ---------------------------------------------------------------------------------------------
# References (plain PyTorch)
# ---------------------------------------------------------------------------------------------


def dequantize_int4(packed: Tensor, scales: Tensor, offsets: Tensor, groupsize: int) -> Tensor:
    # packed uint8 [N, K/2] in the runtime layout; scales, offsets [N, K/G] -> W float [N, K]
    # with W[n, k] = q[n, k] * scales[n, k // G] + offsets[n, k // G].
    N = packed.shape[0]
    half = groupsize // 2
    p = packed.reshape(N, -1, half)  # [N, K/G, G/2]
    q = torch.cat([p & 15, p >> 4], dim=-1).float()  # [N, K/G, G]
    w = q * scales.float()[..., None] + offsets.float()[..., None]
    return w.reshape(N, -1)


def gemv_reference(
    x: Tensor,
    weight: Tensor,
    fmt: int = FLOAT,
    scales: Tensor | None = None,
    offsets: Tensor | None = None,
    groupsize: int = 0,
    bias: Tensor | None = None,
) -> Tensor:
    # x [..., K] -> [..., N], computed in float32 and returned in x's dtype.
    if fmt == INT4:
        w = dequantize_int4(weight, scales, offsets, groupsize)
    else:
        w = weight.float()
    y = x.float() @ w.t()
    if fmt in (INT8, FP8):
        y = y * scales.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor):
    # q [B, H, 1, D]; caches [B, Hkv, S, D]; the query sits at slot input_pos[0] and sees slots
    # 0..input_pos[0]. -> [B, H, 1, D]
    S = k_cache.shape[2]
    mask = torch.arange(S, device=q.device)[None, :] <= input_pos[:, None]  # [1, S]
    return F.scaled_dot_product_attention(
        q, k_cache, v_cache, attn_mask=mask, enable_gqa=q.shape[1] != k_cache.shape[1]
    )


def repack_int4(qvals: Tensor, groupsize: int) -> Tensor:
    # qvals uint8 [N, K] of 4-bit values 0..15 -> packed uint8 [N, K/2] in the runtime layout.
    N, K = qvals.shape
    q = qvals.reshape(N, K // groupsize, 2, groupsize // 2)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


# ---------------------------------------------------------------------------------------------
# GEMV
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, s_ptr, o_ptr, b_ptr, y_ptr,
        M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
        FMT: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        n_ok = rn < N
        m_ok = rm < M
        k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        if FMT == 2:
            NG: tl.constexpr = BLOCK_K // G
            HG: tl.constexpr = G // 2
            rg = tl.arange(0, NG)
            rj = tl.arange(0, HG)
            if BLOCK_M == 1:
                acc = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in range(k_lo, k_hi, BLOCK_K):
                g_ok = (k + rg * G) < k_hi  # [NG]
                # weight bytes [BLOCK_N, NG, HG]: contiguous along (g, j) within a row
                w_off = rn[:, None, None] * stride_wn + (k // 2 + rg * HG)[None, :, None] + rj
                w_ok = n_ok[:, None, None] & g_ok[None, :, None]
                p = tl.load(w_ptr + w_off, mask=w_ok, other=0)
                lo = (p & 15).to(tl.float32)
                hi = (p >> 4).to(tl.float32)
                s_off = rn[:, None] * stride_sn + (k // G + rg)[None, :]
                sg_ok = n_ok[:, None] & g_ok[None, :]
                s = tl.load(s_ptr + s_off, mask=sg_ok, other=0).to(tl.float32)  # [BN, NG]
                o = tl.load(o_ptr + s_off, mask=sg_ok, other=0).to(tl.float32)
                x_off = (k + rg * G)[:, None] + rj[None, :]  # [NG, HG], the low halves
                if BLOCK_M == 1:
                    x_lo = tl.load(x_ptr + x_off, mask=g_ok[:, None], other=0).to(tl.float32)
                    x_hi = tl.load(x_ptr + x_off + HG, mask=g_ok[:, None], other=0).to(tl.float32)
                    part = tl.sum(lo * x_lo[None] + hi * x_hi[None], axis=2)  # [BN, NG]
                    xsum = tl.sum(x_lo, axis=1) + tl.sum(x_hi, axis=1)  # [NG]
                    acc += s * part + o * xsum[None, :]
                else:
                    xm_off = rm[:, None, None] * stride_xm + x_off[None]
                    xm_ok = m_ok[:, None, None] & g_ok[None, :, None]
                    x_lo = tl.load(x_ptr + xm_off, mask=xm_ok, other=0)  # [BM, NG, HG]
                    x_hi = tl.load(x_ptr + xm_off + HG, mask=xm_ok, other=0)
                    w_lo = (lo * s[:, :, None] + o[:, :, None]).to(x_lo.dtype)
                    w_hi = (hi * s[:, :, None] + o[:, :, None]).to(x_lo.dtype)
                    acc += tl.dot(
                        tl.reshape(x_lo, [BLOCK_M, BLOCK_K // 2]),
                        tl.trans(tl.reshape(w_lo, [BLOCK_N, BLOCK_K // 2])),
                    )
                    acc += tl.dot(
                        tl.reshape(x_hi, [BLOCK_M, BLOCK_K // 2]),
                        tl.trans(tl.reshape(w_hi, [BLOCK_N, BLOCK_K // 2])),
                    )
            if BLOCK_M == 1:
                out = tl.sum(acc, axis=1)[None, :]  # [1, BN]
            else:
                out = acc
        else:
            rk = tl.arange(0, BLOCK_K)
            if BLOCK_M == 1:
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in range(k_lo, k_hi, BLOCK_K):
                kk = k + rk
                k_ok = kk < k_hi
                w = tl.load(
                    w_ptr + rn[:, None] * stride_wn + kk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :],
                    other=0,
                )
                if FMT == 3:  # float8 weights arrive as their bytes
                    w = w.to(tl.float8e4nv, bitcast=True)
                if BLOCK_M == 1:
                    x = tl.load(x_ptr + kk, mask=k_ok, other=0).to(tl.float32)
                    acc += w.to(tl.float32) * x[None, :]
                else:
                    x = tl.load(
                        x_ptr + rm[:, None] * stride_xm + kk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :],
                        other=0,
                    )
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)))
            if BLOCK_M == 1:
                out = tl.sum(acc, axis=1)[None, :]  # [1, BN]
            else:
                out = acc
            if FMT == 1 or FMT == 3:
                out = out * tl.load(s_ptr + rn, mask=n_ok, other=0).to(tl.float32)[None, :]
        if HAS_BIAS:
            if pid_k == 0:
                out += tl.load(b_ptr + rn, mask=n_ok, other=0).to(tl.float32)[None, :]
        y_off = rm[:, None] * stride_ym + rn[None, :]
        y_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr + y_off, out.to(y_ptr.dtype.element_ty), mask=y_ok)
        else:
            tl.atomic_add(y_ptr + y_off, out, mask=y_ok, sem="relaxed")


def gemv_config(fmt: int, M: int, N: int, K: int) -> dict:
    # Launch parameters by shape. Chosen from the sweep in scripts/bench.py (--sweep) on an H200:
    # enough 16-byte loads in flight per SM, and enough programs to cover 132 SMs.
    block_m = 1 if M == 1 else 16
    if fmt == INT4:
        cfg = dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3)
    elif fmt in (INT8, FP8):
        cfg = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3)
    if block_m > 1:
        cfg["BLOCK_N"] = max(cfg["BLOCK_N"], 16)
    programs = triton.cdiv(N, cfg["BLOCK_N"])
    split_k = 1
    while programs * split_k < 4 * 132 and K // (split_k * 2) >= 2 * cfg["BLOCK_K"]:
        split_k *= 2
    return dict(cfg, BLOCK_M=block_m, SPLIT_K=split_k)


def gemv(
    x: Tensor,
    weight: Tensor,
    fmt: int = FLOAT,
    scales: Tensor | None = None,
    offsets: Tensor | None = None,
    groupsize: int = 0,
    bias: Tensor | None = None,
    config: dict | None = None,
) -> Tensor:
    # x [..., K] (at most MAX_GEMV_ROWS rows) -> y [..., N] in x's dtype.
    if x.device.type != "cuda" or triton is None:
        return gemv_reference(x, weight, fmt, scales, offsets, groupsize, bias)
    if config is not None:
        return _gemv_launch(x, weight, fmt, scales, offsets, groupsize, bias, config)
    return torch.ops.fastgen.gemv(x, weight, fmt, scales, offsets, groupsize, bias)


def _gemv_launch(
    x: Tensor,
    weight: Tensor,
    fmt: int,
    scales: Tensor | None,
    offsets: Tensor | None,
    groupsize: int,
    bias: Tensor | None,
    config: dict | None = None,
) -> Tensor:
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg = dict(config or gemv_config(fmt, M, N, K))
    split_k = cfg["SPLIT_K"]
    if split_k > 1:
        y = torch.zeros(M, N, device=x.device, dtype=torch.float32)
    else:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split_k)
    if weight.dtype == torch.float8_e4m3fn:
        weight = weight.view(torch.uint8)
    dummy = weight
    _gemv_kernel[grid](
        x2, weight,
        scales if scales is not None else dummy,
        offsets if offsets is not None else dummy,
        bias if bias is not None else dummy,
        y, M, N, K, x2.stride(0), weight.stride(0),
        scales.stride(0) if scales is not None else 0, y.stride(0),
        FMT=fmt, G=max(groupsize, 2), HAS_BIAS=bias is not None, **cfg,
    )  # fmt: skip
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


if triton is not None:
    # An opaque op for torch.compile: traced through its fake, launched as is under CUDA graphs.
    @torch.library.custom_op("fastgen::gemv", mutates_args=())
    def _gemv_op(
        x: Tensor,
        weight: Tensor,
        fmt: int,
        scales: Tensor | None,
        offsets: Tensor | None,
        groupsize: int,
        bias: Tensor | None,
    ) -> Tensor:
        return _gemv_launch(x, weight, fmt, scales, offsets, groupsize, bias)

    @_gemv_op.register_fake
    def _gemv_fake(x, weight, fmt, scales, offsets, groupsize, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------
# Decode attention (flash-decoding)
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _attn_split_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, ml_ptr, sm_scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
        H_KV, N_SPLIT,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
        CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)  # over batch x kv heads
        split = tl.program_id(1)
        b = pid // H_KV
        hk = pid % H_KV
        length = tl.load(pos_ptr) + 1  # slots 0..input_pos are filled
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, length)
        rg = tl.arange(0, GROUP_PAD)
        rd = tl.arange(0, D)
        g_ok = rg < GROUP
        q_off = b * stride_qb + (hk * GROUP + rg)[:, None] * stride_qh + rd[None, :]
        q = tl.load(q_ptr + q_off, mask=g_ok[:, None], other=0)  # [GP, D]
        m = tl.full([GROUP_PAD], -float("inf"), dtype=tl.float32)
        l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D], dtype=tl.float32)
        kv_base = b * stride_kb + hk * stride_kh
        for s0 in range(start, end, BLOCK_S):
            rs = s0 + tl.arange(0, BLOCK_S)
            s_ok = rs < end
            kv_off = kv_base + rs[:, None] * stride_ks + rd[None, :]
            k = tl.load(k_ptr + kv_off, mask=s_ok[:, None], other=0)  # [BS, D]
            v = tl.load(v_ptr + kv_off, mask=s_ok[:, None], other=0)
            scores = tl.dot(q, tl.trans(k)) * sm_scale  # [GP, BS]
            scores = tl.where(s_ok[None, :], scores, -float("inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # Partials: acc [B*H_KV, N_SPLIT, GP, D] unnormalised, (m, l) [B*H_KV, N_SPLIT, GP, 2].
        part = pid * N_SPLIT + split
        tl.store(acc_ptr + (part * GROUP_PAD + rg)[:, None] * D + rd[None, :], acc)
        tl.store(ml_ptr + (part * GROUP_PAD + rg) * 2, m)
        tl.store(ml_ptr + (part * GROUP_PAD + rg) * 2 + 1, l_sum)

    @triton.jit
    def _attn_combine_kernel(
        acc_ptr, ml_ptr, out_ptr, N_SPLIT,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, SPLIT_PAD: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)  # over batch x kv heads x group
        g = pid % GROUP
        bk = pid // GROUP
        rsp = tl.arange(0, SPLIT_PAD)
        rd = tl.arange(0, D)
        sp_ok = rsp < N_SPLIT
        row = (bk * N_SPLIT + rsp) * GROUP_PAD + g  # [SPLIT_PAD]
        m = tl.load(ml_ptr + row * 2, mask=sp_ok, other=-float("inf"))
        l_sum = tl.load(ml_ptr + row * 2 + 1, mask=sp_ok, other=0)
        m_max = tl.max(m, axis=0)
        w = tl.where(sp_ok & (m > -float("inf")), tl.exp(m - m_max), 0)  # [SPLIT_PAD]
        acc = tl.load(acc_ptr + row[:, None] * D + rd[None, :], mask=sp_ok[:, None], other=0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(out_ptr + pid * D + rd, out.to(out_ptr.dtype.element_ty))


def attention_chunk(max_seq_len: int) -> int:
    # Sequence slots per program: small caches get one program per kv head, long ones many.
    return max(64, min(512, triton.next_power_of_2(triton.cdiv(max_seq_len, 64))))


def _decode_attention_launch(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor
) -> Tensor:
    B, H, _, D = q.shape
    H_kv, S = k_cache.shape[1], k_cache.shape[2]
    group = H // H_kv
    group_pad = max(16, triton.next_power_of_2(group))
    chunk = attention_chunk(S)
    n_split = triton.cdiv(S, chunk)
    acc = torch.empty(B * H_kv, n_split, group_pad, D, device=q.device, dtype=torch.float32)
    ml = torch.empty(B * H_kv, n_split, group_pad, 2, device=q.device, dtype=torch.float32)
    q = q.contiguous()
    _attn_split_kernel[(B * H_kv, n_split)](
        q, k_cache, v_cache, input_pos, acc, ml, D**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H_kv, n_split,
        GROUP=group, GROUP_PAD=group_pad, D=D, CHUNK=chunk, BLOCK_S=min(64, chunk),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    out = torch.empty(B, H, 1, D, device=q.device, dtype=q.dtype)
    _attn_combine_kernel[(B * H,)](
        acc, ml, out, n_split,
        GROUP=group, GROUP_PAD=group_pad, D=D, SPLIT_PAD=triton.next_power_of_2(n_split),
    )  # fmt: skip
    return out


if triton is not None:

    @torch.library.custom_op("fastgen::decode_attention", mutates_args=())
    def _decode_attention_op(
        q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor
    ) -> Tensor:
        return _decode_attention_launch(q, k_cache, v_cache, input_pos)

    @_decode_attention_op.register_fake
    def _decode_attention_fake(q, k_cache, v_cache, input_pos):
        return torch.empty_like(q)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor) -> Tensor:
    if q.device.type != "cuda" or triton is None:
        return decode_attention_reference(q, k_cache, v_cache, input_pos)
    return torch.ops.fastgen.decode_attention(q, k_cache, v_cache, input_pos)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
    # model.Attention's `attend` hook: the split kernel for one new token without padding,
    # SDPA for prefill and padded batches.
    if q.shape[2] == 1 and mask.dim() == 2 and q.shape[-1] in (64, 128, 256):
        return decode_attention(q, k, v, input_pos)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


# ---------------------------------------------------------------------------------------------
# Putting them into a model
# ---------------------------------------------------------------------------------------------


class GemvLinear(nn.Module):
    # nn.Linear with the same parameter names; decode-sized inputs go through the gemv kernel.
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() // x.shape[-1] <= MAX_GEMV_ROWS:
            return gemv(x, self.weight, FLOAT, bias=self.bias)
        return F.linear(x, self.weight, self.bias)


def use_kernels(model: nn.Module) -> nn.Module:
    # Swap plain linears for GemvLinear and set the attention hook. Quantized layers route to
    # gemv through quantize.py's own functions.
    if triton is None:
        return model
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, GemvLinear(child))
        if hasattr(module, "attend"):
            module.attend = attend
    return model
