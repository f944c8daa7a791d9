# Triton kernels for batch-size-1 decoding, where every step is bound by reading the weights:
#   - gemv: y = x @ W^T for a few rows of x, W in bfloat16/float16, int8 (per-channel scale),
#     grouped int4 (per-group scale and offset) or float8 (per-channel scale), the
#     dequantization fused into the loads, optional split-K for narrow outputs; inputs of more
#     rows (batches, short prompts of quantized weights) run as tl.dot row tiles; the narrow
#     one-row shapes where they measured faster run on Gluon kernels (Triton with explicit
#     layouts) instead: gluon_row_shape says which;
#   - decode_attention: one query token against the KV cache, the sequence split across programs
#     (flash-decoding) and only the filled part of the cache read; FusedBlock feeds it wqkv's
#     output directly, and the kernel applies the rotary embedding and writes the cache too.
# Each has a plain-PyTorch reference (`*_reference`) that runs on CPU and is what tests compare
# against. `use_kernels(model)` swaps them into a loaded model on CUDA.
#
# Not named kernels.py: that is the import name of Hugging Face's `kernels` package, which
# transformers (so lm_eval, so eval.py) imports, and a file here would shadow it.
#
# Quantized weights come in quantize.py's stored formats, read as they are: no repacking.
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below still work
    triton = None
try:  # Gluon: Triton with explicit layouts (one-row int4 GEMV on CUDA)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:
    gluon = None

FLOAT, INT8, INT4, FP8 = 0, 1, 2, 3
MAX_GEMV_ROWS = 16  # up to this many rows: GEMV launch shapes; above: GEMM tiles
# Quantized inputs of up to this many rows run on gemv's tiles; longer prompts dequantize each
# weight for a cuBLAS matmul, which measured as fast or faster there (H200, Llama-2-7B w13,
# tiles vs dequantize + cuBLAS: int4 g32 483 vs 1214 us at 256 rows, 2656 vs 1624 at 2048;
# int8 285 vs 332, 1552 vs 833; bench.py --kernels_only --prefill_rows).
TILE_ROWS = 256


# ---------------------------------------------------------------------------------------------
# References (plain PyTorch)
# ---------------------------------------------------------------------------------------------


def gemv_reference(
    x: Tensor,
    weight: Tensor,
    fmt: int = FLOAT,
    scales: Tensor | None = None,
    zeros: Tensor | None = None,
    groupsize: int = 0,
    bias: Tensor | None = None,
    norm_weight: Tensor | None = None,
    eps: float = 1e-5,
    glu: bool = False,
    residual: Tensor | None = None,
    expert_idx: Tensor | None = None,
    router_logits: Tensor | None = None,
    top_k: int = 0,
    mix: bool = False,
) -> Tensor:
    # What gemv computes, in float32, returned in x's dtype. Weight formats are quantize.py's.
    # With expert_idx [M]: weight (and scales, zeros) are stacks [E, ...] and output row m
    # comes from expert expert_idx[m] and row m // (M / rows of x) of x (x's rows may be shared
    # by consecutive output rows: a token's k experts). With router_logits [T, E]: the experts
    # are each token's top_k picks by moe.route, T * top_k rows; mix: x has those T * top_k
    # rows, and output row t is the sum of token t's rows times their routing weights.
    if fmt == INT4 and scales.dtype == torch.int32:  # int4_group_words' words
        scales, zeros = int4_group_pairs(scales)
    if router_logits is not None:
        from moe import route

        weights, idx = route(router_logits, top_k)  # [T, top_k]
        rest = (bias, norm_weight, eps, glu)
        if not mix:
            return gemv_reference(x, weight, fmt, scales, zeros, groupsize, *rest, residual,
                                  idx.flatten())  # fmt: skip
        rows = gemv_reference(x, weight, fmt, scales, zeros, groupsize, *rest, None, idx.flatten())
        y = (rows.float().view(*weights.shape, -1) * weights[..., None]).sum(dim=1)  # [T, N]
        return (y if residual is None else y + residual.float()).to(x.dtype)
    if expert_idx is not None:
        rows, share = [], expert_idx.shape[0] // x.shape[0]
        for m, e in enumerate(expert_idx.tolist()):
            pick = [t[e] if t is not None else None for t in (weight, scales, zeros)]
            rest = (bias, norm_weight, eps, glu)
            r = residual[m : m + 1] if residual is not None else None
            xm = x[m // share : m // share + 1]
            rows.append(gemv_reference(xm, pick[0], fmt, pick[1], pick[2], groupsize, *rest, r))
        return torch.cat(rows)
    xf = x.float()
    if glu:
        gate, up = xf.chunk(2, dim=-1)
        xf = F.silu(gate) * up
    rstd = 1.0
    if norm_weight is not None:
        # RMSNorm's 1/rms multiplies the sums, as the one-row kernels apply it (so the one-row
        # int4 path rounds x * norm_weight to int8)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [M, 1]
        xf = xf * norm_weight.float()
    if fmt == INT4:
        from quantize import dequantize_int4

        w = dequantize_int4(weight, scales, zeros, groupsize)
        if xf.numel() == xf.shape[-1]:  # one row: the dp4a path, which quantizes x
            xf = activation_int8_reference(xf)
    else:
        w = weight.float()
    y = xf @ w.t() * rstd
    if fmt in (INT8, FP8):
        y = y * scales.float()
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def activation_int8_reference(x: Tensor) -> Tensor:
    # x [M, K] float32, K a multiple of 32 -> x rounded to int8 per block of 32 consecutive
    # columns with scale max|x| / 127 (halves to even), back in float32: what the one-row int4
    # GEMV multiplies its weights with.
    b = x.reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # 1 / max rounded, then times 127, as the kernel computes it (and as torch's 127.0 / t does)
    q = torch.round(b * (127.0 * torch.reciprocal(amax.clamp_min(1e-30))))
    return (q * (amax * (1.0 / 127.0))).reshape(x.shape)


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor):
    # q [B, H, 1, D]; caches [B, Hkv, S, D]; the query sits at slot input_pos[0] and sees slots
    # 0..input_pos[0]. -> [B, H, 1, D]
    S = k_cache.shape[2]
    mask = torch.arange(S, device=q.device)[None, :] <= input_pos[:, None]  # [1, S]
    return F.scaled_dot_product_attention(
        q, k_cache, v_cache, attn_mask=mask, enable_gqa=q.shape[1] != k_cache.shape[1]
    )


