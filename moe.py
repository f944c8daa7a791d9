# Mixture-of-Experts feed-forward (Mixtral 8x7B, 8x22B): a softmax router picks the top k of E
# SwiGLU experts for each token and mixes their outputs with the k probabilities renormalised to
# sum to one, as Hugging Face's MixtralSparseMoeBlock does. model.TransformerBlock uses it instead
# of FeedForward when ModelArgs.num_experts > 0 (model.py imports this file only then).
#
#   layers.N.feed_forward.gate.weight  [E, dim]                       the router
#   layers.N.feed_forward.w13.weight   [E, 2 * intermediate, dim]     each expert's gate | up rows
#   layers.N.feed_forward.w2.weight    [E, dim, intermediate]
#
# A few tokens (decoding) gather the chosen experts' weights: k of the E experts are read per
# token, never all of them. Longer inputs (prefill) run each expert once over the rows that chose
# it. quantize.py stores the expert stacks as int8, int4 or fp8 (its *ExpertLinear modules);
# tp.py splits each expert's hidden units or the experts themselves over ranks.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import ModelArgs, swiglu


class ExpertLinear(nn.Module):
    # E bias-free linears of one shape, stacked: weight [E, out_features, in_features]. The
    # quantized versions in quantize.py store other tensors and override weights().
    bias = None  # experts have none; code that handles linears looks for the attribute

    def __init__(self, n_experts, in_features, out_features, dtype=None, device=None):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        shape = (n_experts, out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))

    def weights(self, idx) -> Tensor:
        # idx: an expert number, or expert numbers [M] -> float weights [out, in] or [M, out, in]
        return self.weight[idx]

    def forward(self, x: Tensor, expert_idx: Tensor) -> Tensor:
        # x [M, in]; expert_idx [M] -> [M, out]: row m through expert expert_idx[m]. Only the
        # named experts' weights are read (a gather). A product and a sum rather than a bmm:
        # torch.compile fuses the gather (and any dequantization) into one reduction kernel,
        # where a bmm would first copy the gathered weights. M is small here (moe_experts).
        w = self.weights(expert_idx).to(x.dtype)  # [M, out, in]
        return (x[:, None, :] * w).sum(dim=-1)

    def expert(self, x: Tensor, e: int) -> Tensor:
        # x [M, in], every row through expert e -> [M, out]
        return F.linear(x, self.weights(e).to(x.dtype))


class MOEFeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        E, dim, inter = config.num_experts, config.dim, config.intermediate_size
        self.gate = nn.Linear(dim, E, bias=False)  # the router, kept in float when quantized
        self.w13 = ExpertLinear(E, dim, 2 * inter)  # gate (w1) and up (w3) rows fused
        self.w2 = ExpertLinear(E, inter, dim)
        self.num_activated_experts = config.num_activated_experts
        # Expert parallelism (tp.py): this rank holds experts expert_offset.. of the E the router
        # scores; the others' ids fall outside its stack and count as absent.
        self.expert_offset = 0
        self.run_experts = moe_experts  # a fused kernel can take its place

    def forward(self, x: Tensor, **fused) -> Tensor:
        # fused: an RMSNorm (norm_weight, eps) still to apply to x, passed only where the gate
        # and run_experts take it as their GEMVs' prologue (fastgen_kernels.FusedBlock).
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, dim], N = B * T
        logits = self.gate(x, **fused)  # [N, E]
        expert_weights, expert_idx = route(logits, self.num_activated_experts)  # [N, k]
        idx = expert_idx - self.expert_offset
        y = self.run_experts(x, self.w13, self.w2, idx, expert_weights, **fused)
        return y.view(shape)


def route(router_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    # router_logits [N, E] -> (weights [N, k] float32 summing to 1 per row, expert ids [N, k]).
    # Softmax over all E, then the top k renormalised: Mixtral's rule (HF, mistral-inference).
    probs = torch.softmax(router_logits.float(), dim=-1)  # [N, E]
    # The k largest as k argmaxes (first index on ties), not torch.topk: compiled, these fuse
    # with the softmax into one kernel, where topk's two sort kernels took 9 us per layer of
    # Mixtral 8x7B decoding on an H200 (a quarter of an int4 step's time outside the GEMVs).
    experts = torch.arange(probs.shape[-1], device=probs.device)
    rest, picks = probs, []
    for _ in range(k):
        i = rest.argmax(dim=-1, keepdim=True)  # [N, 1]
        picks.append(i)
        rest = torch.where(experts == i, -1.0, rest)  # probabilities are >= 0
    idx = torch.cat(picks, dim=-1)  # [N, k], largest first
    weights = probs.gather(-1, idx)
    return weights / weights.sum(dim=-1, keepdim=True), idx


def moe_experts(
    x: Tensor, w13: ExpertLinear, w2: ExpertLinear, expert_idx: Tensor, expert_weights: Tensor
) -> Tensor:
    # x [N, dim]; expert_idx [N, k] into w13/w2's stacks (ids outside 0..E-1 are another rank's
    # experts and count as absent); expert_weights [N, k] float32 -> [N, dim], each row's
    # experts' SwiGLU outputs mixed by its weights.
    N, k = expert_idx.shape
    E = w13.n_experts
    if N * k < E:
        # Fewer chosen (row, expert) pairs than experts: gather each pair's expert weights.
        here = (expert_idx >= 0) & (expert_idx < E)
        weights = torch.where(here, expert_weights, 0.0)  # [N, k]
        idx = expert_idx.clamp(0, E - 1).flatten()  # [N * k]
        xs = x.repeat_interleave(k, dim=0)  # [N * k, dim]
        y = w2(swiglu(w13(xs, idx)), idx).view(N, k, -1)  # [N, k, dim]
        return (y.float() * weights[..., None]).sum(dim=1).to(x.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [N, dim]
    for e in range(E):
        if torch.compiler.is_compiling():
            # fullgraph compiles allow no data-dependent shapes: all rows, weight 0 if not chosen.
            weight = (expert_weights * (expert_idx == e)).sum(dim=-1, keepdim=True)  # [N, 1]
            out += weight * w2.expert(swiglu(w13.expert(x, e)), e).float()
        else:
            rows, slot = torch.where(expert_idx == e)  # the rows that chose e, and in which slot
            y = w2.expert(swiglu(w13.expert(x[rows], e)), e)  # [rows, dim]
            out.index_add_(0, rows, y.float() * expert_weights[rows, slot, None])
    return out.to(x.dtype)
