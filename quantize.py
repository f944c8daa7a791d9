# Weight-only quantization of every linear layer (the output head too, unless --skip_output):
#
#   python quantize.py --checkpoint_path DIR/model.pth --mode int8              # model_int8.pth
#   python quantize.py --checkpoint_path DIR/model.pth --mode int4 --groupsize 32
#   python quantize.py --checkpoint_path DIR/model.pth --mode int4-gptq --groupsize 32 \
#       --calibration_file notes.txt
#   python quantize.py --checkpoint_path DIR/model.pth --mode fp8               # model_fp8.pth
#   python generate.py --checkpoint_path DIR/model_int4.g32.pth                 # loads any of them
#
# Output names follow gpt-fast (model_int4.g32.pth, model_int4-gptq.g32.pth), but the mode and
# its parameters travel inside the checkpoint: loading never looks at the file name.
#
# A quantized checkpoint is model.pth's state dict with each linear's `weight` replaced by the
# tensors below, plus one entry generate.QUANT_KEY holding the mode and its parameters, so that
# loading never depends on the file name. Stored formats (device-independent):
#   int8  weight int8 [out, in], scales float32 [out]           w = weight * scale (symmetric)
#   int4  weight uint8 [out, in/2], scales, zeros bfloat16 [out, in/groupsize]
#         w = (q - zero) * scale, q in 0..15; column 2j sits in the low nibble of byte j, 2j+1
#         in the high nibble; groups run along in_features (so row-parallel shards cut cleanly).
#   fp8   weight float8_e4m3fn [out, in], scales float32 [out]  w = weight * scale
# int4-gptq stores exactly the int4 format; only the choice of q, scales and zeros differs.
# Biases and every non-linear tensor (embeddings, norms) stay as they were.
# Mixture-of-Experts stacks (moe.ExpertLinear, weight [E, out, in]) are quantized expert by expert
# into the same formats with a leading expert dimension (int8 weight [E, out, in], scales [E, out];
# int4 weight [E, out, in/2], scales and zeros [E, out, in/groupsize]); the router stays float.
#
# Loading (generate.load_model): prepare_model swaps nn.Linear for the modules here on the meta
# device, load_state_dict(assign=True) fills them, and finalize_model repacks int4 for the
# device's kernel (tinygemm on CUDA in bfloat16), keeping the stored tensors as they are.
import argparse
import itertools
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from generate import (
    QUANT_KEY,
    CheckpointError,
    UserError,
    load_checkpoint,
    load_model,
    log,
    pick_device,
    read_config,
)
from model import ConfigError
from moe import ExpertLinear

MODES = ("int8", "int4", "int4-gptq", "fp8")
GROUPSIZES = (32, 64, 128, 256)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FORMAT_VERSION = 1


class QuantizeError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# int8: symmetric, one scale per output channel
# ---------------------------------------------------------------------------------------------


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    # w [out, in] -> weight int8 [out, in], scales float32 [out]
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-10) / 127
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(weight: Tensor, scales: Tensor) -> Tensor:
    return weight.float() * scales.float()[..., None]  # [..., out, in] float32


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    # x [..., in]; weight int8 [out, in]; scales float32 [out] -> [..., out] in x's dtype.
    # The per-channel scale commutes with the matmul, so it is applied to the small output.
    return (F.linear(x, weight.to(x.dtype)) * scales).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# int4: asymmetric, grouped along in_features, two values per byte
# ---------------------------------------------------------------------------------------------


def pack_int4(q: Tensor) -> Tensor:
    # q uint8 [out, in] in 0..15 -> [out, in/2]: column 2j in the low nibble, 2j+1 in the high.
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    # packed uint8 [out, in/2] -> q uint8 [out, in]
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def int4_group_params(w: Tensor) -> tuple[Tensor, Tensor]:
    # w [..., groupsize] -> scales, zeros [...]: float32 holding bfloat16 values, the stored
    # precision, so that q is chosen against exactly the grid that will be stored.
    w = w.float()
    lo, hi = torch.aminmax(w, dim=-1)
    # A constant group c gets scale |c|/8 and zero -8*sign(c), which reproduces c exactly.
    scales = torch.where(hi > lo, (hi - lo) / 15, lo.abs() / 8).clamp(min=1e-10)
    scales = scales.to(torch.bfloat16).float()
    zeros = (-lo / scales).to(torch.bfloat16).float()
    return scales, zeros