# ---------------------------------------------------------------------------------------------
# GEMV
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _dependent_launch(PDL: tl.constexpr):
        # Programmatic dependent launch (Hopper): the kernel after this one may start its
        # programs now, while ours finish, and ours wait here until the kernel before has
        # finished and its writes are visible. Decode is a chain of short kernels, and this
        # hides each one's launch behind its predecessor's tail. Nothing is read before it.
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def _load_x(x_ptr, off, mask, k_idx, nw_ptr, rstd, K, NORM: tl.constexpr, GLU: tl.constexpr):
        # The GEMV's input, with its prologue applied: x, or silu(gate) * up when the input row
        # is [gate (K) | up (K)], or x * rstd * norm_weight (RMSNorm; rstd 1 where the caller
        # applies it to the sums). -> (that, x as loaded), float32
        if GLU:
            g = tl.load(x_ptr + off, mask=mask, other=0).to(tl.float32)
            u = tl.load(x_ptr + off + K, mask=mask, other=0).to(tl.float32)
            x = g * tl.sigmoid(g) * u
        else:
            x = tl.load(x_ptr + off, mask=mask, other=0).to(tl.float32)
        xp = x
        if NORM:
            xp = x * rstd * tl.load(nw_ptr + k_idx, mask=mask, other=0).to(tl.float32)
        return xp, x

    # Quantized weights as 32-bit words, one row of x: the integer-to-float conversion is the
    # bottleneck of a quantized GEMV (int-to-float instructions run at a quarter of the FP32
    # rate), so each byte or nibble is ORed into the mantissa of 1.0 instead: with the value u
    # at mantissa bits b.., the float is 1 + u * 2^(b-23), exact. Summing v * x' with
    # x' = x * 2^(23-b) gives sum(x') + sum(u * x); the first term is known from x alone and
    # subtracted once per group. One logic op (and+or fuse into LOP3) plus a shared shift per
    # weight, and one FMA. The bits are kept at b >= 8 so that the cancellation loses
    # little: products are exact to 2^-24 of |x| while the signal is >= 2^-15 |x|.

    @triton.jit
    def _int8_word_floats(w, WORDS: tl.constexpr):
        # int32 words of 4 int8 -> 4 float32 tensors 1 + (q_t + 128) / 2^15, t = 0..3.
        # WORDS == 2: one PRMT per byte (PTX; Triton's interpreter cannot run it), else shifts
        # and masks.
        if WORDS == 2:
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 t;
                xor.b32 t, $4, 0x80808080;
                prmt.b32 $0, t, 0x3F800000, 0x7604;
                prmt.b32 $1, t, 0x3F800000, 0x7614;
                prmt.b32 $2, t, 0x3F800000, 0x7624;
                prmt.b32 $3, t, 0x3F800000, 0x7634;
                }""",
                "=r,=r,=r,=r,r",
                [w],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                is_pure=True,
                pack=1,
            )
        else:
            w = w ^ -2139062144  # 0x80808080: q + 128 in every byte
            v0 = (((w << 8) & 0xFF00) | 0x3F800000).to(tl.float32, bitcast=True)
            v1 = ((w & 0xFF00) | 0x3F800000).to(tl.float32, bitcast=True)
            v2 = (((w >> 8) & 0xFF00) | 0x3F800000).to(tl.float32, bitcast=True)
            v3 = (((w >> 16) & 0xFF00) | 0x3F800000).to(tl.float32, bitcast=True)
            return v0, v1, v2, v3

    @triton.jit
    def _int8_words(
        x_ptr, w_ptr, nw_ptr, rstd, K, stride_wn, rn, n_ok, k_lo, k_hi,
        NORM: tl.constexpr, GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        WORDS: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        # int8 rows as int32 words: byte t of word j is k = 4j + t. XOR 0x80 makes u = q + 128
        # unsigned; each byte is moved to bits 8..15 (b = 8), v = 1 + u / 2^15.
        # -> ([1, BLOCK_N], the sum of squares of x as loaded over k_lo..k_hi)
        BW: tl.constexpr = BLOCK_K // 4
        rw = tl.arange(0, BW)
        acc = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        xs = tl.zeros([BW], dtype=tl.float32)
        ss = tl.zeros([BW], dtype=tl.float32)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            kw = k // 4 + rw  # [BW] word index
            w_ok = n_ok[:, None] & (kw < k_hi // 4)[None, :]
            w = tl.load(w_ptr + rn[:, None] * stride_wn + kw[None, :], mask=w_ok, other=0)
            x_off = 4 * kw[:, None] + tl.arange(0, 4)[None, :]  # [BW, 4]
            x4, raw = _load_x(x_ptr, x_off, x_off < k_hi, x_off, nw_ptr, rstd, K, NORM, GLU)
            xs += tl.sum(x4, axis=1)
            ss += tl.sum(raw * raw, axis=1)
            x_even, x_odd = tl.split(tl.reshape(x4 * 32768.0, [BW, 2, 2]))  # t = 2a + c
            x0, x2 = tl.split(x_even)
            x1, x3 = tl.split(x_odd)
            v0, v1, v2, v3 = _int8_word_floats(w, WORDS)
            acc += v0 * x0[None, :]  # one FMA per weight: no sums of products first
            acc += v1 * x1[None, :]
            acc += v2 * x2[None, :]
            acc += v3 * x3[None, :]
        # sum(v * x') = 2^15 sum(x) + sum((q + 128) x)
        return (tl.sum(acc, axis=1) - (32768.0 + 128.0) * tl.sum(xs))[None, :], tl.sum(ss)

    @triton.jit
    def _dp4a(a, b, c, WORDS: tl.constexpr):
        # c + sum over bytes t of a's byte t (unsigned) times b's byte t (signed), int32 words.
        # WORDS == 2: the dp4a instruction (PTX); else shifts and multiplies.
        if WORDS == 2:
            return tl.inline_asm_elementwise(
                "dp4a.u32.s32 $0, $1, $2, $3;",
                "=r,r,r,r",
                [a, b, c],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:
            for t in tl.static_range(4):
                c += ((a >> (8 * t)) & 255) * ((b << (24 - 8 * t)) >> 24)
            return c

    @triton.jit
    def _round_to_int(v, WORDS: tl.constexpr):
        # float32 -> int32, halves to even. WORDS == 2: one cvt (PTX); else floor(v + 0.5), a
        # tie that lands on an odd number stepped back (v + 0.5 is exact for |v| < 2^22).
        if WORDS == 2:
            return tl.inline_asm_elementwise(
                "cvt.rni.s32.f32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            r = tl.floor(v + 0.5)
            odd_tie = ((r - v) == 0.5) & ((r.to(tl.int32) & 1) == 1)
            return (r - tl.where(odd_tie, 1.0, 0.0)).to(tl.int32)

    @triton.jit
    def _reciprocal(a, WORDS: tl.constexpr):
        # 1 / a rounded as IEEE division rounds it (torch.reciprocal's result), a > 0 and normal.
        # WORDS == 2: Triton's default quotient (approximate, within 2 units in the last place)
        # and one Newton step on FMAs, which rounds it correctly; div_rn's full-range sequence
        # cost 7% of a Llama-2-7B int4 decode step on the H200 (334 vs 359 tok/s). Else div_rn.
        if WORDS == 2:
            r = 1.0 / a
            return tl.fma(tl.fma(-a, r, 1.0), r, r)
        else:
            return tl.div_rn(tl.full(a.shape, 1.0, tl.float32), a)

    @triton.jit
    def _scale_offset(v):
        # int4 group words (int4_group_words) -> their scales and offsets as float32: a
        # bfloat16's bits are the top half of the float32 of the same value
        return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _int4_words(
        x_ptr, w_ptr, s_ptr, nw_ptr, rstd, K, stride_wn, stride_sn, rn, n_ok, k_lo, k_hi,
        G: tl.constexpr, SG: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        # int4 rows as int32 words, the stored format read as is: nibble i (bits 4i..4i+3) of
        # word j is k = 8j + i. A float FMA per nibble needs 4-6 instructions with its unpacking,
        # more than the H200 can issue per nibble at full read bandwidth (about 3.5). So x is
        # quantized to int8 per block of 32 (scale max|x| / 127, as activation_int8_reference
        # does), and each word is two dp4a (4 products each) on its even and odd nibbles,
        # masked in place: w & 0x0F0F0F0F holds k = 8j, 8j+2, 8j+4, 8j+6 as bytes, (w >> 4) &
        # 0x0F0F0F0F the odd k. About 5 instructions per 8 nibbles. w = (q - zero) * scale.
        # The weights load as [BLOCK_N, BW] words, contiguous along the row: a warp's threads
        # read 16 bytes each of one row, and each thread keeps one block of 32 nibbles of
        # several rows, so x's words are fetched once per thread for all of them.
        BW: tl.constexpr = BLOCK_K // 8
        NB: tl.constexpr = BLOCK_K // 32
        NG: tl.constexpr = BLOCK_K // G  # groups per step (G: 32 to BLOCK_K)
        rw = tl.arange(0, BW)
        rg = tl.arange(0, NG)
        shift = 8 * tl.arange(0, 4)
        acc = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
        ss = tl.zeros([NB], dtype=tl.float32)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            kw = k // 8 + rw  # [BW] word index
            # whole blocks of 4 words in or out: the mask stays constant over each 16-byte load
            w_ok = n_ok[:, None] & ((k + 32 * (rw // 4)) < k_hi)[None, :]
            w = tl.load(w_ptr + rn[:, None] * stride_wn + kw[None, :], mask=w_ok, other=0)
            # The step's group scales and offsets load with its weights, before the exchanges of
            # x between threads below (their barriers would hold the loads back and leave their
            # latency exposed). Masked in runs of SG groups, each a single vector load: SG
            # divides a step's groups and the row's, and a split ends on a whole step or at K,
            # so no run straddles k_hi.
            s_off = (
                rn[:, None] * tl.multiple_of(stride_sn, SG)
                + (tl.multiple_of(k // G, NG) + rg)[None, :]
            )
            sg_ok = n_ok[:, None] & ((k + G * SG * (rg // SG)) < k_hi)[None, :]
            s, z = _scale_offset(tl.load(s_ptr + s_off, mask=sg_ok, other=0))  # [BN, NG]
            kb = k + 32 * tl.arange(0, NB)  # [NB] first k of each block
            b_ok = kb < k_hi
            x_off = kb[:, None] + tl.arange(0, 32)[None, :]  # [NB, 32]
            x32, raw = _load_x(x_ptr, x_off, b_ok[:, None], x_off, nw_ptr, rstd, K, NORM, GLU)
            ss += tl.sum(raw * raw, axis=1)
            amax = tl.max(tl.abs(x32), axis=1)  # [NB]
            # 127 times the IEEE-rounded 1 / amax, then round-half-even, as
            # activation_int8_reference computes (v + 0.5 would fuse into an FMA).
            inv = 127.0 * _reciprocal(tl.maximum(amax, 1e-30), WORDS)
            xq = _round_to_int(x32 * inv[:, None], WORDS)  # [NB, 32], -127..127; 0 if amax is
            x_scale = amax * (1.0 / 127.0)
            xsum = tl.sum(xq, axis=1).to(tl.float32) * x_scale  # [NB]
            # bytes of x as words like w's: k = 8j + 2t + c, c = 0 the even k; the bytes are
            # disjoint, so the sums are ORs
            x_even, x_odd = tl.split(tl.reshape(xq & 255, [NB, 4, 4, 2]))  # [NB, 4 (j), 4 (t)]
            x_even = tl.reshape(tl.sum(x_even << shift[None, None, :], axis=2), [BW])
            x_odd = tl.reshape(tl.sum(x_odd << shift[None, None, :], axis=2), [BW])
            q = _dp4a(w & 0x0F0F0F0F, x_even[None, :], tl.zeros_like(w), WORDS)
            q = _dp4a((w >> 4) & 0x0F0F0F0F, x_odd[None, :], q, WORDS)  # [BN, BW]
            q = tl.sum(tl.reshape(q, [BLOCK_N, NB, 4]), axis=2)  # [BN, NB]: sum of q * x_int8
            qx = q.to(tl.float32) * x_scale[None, :]
            # per group: the blocks' sums, and the group's scale and offset. Their offsets are
            # written as the group's first one plus a range, so the compiler sees them
            # contiguous along the row and neighbouring threads read neighbouring groups (per
            # block, each thread's 2-byte loads fell in sectors of their own: 88% of the
            # sectors read were waste, and waiting on them was a third of the kernel's stalls).
            qx = tl.sum(tl.reshape(qx, [BLOCK_N, NG, G // 32]), axis=2)  # [BN, NG]
            xsum = tl.sum(tl.reshape(xsum, [NG, G // 32]), axis=1)  # [NG]
            acc += s * (qx - z * xsum[None, :])
        return tl.sum(acc, axis=1)[None, :], tl.sum(ss)  # [1, BN], as _int8_words

    @triton.jit
    def _route_pick(l_ptr, n_experts, j, E_P2: tl.constexpr, TOPK: tl.constexpr):
        # Mixtral's routing (moe.route) of one token from its router logits [n_experts]: softmax,
        # the TOPK largest (first index on ties), renormalised -> (the expert of pick j, its
        # weight). A few dozen instructions on one warp's registers, cheaper than the kernel
        # launch it replaces.
        re = tl.arange(0, E_P2)
        logit = tl.load(l_ptr + re, mask=re < n_experts, other=float("-inf")).to(tl.float32)
        p = tl.exp(logit - tl.max(logit, axis=0))
        rest = tl.where(re < n_experts, p / tl.sum(p, axis=0), -1.0)  # probabilities are >= 0
        total = 0.0
        pick = 0
        p_pick = 0.0
        for t in tl.static_range(TOPK):
            best = tl.max(rest, axis=0)
            i = tl.argmax(rest, axis=0, tie_break_left=True)
            total += best
            pick = tl.where(t == j, i, pick)
            p_pick = tl.where(t == j, best, p_pick)
            rest = tl.where(re == i, -1.0, rest)
        return pick.to(tl.int64), p_pick / total

    @triton.jit
    def _row_dot(
        x_ptr, w_ptr, s_ptr, nw_ptr, K, stride_wn, stride_sn, rn, n_ok, k_lo, k_hi,
        FMT: tl.constexpr, G: tl.constexpr, SG: tl.constexpr, NORM: tl.constexpr,
        GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
        STAGES: tl.constexpr,
    ):  # fmt: skip
        # One row of x' (the prologue applied, RMSNorm's rstd left to the caller) against rows
        # rn of W over k_lo..k_hi -> ([1, BLOCK_N] float32 sums, int8's and fp8's row scales
        # applied; the sum of squares of x as loaded). int4 takes the word path only.
        if WORDS and FMT == 1:
            out, ss = _int8_words(
                x_ptr, w_ptr, nw_ptr, 1.0, K, stride_wn, rn, n_ok, k_lo, k_hi,
                NORM, GLU, BLOCK_N, BLOCK_K, WORDS, STAGES,
            )  # fmt: skip
        elif WORDS and FMT == 2:
            out, ss = _int4_words(
                x_ptr, w_ptr, s_ptr, nw_ptr, 1.0, K, stride_wn, stride_sn, rn, n_ok,
                k_lo, k_hi, G, SG, NORM, GLU, BLOCK_N, BLOCK_K, WORDS, STAGES,
            )  # fmt: skip
        else:
            tl.static_assert(FMT != 2)
            rk = tl.arange(0, BLOCK_K)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            ss_k = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                kk = k + rk
                k_ok = kk < k_hi
                w_ok = n_ok[:, None] & k_ok[None, :]
                w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=w_ok, other=0)
                if FMT == 3:  # float8 weights arrive as their bytes
                    w = w.to(tl.float8e4nv, bitcast=True)
                x, raw = _load_x(x_ptr, kk, k_ok, kk, nw_ptr, 1.0, K, NORM, GLU)
                acc += w.to(tl.float32) * x[None, :]
                ss_k += raw * raw
            out = tl.sum(acc, axis=1)[None, :]  # [1, BN]
            ss = tl.sum(ss_k)
        if FMT == 1 or FMT == 3:
            out = out * tl.load(s_ptr + rn, mask=n_ok, other=0).to(tl.float32)[None, :]
        return out, ss

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, r_ptr, y_ptr, e_ptr,
        M, N, K, eps, stride_xm, stride_wn, stride_sn, stride_rm, stride_ym, stride_we, stride_se,
        x_share, n_experts, FMT: tl.constexpr, G: tl.constexpr, SG: tl.constexpr,
        HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, WORDS: tl.constexpr, EXPERTS: tl.constexpr,
        TOPK: tl.constexpr, E_P2: tl.constexpr, MIX: tl.constexpr, PDL: tl.constexpr,
        STAGES: tl.constexpr,
    ):  # fmt: skip
        # y[m, n] = sum_k x'[m, k] * W[n, k] (+ bias[n]) (+ residual[m, n]), x' = prologue(x).
        # BLOCK_M == 1: elementwise products summed once at the end (no tensor cores needed);
        # BLOCK_M >= 16: tl.dot on dequantized tiles, for batches and prefill of quantized
        # weights (each tile dequantized in registers, never the whole weight in memory).
        # EXPERTS: W is a stack of experts' weights and program_id(2) an output row, whose
        # expert is e_ptr[row], or with TOPK the (row % TOPK)-th pick of router logits e_ptr
        # [rows / TOPK, n_experts]. MIX: program_id(2) a token, and its row is the sum of its
        # TOPK picks' rows (x rows token * TOPK + j), each times its routing weight.
        _dependent_launch(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        if EXPERTS:
            row = tl.program_id(2)
            r_ptr += row * stride_rm
            y_ptr += row * stride_ym
            if not MIX:
                if TOPK:
                    l_ptr = e_ptr + (row // TOPK) * n_experts
                    e, _ = _route_pick(l_ptr, n_experts, row % TOPK, E_P2, TOPK)
                else:
                    e = tl.load(e_ptr + row).to(tl.int64)
                x_ptr += (row // x_share) * stride_xm  # x_share consecutive rows read one x row
                w_ptr += e * stride_we
                s_ptr += e * stride_se
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Without experts, program_id(2) picks a tile of BLOCK_M rows (prefill-sized inputs).
        rm = (0 if EXPERTS else tl.program_id(2) * BLOCK_M) + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        m_ok = rm < M
        k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        # RMSNorm with one row: its rstd is a scalar and the products are linear in x, so x *
        # norm_weight goes in and rstd multiplies the finished sums; the sum of squares for it
        # is gathered as x loads, with no pass over x before the weights are read (that pass
        # costs each program a few dependent L2 reads before its first weight load). Row tiles,
        # and one row split over K (each program sees part of the row): rstd from a first pass.
        LATE_RSTD: tl.constexpr = NORM and BLOCK_M == 1 and SPLIT_K == 1
        rstd = 1.0
        if NORM and not LATE_RSTD:  # x is small and stays in L2
            ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                kk = k + rk
                x_ok = m_ok[:, None] & (kk < K)[None, :]
                xs = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=x_ok, other=0)
                ss += xs.to(tl.float32) * xs.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)  # [BLOCK_M]
        ss_x = 0.0  # one row: the sum of squares of x gathered by the loop below
        if MIX:
            # Mixtral's w2: the token's experts in turn, mixed as moe.moe_experts mixes them,
            # without the [TOPK, N] rows of their outputs ever leaving the registers.
            tl.static_assert(BLOCK_M == 1 and not NORM)
            out = tl.zeros([1, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(TOPK):
                e, weight = _route_pick(e_ptr + row * n_experts, n_experts, j, E_P2, TOPK)
                part, _ = _row_dot(
                    x_ptr + (row * TOPK + j) * stride_xm, w_ptr + e * stride_we,
                    s_ptr + e * stride_se, nw_ptr, K, stride_wn,
                    stride_sn, rn, n_ok, k_lo, k_hi, FMT, G, SG, NORM, GLU, BLOCK_N, BLOCK_K,
                    WORDS, STAGES,
                )  # fmt: skip
                out += weight * part
        elif BLOCK_M == 1:
            out, ss_x = _row_dot(
                x_ptr, w_ptr, s_ptr, nw_ptr, K, stride_wn, stride_sn, rn, n_ok, k_lo,
                k_hi, FMT, G, SG, NORM, GLU, BLOCK_N, BLOCK_K, WORDS, STAGES,
            )  # fmt: skip
        elif FMT == 2 and BLOCK_K == G:
            # int4, many rows (prefill), one group per step: its scale and offset are [BLOCK_N]
            # vectors. Byte j of a row holds k = 2j (low nibble) and 2j + 1 (high): joined
            # back into column order, the tile meets x's contiguous (vector-loaded) columns.
            HK: tl.constexpr = BLOCK_K // 2
            rj = tl.arange(0, HK)
            dt = x_ptr.dtype.element_ty
            r2 = rstd[:, None] if NORM else 1.0
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in range(k_lo, k_hi, BLOCK_K):  # K is a whole number of groups
                w_off = rn[:, None] * stride_wn + (k // 2 + rj)[None, :]
                p = tl.load(w_ptr + w_off, mask=n_ok[:, None], other=0).to(tl.int32)  # [BN, HK]
                s, z = _scale_offset(tl.load(s_ptr + rn * stride_sn + k // G, mask=n_ok, other=0))
                q = tl.reshape(tl.join(p & 15, p >> 4), [BLOCK_N, BLOCK_K])  # [BN, BK]
                w = ((q.to(tl.float32) - z[:, None]) * s[:, None]).to(dt)
                kk = (k + rk)[None, :]
                x_off = rm[:, None] * stride_xm + kk
                x, _ = _load_x(x_ptr, x_off, m_ok[:, None], kk, nw_ptr, r2, K, NORM, GLU)
                acc += tl.dot(x.to(dt), tl.trans(w), input_precision=DOT_PRECISION)
            out = acc
        elif FMT == 2:
            # int4 for a few rows (one row always takes the word path), stored format: byte j
            # of a row holds k = 2j (low nibble) and 2j + 1 (high); w = (q - zero) * scale per
            # group of G along k.
            NG: tl.constexpr = BLOCK_K // G
            HG: tl.constexpr = G // 2
            rg = tl.arange(0, NG)
            rj = tl.arange(0, HG)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                g_ok = (k + rg * G) < k_hi  # [NG]
                w_off = rn[:, None, None] * stride_wn + (k // 2 + rg * HG)[None, :, None] + rj
                w_ok = n_ok[:, None, None] & g_ok[None, :, None]
                p = tl.load(w_ptr + w_off, mask=w_ok, other=0).to(tl.int32)  # [BN, NG, HG]
                # Nibble to float without int-to-float conversions (a quarter-rate instruction
                # that would bound the kernel): OR the nibble into the mantissa of 2^23 and
                # subtract 2^23. The high nibble is kept in place, i.e. times 16.
                lo = ((p & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                hi = ((p & 240) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                s_off = rn[:, None] * stride_sn + (k // G + rg)[None, :]
                sg_ok = n_ok[:, None] & g_ok[None, :]
                s, z = _scale_offset(tl.load(s_ptr + s_off, mask=sg_ok, other=0))  # [BN, NG]
                k_even = (k + rg * G)[:, None] + 2 * rj[None, :]  # [NG, HG]
                xm_off = rm[:, None, None] * stride_xm + k_even[None]
                xm_ok = m_ok[:, None, None] & g_ok[None, :, None]
                r3 = rstd[:, None, None] if NORM else 1.0
                k_odd = k_even[None] + 1
                x_lo, _ = _load_x(x_ptr, xm_off, xm_ok, k_even[None], nw_ptr, r3, K, NORM, GLU)
                x_hi, _ = _load_x(x_ptr, xm_off + 1, xm_ok, k_odd, nw_ptr, r3, K, NORM, GLU)
                dt = x_ptr.dtype.element_ty
                w_lo = ((lo - z[:, :, None]) * s[:, :, None]).to(dt)
                w_hi = ((hi * 0.0625 - z[:, :, None]) * s[:, :, None]).to(dt)
                acc += tl.dot(
                    tl.reshape(x_lo.to(dt), [BLOCK_M, BLOCK_K // 2]),
                    tl.trans(tl.reshape(w_lo, [BLOCK_N, BLOCK_K // 2])),
                    input_precision=DOT_PRECISION,
                )
                acc += tl.dot(
                    tl.reshape(x_hi.to(dt), [BLOCK_M, BLOCK_K // 2]),
                    tl.trans(tl.reshape(w_hi, [BLOCK_N, BLOCK_K // 2])),
                    input_precision=DOT_PRECISION,
                )
            out = acc
        else:  # float, int8 or float8 row tiles
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                kk = k + rk
                k_ok = kk < k_hi
                w = tl.load(
                    w_ptr + rn[:, None] * stride_wn + kk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :],
                    other=0,
                )
                if FMT == 3:  # float8 weights arrive as their bytes
                    w = w.to(tl.float8e4nv, bitcast=True)
                x_off = rm[:, None] * stride_xm + kk[None, :]
                x_ok = m_ok[:, None] & k_ok[None, :]
                r2 = rstd[:, None] if NORM else 1.0
                x, _ = _load_x(x_ptr, x_off, x_ok, kk[None, :], nw_ptr, r2, K, NORM, GLU)
                dt = x_ptr.dtype.element_ty
                acc += tl.dot(x.to(dt), tl.trans(w.to(dt)), input_precision=DOT_PRECISION)
            out = acc
            if FMT == 1 or FMT == 3:
                out = out * tl.load(s_ptr + rn, mask=n_ok, other=0).to(tl.float32)[None, :]
        if NORM and BLOCK_M == 1:  # the one-row paths summed x * norm_weight: rstd now
            if LATE_RSTD:
                rstd = tl.rsqrt(ss_x / K + eps)
            out = out * rstd
        y_off = rm[:, None] * stride_ym + rn[None, :]
        y_ok = m_ok[:, None] & n_ok[None, :]
        if pid_k == 0:  # the epilogue's additions, once
            if HAS_BIAS:
                out += tl.load(b_ptr + rn, mask=n_ok, other=0).to(tl.float32)[None, :]
            if RESIDUAL:
                r_off = rm[:, None] * stride_rm + rn[None, :]
                out += tl.load(r_ptr + r_off, mask=y_ok, other=0).to(tl.float32)
        if SPLIT_K == 1:
            tl.store(y_ptr + y_off, out.to(y_ptr.dtype.element_ty), mask=y_ok)
        else:
            tl.atomic_add(y_ptr + y_off, out, mask=y_ok, sem="relaxed")


# ---------------------------------------------------------------------------------------------
# One-row int4 GEMV in Gluon
# ---------------------------------------------------------------------------------------------
# The Triton kernel above leaves the layouts to the compiler, which spreads x's blocks of 32
# over several threads and then moves them between layouts through shared memory: on the
# H200 (Triton 3.6) its one-row int4 loop holds 5 such exchanges and 10 barriers per step.
# Here the layouts are written out: each thread owns one block of 32 k, both its 4 weight
# words (16 bytes) of every row and its 32 values of x, so x's rounding to int8, its packing
# into words and the dp4a products stay in the thread's registers. The only exchange is the
# final sum over the row. The first step's weights load before the wait on the kernel before
# (they never depend on it), and each step loads the next one's while it computes.
# Same arithmetic as _int4_words (x rounded like activation_int8_reference); the group
# scales apply per block of 32, so sums are added in another order. Runs on CUDA only
# (Triton's interpreter has no Gluon); the GPU tests compare it with gemv_reference.

if gluon is not None:

    @gluon.jit
    def _gl_dp4a(a, b, c):
        asm: gl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;"
        return gl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, c], gl.int32, True, 1)

    @gluon.jit
    def _gl_round_bits(v):
        # v + 1.5 * 2^23 rounded to nearest even: the integer round(v) sits in the low mantissa
        # bits (|v| < 2^22). An add of its own, so it cannot fuse with the product before it.
        asm: gl.constexpr = "add.rn.f32 $0, $1, 0f4B400000;"
        return gl.inline_asm_elementwise(asm, "=f,f", [v], gl.float32, True, 1).to(
            gl.int32, bitcast=True
        )

    @gluon.jit
    def _gl_split4(v):
        # [..., 4] -> its 4 slices along the last dimension (held in one thread: no data moves)
        a, b = gl.split(gl.reshape(v, v.shape[:-1] + [2, 2]))  # a: 0 and 2, b: 1 and 3
        v0, v2 = gl.split(a)
        v1, v3 = gl.split(b)
        return v0, v1, v2, v3

    @gluon.jit
    def _gl_pack_bytes(b0, b1, b2, b3):
        # byte 0 of each -> one word, b0 in byte 0
        asm: gl.constexpr = """{
            .reg .b32 lo, hi;
            prmt.b32 lo, $1, $2, 0x5140;
            prmt.b32 hi, $3, $4, 0x5140;
            prmt.b32 $0, lo, hi, 0x5410;
            }"""
        return gl.inline_asm_elementwise(asm, "=r,r,r,r,r", [b0, b1, b2, b3], gl.int32, True, 1)

    @gluon.jit
    def _gl_sigmoid(v):
        # 1 / (1 + 2^(-v log2 e)) on the approximate ex2 and rcp units (a few ulp): the exact
        # quotient's range checks were 8 instructions per value of x
        asm: gl.constexpr = """{
            .reg .f32 t;
            mul.f32 t, $1, 0fBFB8AA3B;
            ex2.approx.ftz.f32 t, t;
            add.f32 t, t, 0f3F800000;
            rcp.approx.ftz.f32 $0, t;
            }"""
        return gl.inline_asm_elementwise(asm, "=f,f", [v], gl.float32, True, 1)

    @gluon.jit
    def _gl_reciprocal(a):
        r = 1.0 / a
        return gl.fma(gl.fma(-a, r, 1.0), r, r)

    @gluon.jit
    def _gl_program(PDL: gl.constexpr):
        # -> the program's index; with PDL, the next kernel may launch now (as _dependent_launch)
        if PDL:
            asm: gl.constexpr = "griddepcontrol.launch_dependents; // $0"
            gl.inline_asm_elementwise(asm, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        return gl.program_id(0)

    @gluon.jit
    def _gl_pdl_wait():
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _gl_load_x(x_ptr, x_off, ok, nw_ptr, K, ss, NORM: gl.constexpr, GLU: gl.constexpr):
        # The GEMV's input [NB, ...] with its prologue, as _load_x: x, or silu(gate) * up, or x *
        # norm_weight with x's squares summed over its last two dimensions into ss [NB]
        if GLU:
            gate = gl.load(x_ptr + x_off, mask=ok, other=0).to(gl.float32)
            up = gl.load(x_ptr + x_off + K, mask=ok, other=0).to(gl.float32)
            xv = gate * _gl_sigmoid(gate) * up
        else:
            xv = gl.load(x_ptr + x_off, mask=ok, other=0).to(gl.float32)
        if NORM:
            ss += gl.sum(gl.sum(xv * xv, axis=2), axis=1)
            xv = xv * gl.load(nw_ptr + x_off, mask=ok, other=0).to(gl.float32)
        return xv, ss

    @gluon.constexpr_function
    def _gl_block_layouts(V, A, B, num_warps):
        # The layouts of the Gluon GEMVs: weights [rows, NB, V] (16 bytes of each row) and x
        # [NB, A, B] with NB = 32 * num_warps blocks of k: the thread that holds block b's
        # weights, thread (warp v, lane l) for b = 32v + l, holds the same block's x
        w = gl.BlockedLayout([1, 1, V], [1, 32, 1], [1, num_warps, 1], [2, 1, 0])
        return w, gl.BlockedLayout([1, A, B], [32, 1, 1], [num_warps, 1, 1], [2, 1, 0])

    @gluon.jit
    def _gl_grid3(A: gl.constexpr, B: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
        # the indices of an [A, B, C] tensor of layout L along each dimension: [A, 1, 1],
        # [1, B, 1], [1, 1, C]
        a = gl.arange(0, A, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        b = gl.arange(0, B, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        a3 = gl.expand_dims(gl.expand_dims(a, 1), 2)
        return a3, gl.expand_dims(gl.expand_dims(b, 0), 2), gl.expand_dims(gl.expand_dims(c, 0), 1)

    @gluon.jit
    def _gl_weight_rows(
        w_ptr, stride_wn, row0, BLOCK_N: gl.constexpr, V: gl.constexpr, L3: gl.constexpr
    ):
        # The first step of weights [BLOCK_N, NB, V] (layout L3) from row row0: row rn, block b,
        # element v at w_ptr + rn * stride_wn + V * b + v -> (pointers, the rows [BN, 1, 1],
        # the blocks [1, NB, 1], the rows [BN])
        NB: gl.constexpr = L3.warps_per_cta[1] * 32
        rn3, rb3, rv3 = _gl_grid3(BLOCK_N, NB, V, L3)
        rn = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        rn3 += row0
        return w_ptr + rn3 * stride_wn + rb3 * V + rv3, rn3, rb3, rn

    @gluon.jit
    def _gl_x_offsets(NB: gl.constexpr, A: gl.constexpr, B: gl.constexpr, X3: gl.constexpr):
        # offsets of x [NB, A, B] (layout X3) within a step: blocks of A * B k -> (offsets,
        # the blocks [NB, 1, 1])
        xb3, xa3, xi3 = _gl_grid3(NB, A, B, X3)
        return xb3 * (A * B) + xa3 * B + xi3, xb3

    @gluon.jit
    def _gl_x_int8_words(xv):
        # x [NB, 4, 8] (a block of 32 k per thread) rounded to int8 like
        # activation_int8_reference -> (4 x [NB] words of its even k, 4 x [NB] of its odd k, as
        # the int4 weights' words hold them: k = 8t + 2i + c; max |x| [NB])
        NB: gl.constexpr = xv.shape[0]
        amax = gl.max(gl.max(gl.abs(xv), axis=2), axis=1)  # [NB]
        inv = 127.0 * _gl_reciprocal(gl.maximum(amax, 1e-30))
        bits = _gl_round_bits(xv * gl.expand_dims(gl.expand_dims(inv, 1), 2))  # [NB, 4, 8]
        # byte 0 of bits is x_int8; 3 PRMT per word
        x_even, x_odd = gl.split(gl.reshape(bits, [NB, 4, 4, 2]))  # [NB, 4 (t), 4 (i)]
        e0, e1, e2, e3 = _gl_split4(x_even)
        o0, o1, o2, o3 = _gl_split4(x_odd)
        x_even = _gl_split4(_gl_pack_bytes(e0, e1, e2, e3))  # 4 x [NB], t = 0..3
        return x_even, _gl_split4(_gl_pack_bytes(o0, o1, o2, o3)), amax

    @gluon.jit
    def _gl_int4_blocks(w, sz, x_even, x_odd, amax, LQ: gl.constexpr):
        # Weights w [BN, NB, 4] words (each thread a block of 32 k of every row), their groups'
        # words sz [BN, NB] (scale s and offset z) and _gl_x_int8_words' x -> [BN, NB]
        # float32, each block's s * (sum q x - z sum x)
        BN: gl.constexpr = w.shape[0]
        NB: gl.constexpr = w.shape[1]
        w_t = _gl_split4(w)  # 4 x [BN, NB]
        WL: gl.constexpr = w_t[0].type.layout
        ones = gl.full([1, NB], 0x01010101, gl.int32, WL)
        qe = gl.zeros([BN, NB], gl.int32, WL)  # sum of the even nibbles times x_int8
        qo = gl.zeros([BN, NB], gl.int32, WL)  # 16 times that, the odd nibbles
        qsum = gl.zeros([1, NB], gl.int32, WL)  # sum of x_int8
        for t in gl.static_range(4):
            xe = gl.expand_dims(gl.convert_layout(x_even[t], gl.SliceLayout(0, WL)), 0)
            xo = gl.expand_dims(gl.convert_layout(x_odd[t], gl.SliceLayout(0, WL)), 0)
            # the odd nibbles masked in place are 16 times their value: no shift per word
            qe = _gl_dp4a(w_t[t] & 0x0F0F0F0F, xe, qe)
            qo = _gl_dp4a(w_t[t] & -252645136, xo, qo)  # 0xF0F0F0F0
            qsum = _gl_dp4a(ones, xo, _gl_dp4a(ones, xe, qsum))
        q = qe + (qo >> 4)  # [BN, NB], exact: qo is a multiple of 16
        x_scale = gl.expand_dims(gl.convert_layout(amax * (1.0 / 127.0), gl.SliceLayout(0, WL)), 0)
        xsum = qsum.to(gl.float32) * x_scale  # [1, NB]
        qx = q.to(gl.float32) * x_scale
        qx = gl.convert_layout(qx, LQ, assert_trivial=True)  # the same threads: no moves
        xsum = gl.convert_layout(xsum, LQ, assert_trivial=True)
        # a bfloat16's bits are the top half of the float32 of the same value
        s = (sz << 16).to(gl.float32, bitcast=True)
        z = (sz & -65536).to(gl.float32, bitcast=True)
        return s * (qx - z * xsum)

    @gluon.jit
    def _gl_int4_step(w_rows, s_ptr, g_off, n_ok3, n_ok2, rb3, rb, k, K, G: gl.constexpr):
        # the step at k of _int4_row_gluon's weights [BN, NB, 4] and their group words [BN,
        # NB], masked off past K
        w = gl.load(w_rows + k // 8, mask=n_ok3 & (k + rb3 * 32 < K), other=0)
        sg_ok = n_ok2 & gl.expand_dims(k + rb * 32 < K, 0)
        return w, gl.load(s_ptr + g_off + k // G, mask=sg_ok, other=0)

    @gluon.jit
    def _int4_row_gluon(
        x_ptr, w_ptr, s_ptr, nw_ptr, r_ptr, y_ptr, N, K, eps, stride_wn, stride_sn,
        G: gl.constexpr, NORM: gl.constexpr, GLU: gl.constexpr, RESIDUAL: gl.constexpr,
        BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, PDL: gl.constexpr, EARLY: gl.constexpr,
    ):  # fmt: skip
        NB: gl.constexpr = 32 * NUM_WARPS  # blocks of 32 k per step: one per thread
        BLOCK_K: gl.constexpr = 32 * NB
        # weights [BLOCK_N, NB, 4] int32 words, x [NB, 4, 8]: a thread holds a block of 32 k
        L3: gl.constexpr = _gl_block_layouts(4, 4, 8, NUM_WARPS)[0]
        X3: gl.constexpr = _gl_block_layouts(4, 4, 8, NUM_WARPS)[1]
        LQ: gl.constexpr = gl.SliceLayout(2, L3)  # [BLOCK_N, NB]
        XB: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, X3))  # [NB]
        row0 = _gl_program(PDL) * BLOCK_N
        w_rows, rn3, rb3, rn = _gl_weight_rows(w_ptr, stride_wn, row0, BLOCK_N, 4, L3)
        n_ok = rn < N
        rb = gl.arange(0, NB, layout=gl.SliceLayout(0, LQ))  # [NB]
        n_ok3 = rn3 < N
        s_rows = gl.expand_dims(rn, 1) * stride_sn  # [BN, 1]
        n_ok2 = gl.expand_dims(n_ok, 1)
        x_in, xb3 = _gl_x_offsets(NB, 4, 8, X3)  # [NB, 4, 8]

        # The first step's weights (EARLY 2: the first two steps') do not depend on the kernel
        # before: they load before the wait.
        b_ok3 = rb3 * 32 < K
        w = gl.load(w_rows, mask=n_ok3 & b_ok3, other=0)
        g_off = s_rows + gl.expand_dims(rb * 32 // G, 0)  # [BN, NB]
        sg_ok = n_ok2 & gl.expand_dims(rb * 32 < K, 0)
        sz = gl.load(s_ptr + g_off, mask=sg_ok, other=0)  # [BN, NB] group words
        if EARLY == 2:
            w_next, sz_next = _gl_int4_step(
                w_rows, s_ptr, g_off, n_ok3, n_ok2, rb3, rb, BLOCK_K, K, G
            )
        if PDL:
            _gl_pdl_wait()
        if RESIDUAL:
            res = gl.load(r_ptr + rn, mask=n_ok, other=0).to(gl.float32)
        acc = gl.zeros([BLOCK_N, NB], gl.float32, LQ)
        ss = gl.zeros([NB], gl.float32, XB)
        for k0 in range(0, K, BLOCK_K):
            if EARLY == 1:
                # the next step's weights, in flight while this one computes (masked off past K)
                k1 = k0 + BLOCK_K
                b1_ok3 = k1 + rb3 * 32 < K
                w_next = gl.load(w_rows + k1 // 8, mask=n_ok3 & b1_ok3, other=0)
                g1_off = g_off + k1 // G
                sg1_ok = n_ok2 & gl.expand_dims(k1 + rb * 32 < K, 0)
                sz_next = gl.load(s_ptr + g1_off, mask=sg1_ok, other=0)
            # x: this thread's block of 32, with the prologue, rounded to int8 like
            # activation_int8_reference
            xv, ss = _gl_load_x(x_ptr, k0 + x_in, k0 + xb3 * 32 < K, nw_ptr, K, ss, NORM, GLU)
            x_even, x_odd, amax = _gl_x_int8_words(xv)
            acc += _gl_int4_blocks(w, sz, x_even, x_odd, amax, LQ)
            w = w_next
            sz = sz_next
            if EARLY == 2:  # the step after next, into the registers this one freed
                w_next, sz_next = _gl_int4_step(
                    w_rows, s_ptr, g_off, n_ok3, n_ok2, rb3, rb, k0 + 2 * BLOCK_K, K, G
                )
        out = gl.sum(acc, axis=1)  # [BN]
        if NORM:
            out = out * gl.rsqrt(gl.sum(ss, axis=0) / K + eps)
        if RESIDUAL:
            out += res
        gl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)

    @gluon.jit
    def _int4_rows_gluon(
        x_ptr, w_ptr, s_ptr, nw_ptr, r_ptr, y_ptr, N, K, eps, stride_wn, stride_sn,
        G: gl.constexpr, NORM: gl.constexpr, GLU: gl.constexpr, RESIDUAL: gl.constexpr,
        BLOCK_N: gl.constexpr, TILES: gl.constexpr, NUM_WARPS: gl.constexpr, PDL: gl.constexpr,
    ):  # fmt: skip
        # _int4_row_gluon for wide weights with short rows (K <= 1024 * NUM_WARPS, one step):
        # x is loaded and rounded to int8 once, then the program takes TILES tiles of BLOCK_N
        # rows in turn, loading the next tile while it computes one. With one tile per program,
        # each program reads all of x and RMSNorm's weight, 16 KB for K = 4096, against 32 KB
        # of weights for 16 rows: half as much again from L2 (Llama-2-7B's w13).
        NB: gl.constexpr = 32 * NUM_WARPS  # blocks of 32 k: one per thread
        L3: gl.constexpr = _gl_block_layouts(4, 4, 8, NUM_WARPS)[0]
        X3: gl.constexpr = _gl_block_layouts(4, 4, 8, NUM_WARPS)[1]
        LQ: gl.constexpr = gl.SliceLayout(2, L3)  # [BLOCK_N, NB]
        row0 = _gl_program(PDL) * (TILES * BLOCK_N)
        row_end = gl.minimum(row0 + TILES * BLOCK_N, N)
        w_rows, rn3, rb3, rn = _gl_weight_rows(w_ptr, stride_wn, row0, BLOCK_N, 4, L3)
        rb = gl.arange(0, NB, layout=gl.SliceLayout(0, LQ))  # [NB]
        b_ok3 = rb3 * 32 < K
        g_off = gl.expand_dims(rn, 1) * stride_sn + gl.expand_dims(rb * 32 // G, 0)  # [BN, NB]
        b_ok2 = gl.expand_dims(rb * 32 < K, 0)
        # The first tile's weights do not depend on the kernel before: they load before the wait.
        w = gl.load(w_rows, mask=(rn3 < row_end) & b_ok3, other=0)
        sg_ok = gl.expand_dims(rn < row_end, 1) & b_ok2
        sz = gl.load(s_ptr + g_off, mask=sg_ok, other=0)  # [BN, NB] group words
        if PDL:
            _gl_pdl_wait()
        if RESIDUAL:
            res = gl.load(r_ptr + rn, mask=rn < row_end, other=0).to(gl.float32)
        x_in, xb3 = _gl_x_offsets(NB, 4, 8, X3)  # [NB, 4, 8]
        ss = gl.zeros([NB], gl.float32, gl.SliceLayout(1, gl.SliceLayout(2, X3)))
        xv, ss = _gl_load_x(x_ptr, x_in, xb3 * 32 < K, nw_ptr, K, ss, NORM, GLU)
        x_even, x_odd, amax = _gl_x_int8_words(xv)
        if NORM:
            rstd = gl.rsqrt(gl.sum(ss, axis=0) / K + eps)
        for t in range(TILES):
            # the next tile, in flight while this one computes (masked off past the last)
            nxt = (t + 1) * BLOCK_N
            w_next = gl.load(w_rows + nxt * stride_wn, mask=(rn3 + nxt < row_end) & b_ok3, other=0)
            sg1_ok = gl.expand_dims(rn + nxt < row_end, 1) & b_ok2
            sz_next = gl.load(s_ptr + g_off + nxt * stride_sn, mask=sg1_ok, other=0)
            if RESIDUAL:
                res_next = gl.load(r_ptr + rn + nxt, mask=rn + nxt < row_end, other=0)
            out = gl.sum(_gl_int4_blocks(w, sz, x_even, x_odd, amax, LQ), axis=1)  # [BN]
            if NORM:
                out = out * rstd
            if RESIDUAL:
                out += res
                res = res_next.to(gl.float32)
            rt = rn + t * BLOCK_N
            gl.store(y_ptr + rt, out.to(y_ptr.dtype.element_ty), mask=rt < row_end)
            w = w_next
            sz = sz_next

    @gluon.jit
    def _gl_int8_floats(w):
        # an int32 word of 4 int8 -> 4 float32 1 + (q_t + 128) / 2^15, as _int8_word_floats
        asm: gl.constexpr = """{
            .reg .b32 t;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, 0x3F800000, 0x7604;
            prmt.b32 $1, t, 0x3F800000, 0x7614;
            prmt.b32 $2, t, 0x3F800000, 0x7624;
            prmt.b32 $3, t, 0x3F800000, 0x7634;
            }"""
        return gl.inline_asm_elementwise(
            asm, "=r,=r,=r,=r,r", [w], (gl.float32, gl.float32, gl.float32, gl.float32), True, 1
        )

    @gluon.jit
    def _int8_row_gluon(
        x_ptr, w_ptr, s_ptr, nw_ptr, r_ptr, y_ptr, N, K, eps, stride_wn,
        NORM: gl.constexpr, GLU: gl.constexpr, RESIDUAL: gl.constexpr,
        BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, PDL: gl.constexpr, EARLY: gl.constexpr,
    ):  # fmt: skip
        # One row against int8 rows (per-row scales), the layouts as in _int4_row_gluon: each
        # thread owns one block of 16 k, its 4 weight words (16 bytes) of every row and the same
        # 16 values of x, so the loop moves no data between threads. The arithmetic is
        # _int8_words': each byte ORed into the mantissa of 1.0 and one FMA per weight.
        # K is a whole number of blocks of 16.
        NB: gl.constexpr = 32 * NUM_WARPS  # blocks of 16 k per step: one per thread
        BLOCK_K: gl.constexpr = 16 * NB
        # weights [BLOCK_N, NB, 4] int32 words, x [NB, 4 (word), 4 (byte)]: a block of 16 k each
        L3: gl.constexpr = _gl_block_layouts(4, 4, 4, NUM_WARPS)[0]
        X3: gl.constexpr = _gl_block_layouts(4, 4, 4, NUM_WARPS)[1]
        LQ: gl.constexpr = gl.SliceLayout(2, L3)  # [BLOCK_N, NB]
        XB: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, X3))  # [NB]
        row0 = _gl_program(PDL) * BLOCK_N
        w_rows, rn3, rb3, rn = _gl_weight_rows(w_ptr, stride_wn, row0, BLOCK_N, 4, L3)
        n_ok = rn < N
        n_ok3 = rn3 < N
        x_in, xb3 = _gl_x_offsets(NB, 4, 4, X3)  # [NB, 4, 4]

        # The first EARLY steps' weights do not depend on the kernel before: they load before
        # the wait.
        w = gl.load(w_rows, mask=n_ok3 & (rb3 * 16 < K), other=0)
        if EARLY == 2:
            w_next = gl.load(w_rows + BLOCK_K // 4, mask=n_ok3 & (BLOCK_K + rb3 * 16 < K), other=0)
        if PDL:
            _gl_pdl_wait()
        if RESIDUAL:
            res = gl.load(r_ptr + rn, mask=n_ok, other=0).to(gl.float32)
        WL: gl.constexpr = _gl_split4(w)[0].type.layout  # a word of each row and block
        acc = gl.zeros([BLOCK_N, NB], gl.float32, WL)
        xs = gl.zeros([NB], gl.float32, XB)  # sum of x'
        ss = gl.zeros([NB], gl.float32, XB)
        for k0 in range(0, K, BLOCK_K):
            if EARLY == 1:  # the next step's weights, in flight while this one computes
                k1 = k0 + BLOCK_K
                w_next = gl.load(w_rows + k1 // 4, mask=n_ok3 & (k1 + rb3 * 16 < K), other=0)
            xv, ss = _gl_load_x(x_ptr, k0 + x_in, k0 + xb3 * 16 < K, nw_ptr, K, ss, NORM, GLU)
            xs += gl.sum(gl.sum(xv, axis=2), axis=1)
            # x' = x * 2^15 by byte, then by word: x_i[t] is k = 4t + i of the block
            x0, x1, x2, x3 = _gl_split4(xv * 32768.0)  # [NB, 4 (t)]
            x0 = _gl_split4(x0)
            x1 = _gl_split4(x1)
            x2 = _gl_split4(x2)
            x3 = _gl_split4(x3)
            w_t = _gl_split4(w)  # 4 x [BN, NB]
            XL: gl.constexpr = gl.SliceLayout(0, WL)
            for t in gl.static_range(4):
                v0, v1, v2, v3 = _gl_int8_floats(w_t[t])
                acc += v0 * gl.expand_dims(gl.convert_layout(x0[t], XL), 0)
                acc += v1 * gl.expand_dims(gl.convert_layout(x1[t], XL), 0)
                acc += v2 * gl.expand_dims(gl.convert_layout(x2[t], XL), 0)
                acc += v3 * gl.expand_dims(gl.convert_layout(x3[t], XL), 0)
            w = w_next
            if EARLY == 2:  # the step after next, into the registers this one freed
                k2 = k0 + 2 * BLOCK_K
                w_next = gl.load(w_rows + k2 // 4, mask=n_ok3 & (k2 + rb3 * 16 < K), other=0)
        # sum(v * x') = 2^15 sum(x) + sum((q + 128) x)
        acc = gl.convert_layout(acc, LQ, assert_trivial=True)
        out = gl.sum(acc, axis=1) - (32768.0 + 128.0) * gl.sum(xs, axis=0)  # [BN]
        out = out * gl.load(s_ptr + rn, mask=n_ok, other=0).to(gl.float32)
        if NORM:
            out = out * gl.rsqrt(gl.sum(ss, axis=0) / K + eps)
        if RESIDUAL:
            out += res
        gl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)

    @gluon.jit
    def _float_row_gluon(
        x_ptr, w_ptr, s_ptr, nw_ptr, r_ptr, y_ptr, N, K, eps, stride_wn,
        FP8: gl.constexpr, NORM: gl.constexpr, GLU: gl.constexpr, RESIDUAL: gl.constexpr,
        VEC: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, PDL: gl.constexpr,
        EARLY: gl.constexpr,
    ):  # fmt: skip
        # One row against float rows (bfloat16, float16, float32, or float8 bytes with per-row
        # scales), the layouts as in _int4_row_gluon: each thread owns one block of VEC k (16
        # bytes of each row) and the same VEC values of x, and keeps a float32 sum per row and
        # block (the block's products chained into FMAs; a sum per weight held 8 times the
        # registers and spilled at 16 rows offline), so the loop moves no data between threads.
        # K is a whole number of blocks.
        NB: gl.constexpr = 32 * NUM_WARPS  # blocks of VEC k per step: one per thread
        BLOCK_K: gl.constexpr = VEC * NB
        # weights [BLOCK_N, NB, VEC], x [NB, 2, VEC / 2] (3 dimensions for _gl_load_x)
        L3: gl.constexpr = _gl_block_layouts(VEC, 2, VEC // 2, NUM_WARPS)[0]
        X3: gl.constexpr = _gl_block_layouts(VEC, 2, VEC // 2, NUM_WARPS)[1]
        XB: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, X3))  # [NB]
        row0 = _gl_program(PDL) * BLOCK_N
        w_rows, rn3, rb3, rn = _gl_weight_rows(w_ptr, stride_wn, row0, BLOCK_N, VEC, L3)
        n_ok = rn < N
        n_ok3 = rn3 < N
        x_in, xb3 = _gl_x_offsets(NB, 2, VEC // 2, X3)  # [NB, 2, VEC / 2]

        # The first EARLY steps' weights do not depend on the kernel before: they load before
        # the wait.
        w = gl.load(w_rows, mask=n_ok3 & (rb3 * VEC < K), other=0)
        if EARLY == 2:
            w_next = gl.load(w_rows + BLOCK_K, mask=n_ok3 & (BLOCK_K + rb3 * VEC < K), other=0)
        if PDL:
            _gl_pdl_wait()
        if RESIDUAL:
            res = gl.load(r_ptr + rn, mask=n_ok, other=0).to(gl.float32)
        acc = gl.zeros([BLOCK_N, NB], gl.float32, gl.SliceLayout(2, L3))
        ss = gl.zeros([NB], gl.float32, XB)
        for k0 in range(0, K, BLOCK_K):
            if EARLY == 1:  # the next step's weights, in flight while this one computes
                k1 = k0 + BLOCK_K
                w_next = gl.load(w_rows + k1, mask=n_ok3 & (k1 + rb3 * VEC < K), other=0)
            xv, ss = _gl_load_x(x_ptr, k0 + x_in, k0 + xb3 * VEC < K, nw_ptr, K, ss, NORM, GLU)
            xv = gl.convert_layout(gl.reshape(xv, [NB, VEC]), gl.SliceLayout(0, L3))
            if FP8:
                w = w.to(gl.float8e4nv, bitcast=True)
            acc += gl.sum(w.to(gl.float32) * gl.expand_dims(xv, 0), axis=2)
            w = w_next
            if EARLY == 2:  # the step after next, into the registers this one freed
                k2 = k0 + 2 * BLOCK_K
                w_next = gl.load(w_rows + k2, mask=n_ok3 & (k2 + rb3 * VEC < K), other=0)
        out = gl.sum(acc, axis=1)  # [BN]
        if FP8:
            out = out * gl.load(s_ptr + rn, mask=n_ok, other=0).to(gl.float32)
        if NORM:
            out = out * gl.rsqrt(gl.sum(ss, axis=0) / K + eps)
        if RESIDUAL:
            out += res
        gl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)


def dependent_launch(x: Tensor) -> dict:
    # The launch arguments for _dependent_launch: on for CUDA devices of compute capability 9
    # and up, off in Triton's interpreter (which has no PTX).
    on = (
        x.device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


def gemv_config(fmt: int, M: int, N: int, K: int, groupsize: int = 0, experts: int = 0) -> dict:
    # Launch parameters by shape, from sweeps on an H200 (scripts/bench.py --sweep; rounds 10
    # and 12 in bench_results/h200_kernels_*round1[02]*.json) and decode A/B runs:
    # enough 16-byte loads in flight per SM and enough programs to cover its 132 SMs. experts:
    # the rows of an expert GEMV (each its own expert's weights, M is then 1), which multiply
    # the programs.
    if M > MAX_GEMV_ROWS:  # prefill of a quantized weight: GEMM tiles, an int4 one per group
        block_m = 64 if M > 32 else 32
        block_k = groupsize if fmt == INT4 else 64
        # Split K while the tiles alone leave SMs idle (a short prompt on a square weight).
        tiles, split = triton.cdiv(N, 64) * triton.cdiv(M, block_m), 1
        while tiles * split < 132 and K // (split * 2) >= 8 * block_k:
            split *= 2
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, SPLIT_K=split,
                    num_warps=4, num_stages=3)  # fmt: skip
    block_m = 1 if M == 1 else 16
    # STAGES: K steps the one-row loop loads ahead through shared memory (cp.async). Round 12's
    # decode A/B on the H200: 3 against a plain loop took Llama-2-7B int4 g32 from 494 to 536
    # tok/s and bf16 from 246 to 256; square weights and bf16's w2 were faster without it
    # alone (bench_results/h200_kernels_stages_round12_2026-12-04.json).
    stages = 3
    if fmt == INT8 and block_m == 1 and experts:  # the word path; Mixtral's: 95% and 78%
        if N > K:
            cfg, stages = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4), 4
        else:
            cfg = dict(BLOCK_N=16, BLOCK_K=1024, num_warps=4)
    elif fmt == INT8 and block_m == 1:
        # The word path, from round 10's and 12's sweeps on the Llama-2-7B and 3.1-8B shapes:
        # wqkv 80% (7B), w13 84%, w2 65%, the output layer 92% (L2 hits).
        if N < K:
            cfg, stages = dict(BLOCK_N=16, BLOCK_K=2048, num_warps=8), 1
        elif N == K:
            cfg, stages = dict(BLOCK_N=8, BLOCK_K=2048, num_warps=4), 1
        elif N >= 7 * K:
            cfg, stages = dict(BLOCK_N=32, BLOCK_K=512, num_warps=4), 1
        else:
            cfg = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4)
    elif fmt == INT4 and block_m == 1:  # the word path (dp4a)
        # Round 10's sweep (Llama-2-7B, Llama-3.1-8B and Mixtral expert shapes, with their
        # fusions): w2 4096x11008 12.1 us (56%) against 14.7 with 64 rows split 4 ways, Mixtral's
        # two w2 experts 30 against 51 us, wo g32 5.9 against 6.8 us, 8B's wqkv 7.6 against
        # 10.4 us, Mixtral's two w13 experts 43 against 50 us.
        if N < K:
            cfg = dict(BLOCK_N=16, BLOCK_K=2048, num_warps=8)
            stages = 3 if groupsize < 64 or experts else 1
        elif N == K:
            cfg = dict(BLOCK_N=8 if groupsize < 64 else 16, BLOCK_K=2048,
                       num_warps=4 if groupsize < 64 else 8)  # fmt: skip
            stages = 1
        elif experts:  # Mixtral's w13: 89% (78% with 8 rows x 2048, plain)
            cfg = dict(BLOCK_N=16, BLOCK_K=1024, num_warps=4)
        else:
            cfg = dict(BLOCK_N=16, BLOCK_K=2048 if N < 2 * K else 1024, num_warps=4)
            # The output layer: 89% plain, 85% pipelined. Groups of 128 have a quarter of the
            # scale loads and decode faster plain (Llama-3.1-8B g128: 531.5 against 514.8 tok/s).
            stages = 1 if N > 7 * K or groupsize >= 64 else 3
    elif fmt == INT4:
        cfg = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4)
    elif N <= 64 and block_m == 1:  # a router's few rows: one program reads the whole weight
        cfg, stages = dict(BLOCK_N=8, BLOCK_K=2048, num_warps=8), 1
    elif block_m == 1 and N < K:  # float weights; w2: 79% plain, 71% pipelined
        cfg, stages = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4), 1
    elif block_m == 1 and N == K:  # wo: 69% (59% with 8 rows, plain)
        cfg = dict(BLOCK_N=4, BLOCK_K=512, num_warps=4)
    elif block_m == 1 and N < 7 * K:  # wqkv, w13: 92% and 97% (85% and 88% plain)
        cfg = dict(BLOCK_N=16, BLOCK_K=256, num_warps=4)
    else:
        cfg = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4)
    if gluon is not None and block_m == 1 and not experts:
        gl = gluon_row_shape(fmt, N, K, groupsize)
        if gl:
            cfg["GLUON"] = gl
    cfg["num_stages"] = 3  # the row tiles' tl.dot pipelining
    if block_m > 1:
        cfg["BLOCK_N"] = max(cfg["BLOCK_N"], 16)
    else:
        cfg["STAGES"] = stages
    split = split_k(N, K, cfg["BLOCK_N"], cfg["BLOCK_K"], max(experts, 1))
    return dict(cfg, BLOCK_M=block_m, SPLIT_K=split)


def gluon_row_shape(fmt: int, N: int, K: int, groupsize: int = 0) -> tuple | None:
    # (rows per program, warps[, tiles[, early]]) of the one-row Gluon kernels on the shapes
    # where they beat Triton's launch, alone or in decode, or None for Triton.
    if fmt == INT4:
        # Round 18, on an H100: 7B wo 5.6 us against 6.1 (4 rows, 2 warps), w2 13.2 against
        # 14.0 (16, 4); 8B g128 wqkv 6.7 against 7.3 (8, 2), wo 5.2 against 5.9, w2 15.4
        # against 16.2. Round 20, on the H200: 7B g32 wqkv with x rounded once for 4 tiles of 8
        # rows, 10.0 us against 11.5. Round 26, decode on an H100: 7B g32 w13 on 8 tiles of 8
        # rows, 529.5 tok/s against 527.4 (alone, round 20's H200: 17.0 us against 17.5); 8B
        # g128 w13 (N = 7K) 483.6 against 515.7, so it and the output layers stay on Triton.
        # Round 27, with the group words, decode on an H100: still best as is (7B w2 on (8,
        # 4) 527.0 and (16, 8) 508.6 against 531.7; wqkv and w13 on 16-row tiles 507; 8B w13
        # on tiles 491.5 against 515.0).
        if N == K:
            return (4, 2)
        if N < K:
            return (16, 4)
        if N < 2 * K:
            return (8, 2)
        if K > 4096 or groupsize >= 64 or N >= 7 * K:
            return None
        return (8, 4, 4) if N < 4 * K else (8, 4, 8)
    if N <= 64:  # a router's few rows keep their one Triton program
        return None
    # Round 20, on the H200 (bench_results/h200_gluon_sweep_round20_*): int8 Llama-2-7B wo 6.7
    # us against 7.0, w13 25.4 against 26.4, w2 15.7 against 16.5, the output layer 31.8
    # against 33.7 (wqkv: 15.6 against 15.2); bfloat16 wo 11.0 against 11.7, w2 26.2
    # against 27.1 (8B: 32.9 against 34.0), wqkv 25.1 against 26.2 (8B: 14.4 against 15.1).
    # bfloat16 w13 and output layers were as fast on Triton. Round 26, decode on an H100: int8
    # 7B wqkv on Gluon too, 375.7 tok/s against 371.3, though alone it was slower.
    if fmt == INT8:
        return (8, 4)
    if fmt != FLOAT:
        return None
    if N == K:
        return (4, 2)
    if N < 2 * K:
        return (8, 4)
    return (8, 2) if N < 4 * K else None


def int4_group_words(scales: Tensor, zeros: Tensor | None) -> Tensor:
    # int4's group scales and offsets (bfloat16 [..., N, groups] each) -> int32 [..., N,
    # groups], a group's scale in the low half of its word and its offset in the high: the
    # kernels load both in one 32-bit load. GemvLinear and the expert stacks keep these words
    # (keep_int4_group_words) and pass them as scales (int32, zeros None); a separate pair is
    # interleaved here, a copy per call.
    if scales.dtype == torch.int32:
        return scales
    pairs = torch.stack((scales.to(torch.bfloat16), zeros.to(torch.bfloat16)), dim=-1)
    return pairs.view(torch.int32).squeeze(-1)


def int4_group_pairs(words: Tensor) -> tuple[Tensor, Tensor]:
    # int4_group_words' words -> (scales, zeros) bfloat16 [..., N, groups], views of them
    halves = words.view(torch.bfloat16)  # [..., N, 2 * groups]
    return halves[..., 0::2], halves[..., 1::2]


def split_k(N: int, K: int, block_n: int, block_k: int, rows: int = 1) -> int:
    # Split K only when the output is too narrow to give every SM a program: the atomics need
    # a zeroed float32 output and a cast, two more kernels, which cost more than a weight of
    # under a million elements takes to read (a router: 8x4096 bf16 with RMSNorm, 3.2 us in one
    # program against 4.6 split 4 ways). rows: independent rows sharing the grid (experts).
    if N * K < 1 << 20:
        return 1
    programs = triton.cdiv(N, block_n) * rows
    split = 1
    while programs * split < 132 and K // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def gemv(
    x: Tensor,
    weight: Tensor,
    fmt: int = FLOAT,
    scales: Tensor | None = None,
    zeros: Tensor | None = None,
    groupsize: int = 0,
    bias: Tensor | None = None,
    norm_weight: Tensor | None = None,
    eps: float = 1e-5,
    glu: bool = False,
    residual: Tensor | None = None,
    config: dict | None = None,
    expert_idx: Tensor | None = None,
    router_logits: Tensor | None = None,
    top_k: int = 0,
    mix: bool = False,
) -> Tensor:
    # y = prologue(x) @ W^T (+ bias) (+ residual), x [..., K] (or [..., 2K] with glu), any
    # number of rows -> y [..., N] in x's dtype. The prologue is RMSNorm with
    # norm_weight, or silu(x[..., :K]) * x[..., K:] with glu. expert_idx [M] (x [M / s, K], s a
    # whole number): W is a stack [E, N, K] of experts' weights and output row m [M, N] uses
    # expert expert_idx[m] on row m // s of x (Mixtral decode: a token's k experts, s = k).
    # router_logits [T, E] instead: the kernel routes as moe.route does, output row m [T * k,
    # N] through token m // k's (m % k)-th pick, k = top_k; with mix, x [T * k, K] (those rows'
    # inputs) and y [T, N] is each token's rows mixed by its routing weights (+ residual).
    # int4's scales and zeros may come as their group words (int4_group_words) in scales.
    args = (x, weight, fmt, scales, zeros, groupsize, bias, norm_weight, eps, glu, residual)
    if expert_idx is not None or router_logits is not None:
        args += (expert_idx, router_logits, top_k, mix)
    if config is not None and triton is not None:  # explicit launch: also Triton's interpreter
        return _gemv_launch(*args, config=config)
    if x.device.type != "cuda" or triton is None:
        return gemv_reference(*args)
    return torch.ops.fastgen.gemv(*args)


def _gemv_launch(
    x: Tensor,
    weight: Tensor,
    fmt: int,
    scales: Tensor | None,
    zeros: Tensor | None,
    groupsize: int,
    bias: Tensor | None,
    norm_weight: Tensor | None,
    eps: float,
    glu: bool,
    residual: Tensor | None,
    expert_idx: Tensor | None = None,
    router_logits: Tensor | None = None,
    top_k: int = 0,
    mix: bool = False,
    config: dict | None = None,
) -> Tensor:
    N = weight.shape[-2]
    K = weight.shape[-1] * (2 if fmt == INT4 else 1)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M = x2.shape[0]
    share, n_experts = 1, 0
    picks = expert_idx
    if router_logits is not None:
        picks = router_logits.contiguous()  # [T, E]
        T, n_experts = picks.shape
        if mix and M != T * top_k:
            raise ValueError("a mixing expert gemv takes top_k rows of x per token")
        share = T * top_k // M  # x: a row per token (w13), or per pick (w2, mix)
        M = T if mix else T * top_k  # output rows
    elif expert_idx is not None:
        share, M = expert_idx.shape[0] // M, expert_idx.shape[0]
    # Experts: one program row per output row, each a one-row GEMV against its own expert(s).
    experts = picks is not None
    if experts:
        cfg = dict(config or gemv_config(fmt, 1, N, K, groupsize, experts=M))
    else:
        cfg = dict(config or gemv_config(fmt, M, N, K, groupsize))
    # GLUON (rows, warps[, row tiles[, early K steps]]): a Gluon kernel instead, where one takes
    # the shape
    gl_cfg = cfg.pop("GLUON", None)
    if fmt == INT4:  # the group words [.., N, groups], interleaved here if they came as a pair
        scales, zeros = int4_group_words(scales, zeros), None
    if gl_cfg and M == 1 and not experts and bias is None:
        args = (x2, weight, fmt, scales, zeros, groupsize, norm_weight, eps, glu, residual)
        y = _gluon_row_launch(*args, *gl_cfg)
        if y is not None:
            return y.reshape(*x.shape[:-1], N)
    split_k = cfg["SPLIT_K"]
    if split_k > 1:
        y = torch.zeros(M, N, device=x.device, dtype=torch.float32)
    else:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    r2 = residual.reshape(M, N) if residual is not None else y
    if weight.dtype == torch.float8_e4m3fn:
        weight = weight.view(torch.uint8)
    aligned = (
        weight.shape[-1] % 4 == 0 and weight.stride(-1) == 1 and weight.storage_offset() % 4 == 0
    )
    words = cfg.pop("WORDS", None)
    # STAGES: how many K steps the loop keeps loading ahead (cp.async into shared memory);
    # a plain loop (1) for the row tiles, whose tl.dot loads Triton pipelines by num_stages.
    stages = cfg.pop("STAGES", 1 if cfg["BLOCK_M"] == 1 else cfg["num_stages"])
    if words is None:  # one row and a word-aligned quantized weight: the 32-bit-word path
        words = fmt in (INT8, INT4) and cfg["BLOCK_M"] == 1 and aligned
    if fmt == INT4 and cfg["BLOCK_M"] == 1 and not (words and aligned):
        # int4 rows of K/2 bytes, K a multiple of the group size (>= 32): always word-aligned
        raise ValueError("one-row int4 gemv needs a word-aligned weight and the word path")
    if fmt == INT4 and cfg["BLOCK_M"] == 1 and cfg["BLOCK_K"] % groupsize:
        raise ValueError("one-row int4 gemv needs BLOCK_K to be a whole number of groups")
    # 1: the word path in plain Triton; 2: with its PTX, which the interpreter cannot run
    words = int(words) * (1 if os.environ.get("TRITON_INTERPRET") == "1" else 2)
    if words:
        weight = weight.view(torch.int32)  # [N, K/4] for int8, [N, K/8] for int4
    # int4's group words are per group; int8's and fp8's scales per row need no stride
    stride_sn = scales.stride(-2) if fmt == INT4 else 0
    # int4 one-row: scales load in runs of SG groups, SG dividing a row's groups and a step's
    sg = 1
    if fmt == INT4 and words:
        sg = next(v for v in (8, 4, 2, 1) if (K // groupsize) % v == 0 and
                  (cfg["BLOCK_K"] // groupsize) % v == 0)  # fmt: skip
    tiles = M if experts else triton.cdiv(M, cfg["BLOCK_M"])
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split_k, tiles)
    _gemv_kernel[grid](
        x2, weight,
        scales if scales is not None else y,
        bias if bias is not None else y,
        norm_weight if norm_weight is not None else y,
        r2, y, picks if experts else y, 1 if experts else M, N, K, eps,
        x2.stride(0), weight.stride(-2), stride_sn,
        r2.stride(0), y.stride(0),
        weight.stride(0) if experts else 0,
        scales.stride(0) if experts and scales is not None else 0, share, n_experts,
        EXPERTS=experts, TOPK=top_k if n_experts else 0,
        E_P2=max(2, triton.next_power_of_2(n_experts)), MIX=mix, FMT=fmt,
        G=max(groupsize, 2), SG=sg, HAS_BIAS=bias is not None,
        NORM=norm_weight is not None, GLU=glu, RESIDUAL=residual is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WORDS=words,
        STAGES=stages, **cfg, **dependent_launch(x),
    )  # fmt: skip
    if experts:
        return y.to(x.dtype)  # [M, N]
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def _gluon_row_launch(
    x: Tensor,
    weight: Tensor,
    fmt: int,
    scales: Tensor | None,
    zeros: Tensor | None,
    groupsize: int,
    norm_weight: Tensor | None,
    eps: float,
    glu: bool,
    residual: Tensor | None,
    block_n: int,
    warps: int,
    tiles: int = 1,
    early: int = 1,
) -> Tensor | None:
    # One row x [1, K] on a Gluon kernel, block_n rows and `warps` warps per program -> y [1,
    # N] (int4 with K <= 1024 * warps: `tiles` tiles of block_n rows per program; otherwise
    # the first `early` K steps, 1 or 2, load before the wait on the kernel before), or None
    # where none takes it: Gluon missing, not CUDA, Triton's interpreter (it has no Gluon), or
    # weights not in whole 16-byte blocks of the row (int8 and float: K a multiple of the
    # block, rows contiguous and 16-byte aligned).
    if gluon is None or x.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    N, row_bytes = weight.shape[-2], weight.shape[-1] * weight.element_size()
    K = x.shape[-1] // (2 if glu else 1)
    if fmt != INT4 and not (
        row_bytes % 16 == 0 and weight.stride(-1) == 1
        and (weight.stride(-2) * weight.element_size()) % 16 == 0 and weight.data_ptr() % 16 == 0
    ):  # fmt: skip
        return None
    y = torch.empty(1, N, device=x.device, dtype=x.dtype)
    fused = dict(NORM=norm_weight is not None, GLU=glu, RESIDUAL=residual is not None)
    fused.update(BLOCK_N=block_n, NUM_WARPS=warps, num_warps=warps, **dependent_launch(x))
    nw = norm_weight if norm_weight is not None else y
    r = residual.reshape(1, N) if residual is not None else y
    grid = (triton.cdiv(N, block_n),)
    row = dict(EARLY=early, **fused)
    if fmt == INT4:  # scales: the group words (_gemv_launch interleaves them)
        w = weight.view(torch.int32)
        args = (x, w, scales, nw, r, y, N, K, eps, w.stride(-2), scales.stride(-2))
    if fmt == INT4 and tiles > 1 and K <= 1024 * warps:
        _int4_rows_gluon[(triton.cdiv(N, block_n * tiles),)](
            *args, G=groupsize, TILES=tiles, **fused
        )  # fmt: skip
    elif fmt == INT4:
        _int4_row_gluon[grid](*args, G=groupsize, **row)
    elif fmt == INT8:
        w = weight.view(torch.int32)
        _int8_row_gluon[grid](x, w, scales, nw, r, y, N, K, eps, w.stride(-2), **row)
    else:  # float, or float8 as its bytes with row scales
        w = weight.view(torch.uint8) if fmt == FP8 else weight
        vec = 16 // w.element_size()
        s = scales if fmt == FP8 else y
        _float_row_gluon[grid](
            x, w, s, nw, r, y, N, K, eps, w.stride(-2), FP8=fmt == FP8, VEC=vec, **row
        )  # fmt: skip
    return y


if triton is not None:
    # An opaque op for torch.compile: traced through its fake, launched as is under CUDA graphs.
    @torch.library.custom_op("fastgen::gemv", mutates_args=())
    def _gemv_op(
        x: Tensor,
        weight: Tensor,
        fmt: int,
        scales: Tensor | None,
        zeros: Tensor | None,
        groupsize: int,
        bias: Tensor | None,
        norm_weight: Tensor | None,
        eps: float,
        glu: bool,
        residual: Tensor | None,
        expert_idx: Tensor | None = None,
        router_logits: Tensor | None = None,
        top_k: int = 0,
        mix: bool = False,
    ) -> Tensor:
        return _gemv_launch(
            x, weight, fmt, scales, zeros, groupsize, bias, norm_weight, eps, glu, residual,
            expert_idx, router_logits, top_k, mix,
        )  # fmt: skip

    @_gemv_op.register_fake
    def _gemv_fake(
        x, weight, fmt, scales, zeros, groupsize, bias, norm_weight, eps, glu, residual,
        expert_idx=None, router_logits=None, top_k=0, mix=False,
    ):  # fmt: skip
        if router_logits is not None:
            T = router_logits.shape[0]
            return x.new_empty(T if mix else T * top_k, weight.shape[-2])
        if expert_idx is not None:
            return x.new_empty(expert_idx.shape[0], weight.shape[-2])
        return x.new_empty(*x.shape[:-1], weight.shape[-2])


# ---------------------------------------------------------------------------------------------
# Decode attention (flash-decoding)
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rope_pairs(x_ptr, off, mask, cos, sin):
        # Rotary embedding of interleaved pairs (x[2i], x[2i+1]) by the angles (cos, sin) [D/2];
        # off [.., D/2] points at the even elements. -> the rotated values, pairs joined back in
        # order [.., D/2, 2], float32.
        x_e = tl.load(x_ptr + off, mask=mask, other=0).to(tl.float32)
        x_o = tl.load(x_ptr + off + 1, mask=mask, other=0).to(tl.float32)
        return tl.join(x_e * cos - x_o * sin, x_o * cos + x_e * sin)

    @triton.jit
    def _kv_block(k_ptr, v_ptr, kv_base, s0, cache_end, stride_ks, rd, BLOCK_S: tl.constexpr):
        # Keys and values of slots s0 .. s0 + BS - 1 [BS, D], zero past cache_end (a masked
        # slot reads nothing), and which slots are filled [BS]
        rs = s0 + tl.arange(0, BLOCK_S)
        s_ok = rs < cache_end
        kv_off = kv_base + rs[:, None] * stride_ks + rd[None, :]
        k = tl.load(k_ptr + kv_off, mask=s_ok[:, None], other=0)
        v = tl.load(v_ptr + kv_off, mask=s_ok[:, None], other=0)
        return k, v, s_ok

    @triton.jit
    def _attend_rows(q, k, v, s_ok, m, l_sum, acc, sm_scale):
        # One block of slots for one query head, each row its own online softmax: q [1, D]
        # float32, k, v [BS, D], s_ok [BS] -> the rows' running max m [BS], sum l_sum [BS] and
        # unnormalised output acc [BS, D], all in k's layout. A row that has seen no slot keeps
        # m = -inf.
        scores = tl.sum(q * k.to(tl.float32), axis=1) * sm_scale  # [BS]
        scores = tl.where(s_ok, scores, -float("inf"))
        m_new = tl.maximum(m, scores)
        m_ref = tl.where(m_new > -float("inf"), m_new, 0.0)  # no -inf - -inf: exp(-inf) = 0
        alpha = tl.exp(m - m_ref)
        p = tl.exp(scores - m_ref)
        l_sum = l_sum * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
        return m_new, l_sum, acc

    @triton.jit
    def _l2_prefetch_kv(k_addr, v_addr, nbytes):
        # One thread asks L2 for nbytes (a multiple of 16, nothing when <= 0) from each of two
        # 16-byte aligned addresses (Hopper's bulk prefetch: no registers held, no wait).
        tl.inline_asm_elementwise(
            """{
            .reg .pred skip;
            .reg .b32 t;
            mov.u32 t, %tid.x;
            setp.lt.s32 skip, $3, 16;
            setp.ne.or.u32 skip, t, 0, skip;
            @!skip cp.async.bulk.prefetch.L2.global [$1], $3;
            @!skip cp.async.bulk.prefetch.L2.global [$2], $3;
            mov.u32 $0, 0;
            }""",
            "=r,l,l,r",
            [k_addr.to(tl.int64, bitcast=True), v_addr.to(tl.int64, bitcast=True), nbytes],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _attend_block(q, k, v, s_ok, m, l_sum, acc, sm_scale, DOT_PRECISION: tl.constexpr):
        # Online softmax over one block of slots: q [GP, D], k, v [BS, D], s_ok [BS] (at least
        # one true) -> the running max m [GP], sum l_sum [GP] and unnormalised output acc [GP, D]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [GP, BS]
        scores = tl.where(s_ok[None, :], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_sum, acc

    @triton.jit
    def _attn_split_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, ml_ptr, sm_scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
        out_ptr, H_KV, N_SPLIT, f_ptr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
        CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, DIRECT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, QKV: tl.constexpr, PDL: tl.constexpr,
        PREFETCH: tl.constexpr, AHEAD: tl.constexpr, STREAMS: tl.constexpr,
    ):  # fmt: skip
        # QKV: q_ptr is the new token's fused projection [B, (H + 2 H_KV) * D] before rotary
        # embedding. The kernel rotates q and the new key by row input_pos of the rotary table
        # f_ptr [S, D/2, 2], writes key and value to the cache slot input_pos, and attends to
        # that slot from registers (the split holding it).
        # Otherwise q [B, H, 1, D] is rotated already and the cache holds the new token.
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if PDL and not QKV:  # the kernel before wrote q and this step's cache slot
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)  # over batch x kv heads (STREAMS: x query heads per kv head)
        split = tl.program_id(1)
        if STREAMS:  # one query head a program, q row hk * GROUP + g0; the group's programs
            b = pid // (H_KV * GROUP)  # read the same keys and values (once from memory,
            hk = (pid // GROUP) % H_KV  # then from L2)
            g0 = pid % GROUP
        else:  # the kv head's GROUP query heads, rows hk * GROUP + 0..GROUP-1
            b = pid // H_KV
            hk = pid % H_KV
            g0 = 0
        pos = tl.load(pos_ptr)
        length = pos + 1  # slots 0..input_pos are filled
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, length)
        rg = tl.arange(0, GROUP_PAD)
        rd = tl.arange(0, D)
        g_ok = rg < (1 if STREAMS else GROUP)
        q_head = hk * GROUP + g0  # the program's first query head
        dt = k_ptr.dtype.element_ty
        kv_base = b * stride_kb + hk * stride_kh
        # The first block of cached keys and values [BS, D]. With QKV it loads before the wait
        # on wqkv: slots before pos, the position and the rotary angles were written by earlier
        # steps or by Inductor's kernels, which launch without PDL, so they had finished before
        # any later kernel started (a step begins with one). Only wqkv's output comes from the
        # dependent chain. Without QKV the wait came first: slot pos is the kernel before's.
        # Round 21, decode A/B on an H100: Llama-2-7B int8 347 -> 357 tok/s, int4 g32 485 ->
        # 500, bf16 196 -> 199; Llama-3.1-8B int4 g128 483 -> 502. First block of 128 slots: 494.
        cache_end = tl.minimum(end, pos) if QKV else end  # QKV: slot pos holds a stale key
        if PREFETCH:  # the filled slots after the first block, to L2 while wqkv still runs
            rest = kv_base + (start + BLOCK_S) * stride_ks
            elt: tl.constexpr = k_ptr.dtype.element_ty.primitive_bitwidth // 8
            nbytes = (cache_end - start - BLOCK_S) * stride_ks * elt
            _l2_prefetch_kv(k_ptr + rest, v_ptr + rest, nbytes)
        k_first, v_first, ok1 = _kv_block(k_ptr, v_ptr, kv_base, start, cache_end, stride_ks, rd,
                                          BLOCK_S)  # fmt: skip
        if QKV:
            ri = tl.arange(0, D // 2)
            f_ptr += pos * D  # unpadded rows: the rotary position is the slot
            cos = tl.load(f_ptr + 2 * ri).to(tl.float32)  # [D/2]
            sin = tl.load(f_ptr + 2 * ri + 1).to(tl.float32)
            if PDL:
                tl.extra.cuda.gdc_wait()
            q_row = q_ptr + b * stride_qb
            q_off = (q_head + rg)[:, None] * D + 2 * ri[None, :]  # [GP, D/2]
            q = tl.reshape(_rope_pairs(q_row, q_off, g_ok[:, None], cos, sin), [GROUP_PAD, D])
            q = q.to(dt)  # rounded as the unfused path stores it
            # the new key and value: rotated, written to the cache, kept for its own slot
            k_new = tl.reshape(_rope_pairs(q_row, (H_KV * GROUP + hk) * D + 2 * ri, ri < D // 2,
                                           cos, sin), [D]).to(dt)  # fmt: skip
            v_new = tl.load(q_row + (H_KV * (GROUP + 1) + hk) * D + rd)
        else:
            q_off = b * stride_qb + (q_head + rg)[:, None] * stride_qh + rd[None, :]
            q = tl.load(q_ptr + q_off, mask=g_ok[:, None], other=0)  # [GP, D]
        m = tl.full([GROUP_PAD], -float("inf"), dtype=tl.float32)
        l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D], dtype=tl.float32)
        if AHEAD or STREAMS:
            # Each step loads the next block before it attends to the one loaded a step ago, so
            # a load's latency hides behind a block's softmax instead of adding to it. The
            # last step loads a block past cache_end: masked, it reads nothing.
            k_cur, v_cur, ok_cur = k_first, v_first, ok1
            if STREAMS:
                # The program's one query head: each of a block's BS rows is an online softmax
                # of its own over slots r, r + BS, ...; m, l [BS] and acc [BS, D] change
                # elementwise in the loop, and the rows merge once after it (no reduction
                # across warps per block, no tl.dot padded to 16 rows).
                q_f = q.to(tl.float32)  # [1, D]
                m_r = tl.full([BLOCK_S], -float("inf"), dtype=tl.float32)
                l_r = tl.zeros([BLOCK_S], dtype=tl.float32)
                acc_r = tl.zeros([BLOCK_S, D], dtype=tl.float32)
            for s0 in range(start + BLOCK_S, cache_end + BLOCK_S, BLOCK_S):
                k, v, s_ok = _kv_block(k_ptr, v_ptr, kv_base, s0, cache_end, stride_ks, rd, BLOCK_S)
                if STREAMS:
                    m_r, l_r, acc_r = _attend_rows(q_f, k_cur, v_cur, ok_cur, m_r, l_r, acc_r,
                                                   sm_scale)  # fmt: skip
                else:
                    m, l_sum, acc = _attend_block(q, k_cur, v_cur, ok_cur, m, l_sum, acc,
                                                  sm_scale, DOT_PRECISION)  # fmt: skip
                k_cur, v_cur, ok_cur = k, v, s_ok
            if STREAMS:
                m = tl.max(m_r[None, :], axis=1)  # [1]
                m_ref = tl.where(m > -float("inf"), m, 0.0)
                w = tl.exp(m_r[None, :] - m_ref[:, None])  # [1, BS], 0 for a row that saw no slot
                l_sum = tl.sum(l_r[None, :] * w, axis=1)  # [1]
                acc = tl.sum(acc_r * tl.reshape(w, [BLOCK_S, 1]), axis=0)[None, :]  # [1, D]
        else:
            if start < cache_end:
                m, l_sum, acc = _attend_block(q, k_first, v_first, ok1, m, l_sum, acc, sm_scale,
                                              DOT_PRECISION)  # fmt: skip
            for s0 in range(start + BLOCK_S, cache_end, BLOCK_S):
                k, v, s_ok = _kv_block(k_ptr, v_ptr, kv_base, s0, cache_end, stride_ks, rd, BLOCK_S)
                m, l_sum, acc = _attend_block(q, k, v, s_ok, m, l_sum, acc, sm_scale,
                                              DOT_PRECISION)  # fmt: skip
        if QKV and (start <= pos) & (pos < end):  # this split holds the new token's slot
            w_ok = None
            if STREAMS:  # one program of the kv head writes its cache slot
                w_ok = rd < tl.where(g0 == 0, D, 0)
            tl.store(k_ptr + kv_base + pos * stride_ks + rd, k_new, mask=w_ok)
            tl.store(v_ptr + kv_base + pos * stride_ks + rd, v_new, mask=w_ok)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * sm_scale
            m_new = tl.maximum(m, s_new)  # [GP]
            alpha = tl.exp(m - m_new)
            p_new = tl.exp(s_new - m_new)
            l_sum = l_sum * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m = m_new
        if DIRECT:  # one split covers the cache: normalise and write the output [B, H, D]
            o_row = pid if STREAMS else pid * GROUP  # b * H + the first query head
            o_off = (o_row + rg)[:, None] * D + rd[None, :]
            out = acc / l_sum[:, None]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
            return
        # Partials: acc [programs, N_SPLIT, GP, D] unnormalised, (m, l) [programs, N_SPLIT, GP,
        # 2]; programs B * H_KV (STREAMS: B * H, GP 1).
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
    # Sequence slots per program: a cache of up to 1024 slots gets one program per kv head
    # (and no combine step), longer ones up to 64 programs per kv head.
    if max_seq_len <= 1024:
        return triton.next_power_of_2(max_seq_len)
    return max(256, min(512, triton.next_power_of_2(triton.cdiv(max_seq_len, 64))))


def _decode_attention_launch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    input_pos: Tensor,
    freqs_cis: Tensor | None = None,
    n_head: int = 0,
    config: dict | None = None,
) -> Tensor:
    # q [B, H, 1, D] rotated, the cache written -> [B, H, 1, D]. With the rotary table
    # freqs_cis [S, D/2, 2]: q is the fused projection [B, 1, (n_head + 2 H_kv) * D] as wqkv
    # gives it, rotated by the table's row input_pos and written to the cache here
    # -> [B, 1, n_head * D], as Attention.attend_qkv returns for unpadded rows.
    # config: launch parameters (CHUNK, BLOCK_S, num_warps, num_stages) in place of the
    # defaults, as scripts/bench.py --sweep tries them.
    qkv = freqs_cis is not None
    H_kv, S, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    B, H = q.shape[0], n_head if qkv else q.shape[1]
    group = H // H_kv
    cfg = dict(CHUNK=attention_chunk(S), num_warps=4, num_stages=2, PREFETCH=False, AHEAD=False,
               STREAMS=False) | (config or {})  # fmt: skip
    # tl.dot takes at least 16 rows; STREAMS has no dot and one query head a program
    group_pad = 1 if cfg["STREAMS"] else max(16, triton.next_power_of_2(group))
    programs = B * H if cfg["STREAMS"] else B * H_kv  # each with group_pad rows of q
    launch = dependent_launch(q)
    cfg["PREFETCH"] = cfg["PREFETCH"] and launch["PDL"]  # PTX of sm_90 and up
    chunk = cfg.pop("CHUNK")
    cfg.setdefault("BLOCK_S", min(64, chunk))
    n_split = triton.cdiv(S, chunk)
    direct = n_split == 1
    shape = (programs, n_split, group_pad) if not direct else (1, 1, 1)
    acc = torch.empty(*shape, D, device=q.device, dtype=torch.float32)
    ml = torch.empty(*shape, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, 1, D, device=q.device, dtype=q.dtype)
    q = q.contiguous()
    f = freqs_cis.contiguous() if qkv else out
    _attn_split_kernel[(programs, n_split)](
        q, k_cache, v_cache, input_pos, acc, ml, D**-0.5,
        q.stride(0), 0 if qkv else q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out, H_kv, n_split, f,
        GROUP=group, GROUP_PAD=group_pad, D=D, CHUNK=chunk, DIRECT=direct,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QKV=qkv,
        **cfg, **launch,
    )  # fmt: skip
    if not direct:
        _attn_combine_kernel[(B * H,)](
            acc, ml, out, n_split,
            GROUP=B * H // programs, GROUP_PAD=group_pad, D=D,  # query heads a program
            SPLIT_PAD=triton.next_power_of_2(n_split),
        )  # fmt: skip
    return out.view(B, 1, H * D) if qkv else out


if triton is not None:

    @torch.library.custom_op("fastgen::decode_attention", mutates_args=())
    def _decode_attention_op(
        q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor
    ) -> Tensor:
        return _decode_attention_launch(q, k_cache, v_cache, input_pos)

    @_decode_attention_op.register_fake
    def _decode_attention_fake(q, k_cache, v_cache, input_pos):
        return torch.empty_like(q)


if triton is not None:

    @torch.library.custom_op("fastgen::decode_attention_qkv", mutates_args=("k_cache", "v_cache"))
    def _decode_attention_qkv_op(
        qkv: Tensor,
        freqs_cis: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        input_pos: Tensor,
        n_head: int,
    ) -> Tensor:
        return _decode_attention_launch(qkv, k_cache, v_cache, input_pos, freqs_cis, n_head)

    @_decode_attention_qkv_op.register_fake
    def _decode_attention_qkv_fake(qkv, freqs_cis, k_cache, v_cache, input_pos, n_head):
        return qkv.new_empty(qkv.shape[0], 1, n_head * k_cache.shape[-1])


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor) -> Tensor:
    if q.device.type != "cuda" or triton is None:
        return decode_attention_reference(q, k_cache, v_cache, input_pos)
    return torch.ops.fastgen.decode_attention(q, k_cache, v_cache, input_pos)


def takes_decode_attention(q_len: int, mask: Tensor | None, head_dim: int) -> bool:
    # The split kernel's case: one new token without padding (a [T, S] mask, not [B, 1, T, S]),
    # a head size its tiles take.
    return q_len == 1 and mask is not None and mask.dim() == 2 and head_dim in (64, 128, 256)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
    # model.Attention's `attend` hook: the split kernel for one new token without padding,
    # SDPA for prefill and padded batches.
    if takes_decode_attention(q.shape[2], mask, q.shape[-1]):
        return decode_attention(q, k, v, input_pos)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


# ---------------------------------------------------------------------------------------------
# Top-k sampling
# ---------------------------------------------------------------------------------------------
# One token per row of logits [B, V], drawn from softmax(logits / T) over the top_k largest
# logits and any tied with the k-th (generate.logits_to_probs's rule), in two kernels where
# torch.topk's radix select took about 20 kernels and 45 us of a Llama-2-7B step (H200):
#   1. each chunk's maximum, the row cut into at least top_k chunks. The smallest of them, t0,
#      has at least top_k values >= it (one per chunk), so the k-th largest value is >= t0:
#      every token that can be drawn is >= t0, and few others are (~1500 of 32k or 128k random
#      normal logits at top_k 200).
#   2. programs over the row append their values >= t0 to a candidate list; the last one to
#      finish finds the k-th largest candidate by bisection over the values' bits, then draws
#      among the candidates >= it by the Gumbel-max trick: argmax(v / T + g), g = -log(-log(u)),
#      u uniform from Philox keyed by the row's seed and the token's index. Given the step's
#      position, the seed is Philox's draw at that position from the row's seed: one seed per
#      row for a whole generation, and no random-number kernels (nor CUDA graph RNG updates)
#      in each step.
TOP_K_MAX = 256  # larger top_k: generate.sample's PyTorch path (the filter keeps too many)
TOP_K_CAP = 4096  # candidates the last program holds in registers; the rest it reads in tiles


def top_k_chunk(V: int, top_k: int) -> int:
    # a power of two, at most 4096, that cuts V into at least top_k chunks (top_k <= V)
    return min(4096, 1 << ((V // top_k).bit_length() - 1))


if triton is not None:

    @triton.jit
    def _order_key(v, SHIFT: tl.constexpr):
        # float32 -> int32 of the same order (NaN aside; -0.0 made +0.0, as they compare equal).
        # SHIFT: the mantissa bits the values never use (16 for bfloat16 values), dropped: still
        # one key per value, and the sampler's bisection over keys takes that many fewer steps.
        b = tl.where(v == 0, 0.0, v).to(tl.int32, bitcast=True)
        return (b ^ ((b >> 31) & 0x7FFFFFFF)) >> SHIFT

    @triton.jit
    def _chunk_max_kernel(
        x_ptr, m_ptr, cnt_ptr, V, n_chunks, stride_x, CHUNK: tl.constexpr, CHUNKS: tl.constexpr
    ):
        # x [B, V] -> m [B, n_chunks], each CHUNK-long chunk's maximum; zeroes the row's two
        # counters (candidates, programs finished) for the kernel after.
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * CHUNKS + tl.arange(0, CHUNKS)  # [CHUNKS] chunk numbers
        off = c[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        x = tl.load(x_ptr + row * stride_x + off, mask=off < V, other=float("-inf"))
        tl.store(m_ptr + row * n_chunks + c, tl.max(x.to(tl.float32), axis=1), mask=c < n_chunks)
        if tl.program_id(1) == 0:
            tl.store(cnt_ptr + 2 * row + tl.arange(0, 2), tl.zeros([2], dtype=tl.int32))

    @triton.jit
    def _gumbel_race(v, i, keep, seed, temperature):
        # candidates v [n] at tokens i [n], keep [n] -> (best score, its token): the largest
        # v / T + Gumbel noise among the kept (lowest token on an exact tie)
        g = -tl.log(-tl.log(tl.rand(seed, i)))  # u = 0: g = -inf, never drawn
        s = tl.where(keep, v / temperature + g, float("-inf"))
        best = tl.max(s, axis=0)
        return best, tl.min(tl.where(s == best, i, 2147483647), axis=0)

    @triton.jit
    def _top_k_sample_kernel(
        x_ptr, m_ptr, cnt_ptr, cv_ptr, ci_ptr, seed_ptr, pos_ptr, out_ptr, V, n_chunks, stride_x,
        top_k, temperature, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr, CAP: tl.constexpr,
        AT_POS: tl.constexpr,
    ):  # fmt: skip
        # x [B, V]; m [B, n_chunks] chunk maxima; cnt [B, 2] zeroed; cv, ci [B, V] room for the
        # candidates' values and tokens; seed [B]; pos [1] the step's position when AT_POS
        # -> out [B, 1] the drawn tokens
        row = tl.program_id(0).to(tl.int64)  # row * V passes 2^31 for many rows of a big vocab
        x_ptr += row * stride_x
        cv_ptr += row * V
        ci_ptr += row * V
        c = tl.arange(0, CHUNKS_PAD)
        m = tl.load(m_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("nan"))
        t0 = tl.min(tl.where(c < n_chunks, m, float("inf")), axis=0)
        off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + off, mask=off < V, other=float("-inf")).to(tl.float32)
        keep = ((off < V) & (v >= t0)).to(tl.int32)
        first = tl.atomic_add(cnt_ptr + 2 * row, tl.sum(keep, axis=0), sem="relaxed")
        slot = first + tl.cumsum(keep, axis=0) - 1
        tl.store(cv_ptr + slot, v, mask=keep != 0)
        tl.store(ci_ptr + slot, off, mask=keep != 0)
        # Every thread's stores, then one thread's release (CUTLASS's semaphore pattern): the
        # program that counts last sees all the candidates.
        tl.debug_barrier()
        finished = tl.atomic_add(cnt_ptr + 2 * row + 1, 1, sem="acq_rel")
        if finished == tl.num_programs(1) - 1:
            # the logits' unused mantissa bits (the float32 candidates hold them exactly): 16
            # for bfloat16, and up to as many fewer bisection steps
            SHIFT: tl.constexpr = 23 - x_ptr.dtype.element_ty.fp_mantissa_width
            n = tl.atomic_add(cnt_ptr + 2 * row, 0, sem="acquire")  # candidates, >= top_k
            seed = tl.load(seed_ptr + row).to(tl.int32)  # int64 seeds below 2^31
            if AT_POS:
                seed = tl.randint(seed, tl.load(pos_ptr).to(tl.int32)).to(tl.int32, bitcast=True)
            r = tl.arange(0, CAP)
            ok = r < n
            # the first CAP candidates stay in registers; any more load again in each pass
            cand = tl.load(cv_ptr + r, mask=ok, other=float("-inf"), cache_modifier=".cg")
            key = _order_key(cand, SHIFT)
            # the k-th largest key: the largest t with at least top_k keys >= t
            lo = _order_key(t0, SHIFT).to(tl.int64)
            hi = _order_key(tl.max(tl.where(c < n_chunks, m, float("-inf")), axis=0), SHIFT)
            hi = hi.to(tl.int64)
            while lo < hi:
                mid = lo + (hi - lo + 1) // 2
                count = tl.sum((ok & (key >= mid)).to(tl.int32), axis=0)
                for start in range(CAP, n, CAP):
                    rs = start + r
                    more = tl.load(cv_ptr + rs, mask=rs < n, other=float("-inf"),
                                   cache_modifier=".cg")  # fmt: skip
                    count += tl.sum(
                        ((rs < n) & (_order_key(more, SHIFT) >= mid)).to(tl.int32), axis=0
                    )
                lo = tl.where(count >= top_k, mid, lo)
                hi = tl.where(count >= top_k, hi, mid - 1)
            tok = tl.load(ci_ptr + r, mask=ok, other=0, cache_modifier=".cg")
            best, token = _gumbel_race(cand, tok, ok & (key >= lo), seed, temperature)
            for start in range(CAP, n, CAP):
                rt = start + r
                tv = tl.load(cv_ptr + rt, mask=rt < n, other=float("-inf"), cache_modifier=".cg")
                ti = tl.load(ci_ptr + rt, mask=rt < n, other=0, cache_modifier=".cg")
                s, t = _gumbel_race(
                    tv, ti, (rt < n) & (_order_key(tv, SHIFT) >= lo), seed, temperature
                )
                token = tl.where(s > best, t, token)
                best = tl.maximum(s, best)
            tl.store(out_ptr + row, token.to(tl.int64))


def _sample_top_k_launch(
    logits: Tensor, seeds: Tensor, pos: Tensor | None, temperature: float, top_k: int,
    block=4096, cap=TOP_K_CAP,
) -> Tensor:  # fmt: skip
    # logits [B, V] (any float dtype, rows may be strided), seeds [B] below 2^31, pos None or
    # [1] the step's position (int64) -> tokens [B, 1]. block: values per program of the second
    # kernel; cap: TOP_K_CAP (tests make both small).
    B, V = logits.shape
    chunk = top_k_chunk(V, top_k)
    n_chunks = triton.cdiv(V, chunk)
    per_program = max(1, 4096 // chunk)  # chunks per program of the first kernel
    dev = logits.device
    m = torch.empty(B, n_chunks, device=dev, dtype=torch.float32)
    counters = torch.empty(B, 2, device=dev, dtype=torch.int32)
    cand_v = torch.empty(B, V, device=dev, dtype=torch.float32)
    cand_i = torch.empty(B, V, device=dev, dtype=torch.int32)
    out = torch.empty(B, 1, device=dev, dtype=torch.int64)
    _chunk_max_kernel[(B, triton.cdiv(n_chunks, per_program))](
        logits, m, counters, V, n_chunks, logits.stride(0), CHUNK=chunk, CHUNKS=per_program
    )
    _top_k_sample_kernel[(B, triton.cdiv(V, block))](
        logits, m, counters, cand_v, cand_i, seeds, seeds if pos is None else pos, out, V,
        n_chunks, logits.stride(0), top_k, temperature, BLOCK=block,
        CHUNKS_PAD=triton.next_power_of_2(n_chunks), CAP=cap, AT_POS=pos is not None, num_warps=8,
    )  # fmt: skip
    return out


if triton is not None:

    @torch.library.custom_op("fastgen::sample_top_k", mutates_args=())
    def _sample_top_k_op(
        logits: Tensor, seeds: Tensor, pos: Tensor | None, temperature: float, top_k: int
    ) -> Tensor:
        return _sample_top_k_launch(logits, seeds, pos, temperature, top_k)

    @_sample_top_k_op.register_fake
    def _sample_top_k_fake(logits, seeds, pos, temperature, top_k):
        return logits.new_empty(logits.shape[0], 1, dtype=torch.int64)


def samples_top_k(logits: Tensor, top_k: int | None) -> bool:
    # sample_top_k's case: CUDA logits [B, V], 1 <= top_k <= TOP_K_MAX and below V
    return (
        triton is not None and logits.is_cuda and top_k is not None
        and 1 <= top_k <= min(TOP_K_MAX, logits.shape[-1] - 1)
    )  # fmt: skip


def sample_top_k(
    logits: Tensor, temperature: float, top_k: int, seed: Tensor | None = None,
    pos: Tensor | None = None,
) -> Tensor:  # fmt: skip
    # logits [B, V], temperature > 0 -> tokens [B, 1]. The draw is keyed by seed [B] (int64
    # below 2^31; fresh from torch's generator when None) and, when given, pos [1]: the step's
    # position.
    if seed is None:
        seed = torch.randint(1 << 31, (logits.shape[0],), device=logits.device)
    return torch.ops.fastgen.sample_top_k(logits, seed, pos, temperature, top_k)


# ---------------------------------------------------------------------------------------------
# Putting them into a model
# ---------------------------------------------------------------------------------------------


def keep_int4_group_words(module: nn.Module, owner: nn.Module | None = None) -> None:
    # Interleaves an int4 module's scales and zeros into group words (int4_group_words), keeps
    # them as views of the words (the pair's memory, held once) and registers the words as the
    # non-persistent buffer group_words of owner (default: the module): a buffer, so that
    # compiled graphs read it in place. state_dict() is unchanged.
    words = int4_group_words(module.scales, module.zeros)
    module.scales, module.zeros = int4_group_pairs(words)
    (owner or module).register_buffer("group_words", words, persistent=False)


def gemv_scales(module: nn.Module) -> tuple:
    # (scales, zeros) as gemv takes them from a linear or an expert stack: an int4 one's group
    # words (keep_int4_group_words), read in place, or its own tensors (None where it has none)
    words = getattr(module, "group_words", None)
    if words is not None:
        return words, None
    return getattr(module, "scales", None), getattr(module, "zeros", None)


class GemvLinear(nn.Module):
    # Stands in for nn.Linear or one of quantize.py's linears, with the same tensors under the
    # same names; inputs of a few rows go through the gemv kernel.
    def __init__(self, linear: nn.Module, fmt: int, groupsize: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt, self.groupsize = fmt, groupsize
        self.linear = linear  # for inputs gemv does not take (see forward), sharing every tensor
        if fmt == INT4:
            keep_int4_group_words(linear, owner=self)
        for name in ("weight", "scales", "zeros", "bias"):
            t = getattr(linear, name, None)
            # One owner per tensor, so that state_dict() names stay those of the model.
            linear._parameters.pop(name, None)
            linear._buffers.pop(name, None)
            object.__setattr__(linear, name, t)
            if isinstance(t, nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t)

    def forward(self, x: Tensor, **fused) -> Tensor:
        # fused: gemv's prologue/epilogue arguments (norm_weight, eps, glu, residual)
        rows = x.numel() // x.shape[-1]
        # Several rows of a float weight go to cuBLAS: gemv's tensor-core path for them
        # measured slow on an H200 (Llama-3.1-8B, batch 8: 406 tok/s in all, 1.9x one row).
        # Quantized weights take gemv up to TILE_ROWS rows (batches, short prompts).
        if rows == 1 or (self.fmt != FLOAT and rows <= TILE_ROWS):
            scales, zeros = gemv_scales(self)
            return gemv(x, self.weight, self.fmt, scales, zeros, self.groupsize, self.bias, **fused)
        return reference_epilogue(self.linear, x, **fused)


def reference_epilogue(linear, x, norm_weight=None, eps=1e-5, glu=False, residual=None):
    # What GemvLinear's fused arguments mean, for inputs too large for gemv (prefill).
    from model import rms_norm, swiglu

    if glu:
        x = swiglu(x)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    y = linear(x)
    return y if residual is None else residual + y


def gemv_format(module: nn.Module) -> tuple[int, int] | None:
    # (fmt, groupsize) for the linears gemv can run, None for anything else.
    if type(module) is nn.Linear:
        return FLOAT, 0
    kind = type(module).__name__
    if kind == "Int8Linear":
        return INT8, 0
    if kind == "Int4Linear":
        return INT4, module.groupsize
    if kind == "Fp8Linear":
        return FP8, 0
    return None


def expert_format(module: nn.Module) -> tuple[int, int] | None:
    # (fmt, groupsize) for moe.py's and quantize.py's expert stacks, None for anything else.
    kind = type(module).__name__
    formats = {"ExpertLinear": FLOAT, "Int8ExpertLinear": INT8, "Fp8ExpertLinear": FP8}
    if kind == "Int4ExpertLinear":
        return INT4, module.groupsize
    return (formats[kind], 0) if kind in formats else None


def _expert_gemv(linear: nn.Module, x: Tensor, **kwargs) -> Tensor:
    # gemv over one of moe.py's or quantize.py's expert stacks; kwargs: gemv's expert
    # arguments (expert_idx, or router_logits and top_k) and fused ones
    fmt, groupsize = expert_format(linear)
    scales, zeros = gemv_scales(linear)
    return gemv(x, linear.weight, fmt, scales, zeros, groupsize, **kwargs)


def moe_experts(
    x: Tensor, w13, w2, expert_idx: Tensor, expert_weights: Tensor, norm_weight=None, eps=1e-5
) -> Tensor:
    # moe.moe_experts with the decode case on gemv: x [N, dim], expert_idx/expert_weights [N, k].
    # Each (row, expert) pair is one row of two expert GEMVs that read only that expert's
    # weights: w13 (gate | up) on the pair's token's row of x, then w2 with SwiGLU as its
    # prologue. norm_weight: x is the block's residual stream and w13 applies the RMSNorm.
    import moe
    from model import rms_norm

    N, k = expert_idx.shape
    E = w13.n_experts
    if N * k >= E:
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps)
        return moe.moe_experts(x, w13, w2, expert_idx, expert_weights)
    here = (expert_idx >= 0) & (expert_idx < E)  # other ranks' experts count as absent
    weights = torch.where(here, expert_weights, 0.0)  # [N, k]
    idx = expert_idx.clamp(0, E - 1).flatten().to(torch.int32)  # [N * k]
    gate_up = _expert_gemv(w13, x, expert_idx=idx, norm_weight=norm_weight, eps=eps)
    y = _expert_gemv(w2, gate_up, expert_idx=idx, glu=True).view(N, k, -1)  # [N, k, dim]
    return (y.float() * weights[..., None]).sum(dim=1).to(x.dtype)


def routes_in_gemv(ff: nn.Module, x: Tensor) -> bool:
    # Whether moe_feed_forward can run this MOEFeedForward on x: every expert the router
    # scores is this rank's (no expert parallelism), and x's tokens pick fewer (token, expert)
    # pairs than there are experts (decoding; longer inputs run each expert once instead).
    tokens = x.numel() // x.shape[-1]
    return (
        ff.run_experts is moe_experts
        and isinstance(ff.gate, GemvLinear)
        and ff.expert_offset == 0
        and ff.w13.n_experts == ff.gate.out_features
        and tokens * ff.num_activated_experts < ff.w13.n_experts
    )


def moe_feed_forward(x: Tensor, ff: nn.Module, norm_weight: Tensor, eps: float) -> Tensor:
    # x + ff(rms_norm(x)) in three GEMVs for a MOEFeedForward ff (routes_in_gemv): the router
    # with the RMSNorm in its prologue; w13, which routes each (token, pick) row from the
    # router's logits itself; w2, which routes again, mixes a token's picks by their weights
    # and adds the residual. The routing and the mix, each a kernel of their own otherwise,
    # cost a few instructions per program here. x [..., dim] -> [..., dim]
    x2 = x.reshape(-1, x.shape[-1])  # [T, dim]
    k = ff.num_activated_experts
    logits = ff.gate(x2, norm_weight=norm_weight, eps=eps)  # [T, E]
    route = dict(router_logits=logits, top_k=k)
    gate_up = _expert_gemv(ff.w13, x2, norm_weight=norm_weight, eps=eps, **route)  # [T * k, 2I]
    y = _expert_gemv(ff.w2, gate_up, glu=True, residual=x2, mix=True, **route)  # [T, dim]
    return y.view(x.shape)


class FusedBlock(nn.Module):
    # A TransformerBlock whose decode step folds each RMSNorm into the next GEMV's prologue,
    # SwiGLU into w2's and the residual adds into wo's and w2's epilogues, and the rotary
    # embedding and cache write into the attention kernel: 4 GEMVs plus the attention per
    # layer, where the plain block needs about three times as many kernels. A Mixture-of-Experts
    # block fuses its attention half alike, and decoding runs its feed-forward as three GEMVs
    # (moe_feed_forward); otherwise its router and experts run as MOEFeedForward does.
    def forward(
        self, x: Tensor, freqs_cis: Tensor, rope_pos: Tensor, mask, input_pos: Tensor
    ) -> Tensor:
        attn, ff = self.attention, self.feed_forward
        anorm, fnorm = self.attention_norm, self.ffn_norm
        qkv = attn.wqkv(x, norm_weight=anorm.weight, eps=anorm.eps)
        if qkv.is_cuda and takes_decode_attention(qkv.shape[1], mask, attn.head_dim):
            # one new token, no padding (rope_pos is input_pos): rotary embedding and the
            # cache write in the kernel
            cache = attn.kv_cache
            y = torch.ops.fastgen.decode_attention_qkv(
                qkv, freqs_cis, cache.k_cache, cache.v_cache, input_pos, attn.n_head
            )  # fmt: skip
        else:
            y = attn.attend_qkv(qkv, freqs_cis, rope_pos, mask, input_pos)
        h = attn.wo(y, residual=x)
        if hasattr(ff, "run_experts"):
            if routes_in_gemv(ff, h):
                return moe_feed_forward(h, ff, fnorm.weight, fnorm.eps)
            if ff.run_experts is moe_experts and isinstance(ff.gate, GemvLinear):
                # the RMSNorm in the router's and w13's prologues
                return h + ff(h, norm_weight=fnorm.weight, eps=fnorm.eps)
            return h + ff(fnorm(h))
        gate_up = ff.w13(h, norm_weight=fnorm.weight, eps=fnorm.eps)
        return ff.w2(gate_up, glu=True, residual=h)


def use_kernels(model: nn.Module) -> nn.Module:
    # On CUDA: every linear gemv can run becomes a GemvLinear, each TransformerBlock a
    # FusedBlock, and attention over the cache the split kernel. Returns the model, changed.
    # The final RMSNorm stays Inductor's kernel: fused into the output GEMV, it hangs torch
    # 2.11's compile. Inductor logs a custom op's arguments the first time it meets the op,
    # building the string eagerly, and sample_top_k comes last: its logits' string would recurse
    # through every layer's custom ops (2^layers paths: each layer's output feeds two). The
    # norm, a Pointwise that prints only its ranges, cuts that chain.
    if triton is None:
        return model
    for module in list(model.modules()):
        if isinstance(module, GemvLinear):
            continue  # already swapped: its child is the fallback
        for child_name, child in list(module.named_children()):
            fmt = gemv_format(child)
            if fmt is not None:
                setattr(module, child_name, GemvLinear(child, *fmt))
        if hasattr(module, "attend"):
            module.attend = attend
        if hasattr(module, "run_experts") and all(
            expert_format(m) is not None for m in (module.w13, module.w2)
        ):
            module.run_experts = moe_experts
            for stack in (module.w13, module.w2):
                if expert_format(stack)[0] == INT4:
                    keep_int4_group_words(stack)
        if getattr(module, "tinygemm_weight", None) is not None:
            # gemv reads the stored int4 format; a second, repacked copy would double the
            # memory of every int4 layer. Prefill runs gemv's tiles (or, for long prompts,
            # dequantizes for cuBLAS).
            module.tinygemm_weight = module.tinygemm_scales_and_zeros = None
    for layer in getattr(model, "layers", []):
        linears = [layer.attention.wqkv, layer.attention.wo]
        if not hasattr(layer.feed_forward, "run_experts"):  # MoE experts: moe_experts
            linears += [layer.feed_forward.w13, layer.feed_forward.w2]
        if type(layer).__name__ == "TransformerBlock" and all(
            isinstance(m, GemvLinear) for m in linears
        ):
            layer.__class__ = FusedBlock
    return model