def int4_round(w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    # w, scales, zeros broadcastable -> q uint8 in 0..15 with w ~ (q - zero) * scale
    return (w.float() / scales + zeros).round().clamp(0, 15).to(torch.uint8)


def quantize_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor, Tensor]:
    # w [out, in] -> weight uint8 [out, in/2], scales, zeros bfloat16 [out, in/groupsize]
    out, n = w.shape
    groups = w.float().reshape(out, n // groupsize, groupsize)
    scales, zeros = int4_group_params(groups)
    q = int4_round(groups, scales[..., None], zeros[..., None]).reshape(out, n)
    return pack_int4(q), scales.to(torch.bfloat16), zeros.to(torch.bfloat16)


def dequantize_int4(weight: Tensor, scales: Tensor, zeros: Tensor, groupsize: int) -> Tensor:
    # weight uint8 [..., out, in/2]; scales, zeros [..., out, in/groupsize] -> [..., out, in]
    # float32 (a leading expert dimension or none)
    q = unpack_int4(weight)
    *lead, n = q.shape
    q = q.reshape(*lead, n // groupsize, groupsize).float()
    return ((q - zeros.float()[..., None]) * scales.float()[..., None]).reshape(*lead, n)


def int4_linear(x: Tensor, weight: Tensor, scales: Tensor, zeros: Tensor, groupsize: int) -> Tensor:
    # x [..., in]; weight uint8 [out, in/2]; scales, zeros [out, in/groupsize] -> [..., out].
    # Plain PyTorch: torch.compile fuses the unpacking into the matmul's weight load.
    return F.linear(x, dequantize_int4(weight, scales, zeros, groupsize).to(x.dtype))


def tinygemm_pack(weight: Tensor, scales: Tensor, zeros: Tensor) -> tuple[Tensor, Tensor] | None:
    # The stored int4 format -> (packed, scales_and_zeros) for aten._weight_int4pack_mm, the
    # CUDA bfloat16 int4 kernel, or None when this torch or this shape has no such kernel.
    # tinygemm wants the even column in the high nibble and w = (q - 8) * scale + offset.
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack"):
        return None
    swapped = (weight << 4) | (weight >> 4)  # [out, in/2]
    offsets = (8 - zeros.float()) * scales.float()
    scales_and_zeros = torch.stack([scales.float(), offsets], dim=-1)  # [out, in/gs, 2]
    scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)
    for inner_k_tiles in (8, 4, 2):  # the widest tiling this in_features allows
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
        except RuntimeError:
            continue
        return packed, scales_and_zeros
    return None


def int4_linear_tinygemm(
    x: Tensor, packed: Tensor, scales_and_zeros: Tensor, groupsize: int, out_features: int
) -> Tensor:
    # x [..., in] bfloat16 on CUDA; packed and scales_and_zeros from tinygemm_pack -> [..., out]
    y = torch.ops.aten._weight_int4pack_mm(
        x.reshape(-1, x.shape[-1]), packed, groupsize, scales_and_zeros
    )
    return y.reshape(*x.shape[:-1], out_features)


# ---------------------------------------------------------------------------------------------
# fp8: float8_e4m3fn weights, one float32 scale per output channel
# ---------------------------------------------------------------------------------------------


def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    # w [out, in] -> weight float8_e4m3fn [out, in], scales float32 [out]
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-10) / FP8_MAX
    q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_fp8(weight: Tensor, scales: Tensor) -> Tensor:
    return weight.float() * scales.float()[..., None]  # [..., out, in] float32


def fp8_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    # x [..., in]; weight float8_e4m3fn [out, in]; scales float32 [out] -> [..., out].
    # Weight-only: float8 -> x's dtype is exact, so this equals the dequantized layer.
    return (F.linear(x, weight.to(x.dtype)) * scales).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scales", torch.empty(out_features, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x: Tensor) -> Tensor:
        y = int8_linear(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> Tensor:
        return dequantize_int8(self.weight, self.scales)


class Int4Linear(nn.Module):
    def __init__(
        self, in_features, out_features, bias=False, dtype=None, device=None, *, groupsize
    ):
        super().__init__()
        if in_features % groupsize:
            raise ValueError(
                f"in_features {in_features} is not a multiple of groupsize {groupsize}"
            )
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        shape = (out_features, in_features // groupsize)
        self.register_buffer(
            "weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer("scales", torch.empty(shape, dtype=torch.bfloat16, device=device))
        self.register_buffer("zeros", torch.empty(shape, dtype=torch.bfloat16, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )
        # finalize_model fills these on CUDA; they are never saved.
        self.register_buffer("tinygemm_weight", None, persistent=False)
        self.register_buffer("tinygemm_scales_and_zeros", None, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.tinygemm_weight is not None and x.dtype == torch.bfloat16 and x.is_cuda:
            y = int4_linear_tinygemm(
                x,
                self.tinygemm_weight,
                self.tinygemm_scales_and_zeros,
                self.groupsize,
                self.out_features,
            )
        else:
            y = int4_linear(x, self.weight, self.scales, self.zeros, self.groupsize)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> Tensor:
        return dequantize_int4(self.weight, self.scales, self.zeros, self.groupsize)


class Fp8Linear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight",
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer("scales", torch.empty(out_features, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x: Tensor) -> Tensor:
        y = fp8_linear(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> Tensor:
        return dequantize_fp8(self.weight, self.scales)


class Int8ExpertLinear(ExpertLinear):
    # E int8 linears stacked: weight int8 [E, out, in], scales float32 [E, out]
    def __init__(self, n_experts, in_features, out_features, dtype=None, device=None):
        nn.Module.__init__(self)  # not ExpertLinear's: no float weight
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        shape = (n_experts, out_features, in_features)
        self.register_buffer("weight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(n_experts, out_features, device=device))

    def weights(self, idx) -> Tensor:
        # Dequantizes only the experts idx names (an int or [M]) -> [out, in] or [M, out, in]
        return dequantize_int8(self.weight[idx], self.scales[idx])


class Int4ExpertLinear(ExpertLinear):
    # E int4 linears stacked: weight uint8 [E, out, in/2], scales, zeros bfloat16
    # [E, out, in/groupsize], each expert in Int4Linear's format
    def __init__(self, n_experts, in_features, out_features, dtype=None, device=None, *, groupsize):
        nn.Module.__init__(self)  # not ExpertLinear's: no float weight
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.groupsize = groupsize
        shape = (n_experts, out_features, in_features // groupsize)
        packed = (n_experts, out_features, in_features // 2)
        self.register_buffer("weight", torch.empty(packed, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(shape, dtype=torch.bfloat16, device=device))
        self.register_buffer("zeros", torch.empty(shape, dtype=torch.bfloat16, device=device))

    def weights(self, idx) -> Tensor:
        w, s, z = self.weight[idx], self.scales[idx], self.zeros[idx]
        return dequantize_int4(w, s, z, self.groupsize)


class Fp8ExpertLinear(Int8ExpertLinear):
    # E float8_e4m3fn linears stacked: weight [E, out, in], scales float32 [E, out]
    def __init__(self, n_experts, in_features, out_features, dtype=None, device=None):
        super().__init__(n_experts, in_features, out_features, dtype, device)
        self.weight = self.weight.to(torch.float8_e4m3fn)

    def weights(self, idx) -> Tensor:
        return dequantize_fp8(self.weight[idx], self.scales[idx])


QUANTIZED_LINEARS = (Int8Linear, Int4Linear, Fp8Linear)
QUANTIZED_EXPERTS = (Int8ExpertLinear, Int4ExpertLinear, Fp8ExpertLinear)


def empty_quantized_linear(linear: nn.Module, quant: dict, device=None) -> nn.Module:
    # An uninitialised quantized module of the linear's (or expert stack's) shape, on `device`
    # (default its own).
    device = linear.weight.device if device is None else device
    experts = isinstance(linear, ExpertLinear)
    if experts:
        args = (linear.n_experts, linear.in_features, linear.out_features)
        int8, int4, fp8 = QUANTIZED_EXPERTS
    else:
        args = (linear.in_features, linear.out_features, linear.bias is not None)
        int8, int4, fp8 = QUANTIZED_LINEARS
    kwargs = dict(dtype=linear.weight.dtype, device=device)
    mode = quant["mode"]
    if mode == "int8":
        return int8(*args, **kwargs)
    if mode in ("int4", "int4-gptq"):
        return int4(*args, **kwargs, groupsize=quant["groupsize"])
    if mode == "fp8":
        return fp8(*args, **kwargs)
    raise CheckpointError(f"unknown quantization mode {mode!r} (known: {', '.join(MODES)})")


def quantize_linear(linear: nn.Module, mode: str, groupsize: int | None = None) -> nn.Module:
    # A float nn.Linear or moe.ExpertLinear -> its quantized module (round to nearest), on the
    # linear's device.
    module = empty_quantized_linear(linear, {"mode": mode, "groupsize": groupsize})
    for param, t in quantize_weight(linear.weight.detach(), mode, groupsize).items():
        setattr(module, param, t)
    if linear.bias is not None:
        module.bias = nn.Parameter(linear.bias.detach().clone())
    return module


def quantize_weight(w: Tensor, mode: str, groupsize: int | None = None) -> dict[str, Tensor]:
    # One linear's float weight [out, in] -> the tensors its quantized module stores.
    if w.dim() == 3:  # an expert stack [E, out, in]: each expert as a linear of its own
        per_expert = [quantize_weight(w_e, mode, groupsize) for w_e in w]
        return {name: torch.stack([q[name] for q in per_expert]) for name in per_expert[0]}
    if mode == "int8":
        weight, scales = quantize_int8(w)
        return {"weight": weight, "scales": scales}
    if mode == "int4":
        weight, scales, zeros = quantize_int4(w, groupsize)
        return {"weight": weight, "scales": scales, "zeros": zeros}
    if mode == "fp8":
        weight, scales = quantize_fp8(w)
        return {"weight": weight, "scales": scales}
    raise QuantizeError(f"unknown mode {mode!r} for round-to-nearest (known: int8, int4, fp8)")


# ---------------------------------------------------------------------------------------------
# Loading: the two hooks generate.load_model calls
# ---------------------------------------------------------------------------------------------


def linear_names(model: nn.Module, skip_output: bool) -> list[str]:
    # The linears (and MoE expert stacks) a quantized checkpoint replaces, in model order. An MoE
    # router (feed_forward.gate) stays float: it is tiny, and its choices should not move.
    return [
        name
        for name, module in model.named_modules()
        if (isinstance(module, nn.Linear) or type(module) is ExpertLinear)
        and not (skip_output and name == "output")
        and not name.endswith("feed_forward.gate")
    ]


def prepare_model(model: nn.Module, quant: dict) -> nn.Module:
    # Swap the float linears for empty quantized modules on the model's (meta) device, so that
    # model.state_dict() names and shapes the checkpoint's tensors. In place; returns the model.
    if quant.get("format_version", 1) > FORMAT_VERSION:
        raise CheckpointError(
            f"quantization format {quant['format_version']} is newer than this fastgen reads "
            f"({FORMAT_VERSION})"
        )
    for name in linear_names(model, bool(quant.get("skip_output", False))):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if quant["mode"] in ("int4", "int4-gptq") and linear.in_features % quant["groupsize"]:
            raise CheckpointError(
                f"{name} has {linear.in_features} input features, not a multiple of the "
                f"checkpoint's groupsize {quant['groupsize']}"
            )
        setattr(parent, child, empty_quantized_linear(linear, quant))
    return model


def finalize_model(model: nn.Module, device: torch.device | str) -> nn.Module:
    # After the tensors are loaded on `device`: repack what the device's kernel wants. Only int4
    # on CUDA in bfloat16 has one (tinygemm); everywhere else the stored tensors are used as is.
    # Running it again (e.g. after sharding) recomputes the repacked forms.
    device = torch.device(device)
    dtype = model.tok_embeddings.weight.dtype
    for module in model.modules():
        if not isinstance(module, Int4Linear):
            continue
        packed = None
        if device.type == "cuda" and dtype == torch.bfloat16:
            packed = tinygemm_pack(module.weight, module.scales, module.zeros)
        module.tinygemm_weight, module.tinygemm_scales_and_zeros = packed or (None, None)
    return model


# ---------------------------------------------------------------------------------------------
# Quantizing a checkpoint
# ---------------------------------------------------------------------------------------------


def default_output_path(checkpoint_path: Path, mode: str, groupsize: int) -> Path:
    # gpt-fast's names: model_int8.pth, model_int4.g32.pth, model_int4-gptq.g32.pth, model_fp8.pth
    suffix = f"{mode}.g{groupsize}" if mode.startswith("int4") else mode
    return checkpoint_path.with_name(f"{checkpoint_path.stem}_{suffix}.pth")


def check_groupsize(model: nn.Module, names: list[str], groupsize: int):
    for name in names:
        n = model.get_submodule(name).in_features
        if n % groupsize:
            raise QuantizeError(
                f"{name} has {n} input features, not a multiple of --groupsize {groupsize} "
                f"(use one of {', '.join(str(g) for g in GROUPSIZES if n % g == 0) or 'none'})"
            )


def assemble_state_dict(
    float_state: dict[str, Tensor],
    quantized: dict[str, dict[str, Tensor]],
    quant: dict,
    dtype: torch.dtype,
) -> dict:
    # float_state: the tensors that stay float (taken from model.state_dict() before
    # quantizing), cast back to the checkpoint's dtype; plus each quantized linear's tensors and
    # the metadata entry. Everything on the CPU.
    state = {k: (t.to(dtype) if t.is_floating_point() else t).cpu() for k, t in float_state.items()}
    for name, tensors in quantized.items():
        for param, t in tensors.items():
            state[f"{name}.{param}"] = t.cpu()
    state[QUANT_KEY] = quant
    return state


def float_tensors(model: nn.Module, names: list[str]) -> dict[str, Tensor]:
    # model.state_dict() minus the weights that get quantized, and minus a tied float head
    # (load_model ties it back to tok_embeddings when output.weight is absent).
    drop = {f"{name}.weight" for name in names}
    if model.config.tie_embeddings and "output" not in names:
        drop.add("output.weight")
    return {k: t for k, t in model.state_dict().items() if k not in drop}


@torch.no_grad()
def quantize_model(
    model: nn.Module, mode: str, groupsize: int | None, skip_output: bool, progress: bool = True
) -> dict[str, dict[str, Tensor]]:
    # Round-to-nearest int8, int4 or fp8 of each linear -> {linear name: its stored tensors}.
    from tqdm import tqdm

    names = linear_names(model, skip_output)
    layers = itertools.groupby(names, key=lambda name: ".".join(name.split(".")[:2]))
    n_layers = len({".".join(name.split(".")[:2]) for name in names})
    out = {}
    bar = tqdm(
        layers, total=n_layers, desc=mode, unit="layer", file=sys.stderr, disable=not progress
    )
    for _, layer_names in bar:  # one step per transformer layer, one for the head
        for name in layer_names:
            out[name] = quantize_weight(model.get_submodule(name).weight, mode, groupsize)
    return out


def quantize_checkpoint(
    checkpoint_path: Path,
    mode: str,
    groupsize: int | None = None,
    skip_output: bool = False,
    device: torch.device | str = "cpu",
    calibration: Tensor | None = None,
    percdamp: float = 0.01,
    blocksize: int = 128,
    act_order: bool = False,
    progress: bool = True,
) -> dict:
    # model.pth -> the quantized state dict (with QUANT_KEY), ready for torch.save. int4-gptq
    # needs calibration token ids [n_samples, seq_len].
    checkpoint_path, device = Path(checkpoint_path), torch.device(device)
    if mode not in MODES:
        raise QuantizeError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    if mode.startswith("int4") and groupsize not in GROUPSIZES:
        raise QuantizeError(f"--groupsize must be one of {GROUPSIZES}, got {groupsize}")
    if mode == "int4-gptq" and calibration is None:
        raise QuantizeError("int4-gptq needs calibration token ids")
    if mode == "int4-gptq" and read_config(checkpoint_path).num_experts:
        raise QuantizeError("int4-gptq does not cover MoE experts yet: use --mode int4")
    state = load_checkpoint(checkpoint_path)
    if QUANT_KEY in state:
        raise QuantizeError(
            f"{checkpoint_path} is already quantized (mode {state[QUANT_KEY].get('mode')}): "
            "quantize the float checkpoint instead"
        )
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    dtype = floats[0] if floats else torch.float32  # the output keeps the checkpoint's dtype
    del state
    # GPTQ runs the model: in float32 on the CPU (bfloat16 matmuls are slow there).
    run_dtype = torch.float32 if mode == "int4-gptq" and device.type == "cpu" else dtype
    model = load_model(checkpoint_path, device, run_dtype, use_kernels=False)  # plain linears
    names = linear_names(model, skip_output)
    quant = {"mode": mode, "skip_output": skip_output, "format_version": FORMAT_VERSION}
    if mode.startswith("int4"):
        check_groupsize(model, names, groupsize)
        quant["groupsize"] = groupsize
    keep = float_tensors(model, names)
    if mode == "int4-gptq":
        import GPTQ

        quant.update(
            percdamp=percdamp,
            blocksize=blocksize,
            act_order=act_order,
            calibration_samples=int(calibration.shape[0]),
            calibration_seq_length=int(calibration.shape[1]),
        )
        quantized = GPTQ.gptq_quantize_model(
            model,
            calibration,
            groupsize,
            percdamp=percdamp,
            blocksize=blocksize,
            act_order=act_order,
            skip_output=skip_output,
            progress=progress,
        )
    else:
        quantized = quantize_model(model, mode, groupsize, skip_output, progress)
    return assemble_state_dict(keep, quantized, quant, dtype)


def save_atomic(obj, path: Path):
    # Write beside the target and rename, so an interrupted run never leaves half a file.
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def main(
    checkpoint_path: Path,
    mode: str,
    groupsize: int,
    skip_output: bool,
    calibration_file: Path | None,
    calibration_tasks: list[str] | None,
    calibration_limit: int,
    calibration_seq_length: int,
    percdamp: float,
    blocksize: int,
    act_order: bool,
    device: str,
    output_path: Path | None,
):
    import GPTQ  # (quantize imports GPTQ only here: GPTQ imports quantize)

    t0 = time.perf_counter()
    try:
        dev = pick_device(device)
        output_path = output_path or default_output_path(checkpoint_path, mode, groupsize)
        if output_path.resolve() == checkpoint_path.resolve():
            raise QuantizeError(f"--output_path {output_path} would overwrite the input")
        if not output_path.parent.is_dir():
            raise QuantizeError(f"the output folder {output_path.parent} does not exist")
        if output_path.is_dir():
            raise QuantizeError(f"--output_path {output_path} is a folder, not a file")
        calibration = None
        if mode == "int4-gptq":
            if not 0 <= percdamp < 1:
                raise QuantizeError(f"--percdamp must be in [0, 1), got {percdamp}")
            if blocksize < 1:
                raise QuantizeError(f"--blocksize must be >= 1, got {blocksize}")
            calibration = GPTQ.calibration_from_args(
                checkpoint_path,
                calibration_file,
                calibration_tasks,
                calibration_limit,
                calibration_seq_length,
            )
        state = quantize_checkpoint(
            checkpoint_path,
            mode,
            groupsize,
            skip_output,
            dev,
            calibration,
            percdamp,
            blocksize,
            act_order,
        )
        save_atomic(state, output_path)
    except (QuantizeError, GPTQ.GPTQError, CheckpointError, ConfigError, UserError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: save_atomic has already removed its temporary file
        log("interrupted, no output written")
        sys.exit(130)
    size = output_path.stat().st_size / 1e6
    log(f"wrote {output_path} ({size:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB RSS"  # kB on Linux
    if dev.type == "cuda":
        log(f"peak memory: {torch.cuda.max_memory_allocated(dev) / 1e9:.2f} GB GPU, {peak}")
    else:
        log(f"peak memory: {peak}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Quantize the linear layers of a fastgen checkpoint (weight-only).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checkpoint_path", type=Path, required=True, help="the float model.pth to quantize"
    )
    p.add_argument("--mode", choices=MODES, required=True, help="quantization scheme")
    p.add_argument(
        "--groupsize",
        type=int,
        choices=GROUPSIZES,
        default=32,
        help="int4: input features sharing one scale and zero",
    )
    p.add_argument(
        "--skip_output",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep the output head in float",
    )
    p.add_argument(
        "--calibration_file",
        type=Path,
        default=None,
        help="int4-gptq: plain text to calibrate on (default: --calibration_tasks if given, "
        "else the Python documentation in the standard library, pydoc_data.topics)",
    )
    p.add_argument(
        "--calibration_tasks",
        nargs="+",
        default=None,
        help="int4-gptq: lm_eval task names whose documents are the calibration text",
    )
    p.add_argument(
        "--calibration_limit", type=int, default=128, help="int4-gptq: calibration sequences"
    )
    p.add_argument(
        "--calibration_seq_length",
        type=int,
        default=512,
        help="int4-gptq: tokens per calibration sequence",
    )
    p.add_argument(
        "--percdamp",
        type=float,
        default=0.01,
        help="int4-gptq: damping added to the Hessian diagonal, as a fraction of its mean",
    )
    p.add_argument(
        "--blocksize",
        type=int,
        default=128,
        help="int4-gptq: columns updated together (speed only; rounded to whole groups)",
    )
    p.add_argument(
        "--act_order",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="int4-gptq: quantize columns in order of decreasing activation energy",
    )
    p.add_argument("--device", default="cpu", help="where the quantization math runs (cpu, cuda)")
    p.add_argument(
        "--output_path",
        type=Path,
        default=None,
        help="where to write (default: beside the input, named as gpt-fast names it)",
    )
    return p


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))
