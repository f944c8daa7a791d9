# Tensor parallelism: one process per GPU under torchrun, each holding 1/N of every linear layer.
#
#   torchrun --standalone --nproc_per_node=2 generate.py --compile --prompt "Hello, my name is"
#   torchrun --standalone --nproc_per_node=2 eval.py --tasks hellaswag --limit 100
#   torchrun --standalone --nproc_per_node=8 -m scripts.bench --models Llama-3.1-70B
#   torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \
#       --rdzv_endpoint=HOST:29500 generate.py ...     # the same on node 1 with --node_rank=1
#
# A script opts in with two calls: maybe_init_distributed() before loading, apply_tp(model) after
# loading and before kernels.use_kernels (generate.setup_for_device). The split is Megatron's:
#   wqkv    column-parallel: the rank's q heads and the k/v heads they read (q, k and v sliced
#           separately; with fewer kv heads than ranks each kv head is replicated)
#   wo, w2  row-parallel, each followed by an all-reduce (functional collectives, so
#           torch.compile traces it and CUDA graphs capture it)
#   w13     column-parallel: the same slice of the gate half and of the up half
#   output  split over the vocabulary, the logits all-gathered (every rank gets all of them)
#   embeddings and norms are replicated; each rank's KV cache holds only its kv heads.
# MoE layers (moe.py; generate.py --moe_parallel): the router is replicated, and either
#   tensor  every expert's w13 column-parallel and w2 row-parallel, as the dense MLP, or
#   expert  each rank holds E/N whole experts (tokens routed elsewhere count as absent),
# and in both the layer's output is all-reduced once (ShardedMOEFeedForward).
# Quantized linears (quantize.py) are sharded by slicing their stored tensors; int4 groups run
# along in_features, so a row-parallel shard must start and end on a group boundary.
# Every rank runs the same sampling on the same logits with the same seed (sync_seed), so all
# ranks pick the same tokens without exchanging them.
import atexit
import os
import sys
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch import Tensor

from moe import MOEFeedForward

# A dead or stuck peer turns into an error after this long instead of a hang (NCCL's watchdog
# and gloo's collectives both honour it). Long enough for a slow rank to finish compiling.
TIMEOUT = timedelta(minutes=5)
SHUTDOWN_GRACE_S = 10  # how long exiting waits for the process group to close
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo's RuntimeErrors
# torch 2.13 renamed all_gather_tensor (deprecated there); 2.11 has only the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
MOE_PARALLEL = ("tensor", "expert")


class TPError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------


def maybe_init_distributed(device: torch.device | str | None = None) -> tuple[int, int]:
    # Under torchrun (WORLD_SIZE > 1): join the process group, NCCL for CUDA and gloo for the
    # CPU, with this rank on cuda:LOCAL_RANK; ranks other than 0 get a silent stdout (the text
    # is printed once; stderr stays for errors, generate.log is rank 0's already); an uncaught
    # exception ends the rank at once. -> (rank, world_size); (0, 1) without torchrun.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is not None and device.index != local_rank:
            raise TPError(
                f"--device {device} under torchrun: pass --device cuda, each rank takes "
                "cuda:LOCAL_RANK"
            )
        if local_rank >= torch.cuda.device_count():
            raise TPError(
                f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but only "
                f"{torch.cuda.device_count()} are visible: lower --nproc_per_node"
            )
        torch.cuda.set_device(local_rank)  # so that plain "cuda" means this rank's GPU
    # device_id makes NCCL connect now, not inside the first CUDA graph capture.
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
        device_id=torch.device("cuda", local_rank) if cuda else None,
    )
    atexit.register(_shutdown)
    sys.excepthook = _exit_on_exception  # after init_process_group, which sets its own
    if rank > 0:
        sys.stdout = open(os.devnull, "w")
    return rank, world


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sync_seed(seed: int | None) -> int | None:
    # torch.manual_seed(seed). Ranks sample in step only from one seed: under torchrun, with
    # seed None, rank 0 draws one (from torch's generator, whatever state it is in) for all.
    # Without torchrun and without a seed, nothing changes. -> the seed used
    if seed is None:
        if rank_and_world()[1] == 1:
            return None
        shared = [int(torch.randint(2**31 - 1, ()))]
        dist.broadcast_object_list(shared, src=0)
        seed = shared[0]
    torch.manual_seed(seed)
    return seed


def rank0_int(n: int, device: torch.device | str) -> int:
    # n as rank 0 has it, on every rank (one broadcast; device: this rank's, as the process
    # group's backend needs); n itself without a process group. For choices each rank would make
    # from its own clock, such as speculative decoding's fallback, which all must make alike.
    if rank_and_world()[1] == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.broadcast(t, src=0)
    return int(t)


def _shutdown():
    # Close the process group, but never wait on it for long: with a peer gone, NCCL's destroy
    # can block. Runs at exit (atexit) and before dying of an exception.
    if not dist.is_initialized():
        return

    def destroy():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; the error that matters is elsewhere
            pass

    closer = threading.Thread(target=destroy, daemon=True)
    closer.start()
    closer.join(SHUTDOWN_GRACE_S)
    if closer.is_alive():
        os._exit(1)


def _exit_on_exception(exc_type, exc, tb):
    # An uncaught exception in any rank ends that rank now and non-zero, never waiting on its
    # peers; torchrun then stops the others, and gloo peers fail on the closed connection.
    rank = os.environ.get("RANK", "?")
    if isinstance(exc, dist.DistError) or any(m in str(exc) for m in PEER_GONE):
        first = (str(exc).strip().splitlines() or [exc_type.__name__])[0]
        msg = f"rank {rank}: a collective failed, another rank probably died: {first}"
        print(msg, file=sys.stderr, flush=True)
    elif issubclass(exc_type, KeyboardInterrupt):
        print(f"rank {rank}: interrupted", file=sys.stderr, flush=True)
    else:
        print(f"rank {rank} failed:", file=sys.stderr)
        traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        sys.stderr.flush()
    _shutdown()
    os._exit(1)


# ---------------------------------------------------------------------------------------------
# Which world sizes a model allows
# ---------------------------------------------------------------------------------------------


def split_problem(model: nn.Module, world: int, moe_parallel: str = "tensor") -> str | None:
    # Why `model` cannot be split over `world` ranks, or None when it can.
    attn, ff = model.layers[0].attention, model.layers[0].feed_forward
    n_head, n_kv, hd = attn.n_head, attn.n_kv_heads, attn.head_dim
    intermediate = ff.w2.in_features
    by_expert = isinstance(ff, MOEFeedForward) and moe_parallel == "expert"
    if n_head % world:
        return f"{n_head} attention heads do not split over {world} ranks"
    if n_kv % world and world % n_kv:
        return f"{n_kv} kv heads neither split over {world} ranks nor replicate evenly onto them"
    if by_expert and ff.w13.n_experts % world:
        return f"{ff.w13.n_experts} experts do not split over {world} ranks"
    if not by_expert and intermediate % world:
        return f"the MLP's {intermediate} hidden units do not split over {world} ranks"
    row_parallel = [("wo", attn.wo, n_head // world * hd)]
    if not by_expert:
        row_parallel.append(("w2", ff.w2, intermediate // world))
    for name, linear, width in row_parallel:
        groupsize = getattr(linear, "groupsize", 0)
        if groupsize and width % groupsize:
            return (
                f"{name}'s shard of {width} input features is not a whole number of int4 "
                f"groups of {groupsize}"
            )
    return None


def valid_world_sizes(model: nn.Module, moe_parallel: str = "tensor") -> list[int]:
    n_head = model.layers[0].attention.n_head
    return [w for w in range(1, n_head + 1) if split_problem(model, w, moe_parallel) is None]


# ---------------------------------------------------------------------------------------------
# Slicing linears (nn.Linear and quantize.py's modules alike)
# ---------------------------------------------------------------------------------------------


def take(t: Tensor, dim: int, ranges: list[tuple[int, int]], pad_to: int | None = None) -> Tensor:
    # The [start, end) ranges of t along dim, concatenated into a new tensor (so the full one
    # can be freed), zero-padded along dim to pad_to.
    parts = [t.narrow(dim, start, end - start) for start, end in ranges]
    size = sum(end - start for start, end in ranges)
    if pad_to is not None and pad_to > size:
        shape = list(t.shape)
        shape[dim] = pad_to - size
        parts.append(torch.zeros(shape, dtype=t.dtype, device=t.device))
    return torch.cat(parts, dim)


def _replace(module: nn.Module, name: str, t: Tensor):
    if isinstance(getattr(module, name), nn.Parameter):
        t = nn.Parameter(t, requires_grad=False)
    setattr(module, name, t)


def shard_columns(linear: nn.Module, rows: list[tuple[int, int]], pad_to: int | None = None):
    # Column-parallel: keep the output features in `rows`. Every stored tensor (weight, scales,
    # zeros, bias) has out_features first, int4's packed weight and group scales included; an
    # MoE expert stack (moe.ExpertLinear and its quantized forms) has the expert dimension first.
    dim = linear.weight.dim() - 2  # 0, or 1 behind the experts
    for name in ("weight", "scales", "zeros", "bias"):
        if getattr(linear, name, None) is not None:
            _replace(linear, name, take(getattr(linear, name), dim, rows, pad_to))
    linear.out_features = linear.weight.shape[dim]


def shard_rows(linear: nn.Module, start: int, end: int):
    # Row-parallel: keep the input features [start, end). int4 stores two per byte and one scale
    # and zero per group, so the cut must fall on group boundaries (split_problem checks it).
    groupsize = getattr(linear, "groupsize", 0)
    if groupsize:
        assert start % groupsize == 0 and end % groupsize == 0, (start, end, groupsize)
        _replace(linear, "weight", take(linear.weight, -1, [(start // 2, end // 2)]))
        groups = [(start // groupsize, end // groupsize)]
        for name in ("scales", "zeros"):
            _replace(linear, name, take(getattr(linear, name), -1, groups))
    else:
        # float, int8 and fp8: per-output-channel scales stay whole.
        _replace(linear, "weight", take(linear.weight, -1, [(start, end)]))
    linear.in_features = end - start


def shard_experts(ff: MOEFeedForward, rank: int, world: int):
    # Expert parallelism: keep experts [e0, e1) of every stored tensor of w13 and w2.
    n_experts = ff.w13.n_experts
    e0, e1 = rank * n_experts // world, (rank + 1) * n_experts // world
    for linear in (ff.w13, ff.w2):
        for name in ("weight", "scales", "zeros"):
            if getattr(linear, name, None) is not None:
                _replace(linear, name, take(getattr(linear, name), 0, [(e0, e1)]))
        linear.n_experts = e1 - e0
    ff.expert_offset = e0


# ---------------------------------------------------------------------------------------------
# The modules a sharded model gains
# ---------------------------------------------------------------------------------------------


class AllReduce(nn.Module):
    # A row-parallel linear: each rank's partial product summed over the ranks, then the bias
    # (once). A module rather than a hook, so that kernels.use_kernels still swaps the linear
    # inside for its GEMV but leaves the block unfused: the residual is added after the sum.
    def __init__(self, linear: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias  # moved out of the linear: every rank would add it
        linear.bias = None
        self.linear = linear
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = funcol.all_reduce(self.linear(x), "sum", self.group)  # [..., out_features]
        return y if self.bias is None else y + self.bias


class ShardedMOEFeedForward(MOEFeedForward):
    # An MoE layer whose ranks each hold a part (hidden units of every expert, or whole experts):
    # the partial outputs summed over the ranks. apply_tp swaps the class of a loaded
    # MOEFeedForward (its tensors stay where they are) and sets `group`.
    group = None

    def forward(self, x: Tensor, **fused) -> Tensor:
        return funcol.all_reduce(super().forward(x, **fused), "sum", self.group)  # [B, T, dim]


class GatherVocab(nn.Module):
    # The output head split over the vocabulary: each rank computes `per_rank` logits (the last
    # rank's padded with zero rows when vocab_size does not divide), then all of them are
    # gathered in rank order.
    def __init__(self, linear: nn.Module, vocab_size: int, world: int, group: dist.ProcessGroup):
        super().__init__()
        self.linear, self.vocab_size, self.world, self.group = linear, vocab_size, world, group

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x).contiguous()  # [B, T, per_rank]
        g = _all_gather(y, 0, self.group)  # [world * B, T, per_rank]
        g = g.view(self.world, *y.shape).movedim(0, -2).flatten(-2)  # [B, T, world * per_rank]
        return g[..., : self.vocab_size]


# ---------------------------------------------------------------------------------------------
# Sharding a model
# ---------------------------------------------------------------------------------------------


def apply_tp(
    model: nn.Module,
    rank: int | None = None,
    world: int | None = None,
    device: torch.device | str | None = None,
    moe_parallel: str = "tensor",
) -> nn.Module:
    # Shards a loaded model (float or quantized, kernels not yet swapped in) in place for this
    # rank; rank and world default to the process group's, and world 1 changes nothing. With
    # `device`, the shard then moves there: load on the CPU (mmap) and each GPU only ever holds
    # its shard. moe_parallel: how MoE layers split (MOE_PARALLEL). Returns the model.
    if moe_parallel not in MOE_PARALLEL:
        raise TPError(f"moe_parallel must be tensor or expert, got {moe_parallel!r}")
    if rank is None or world is None:
        rank, world = rank_and_world()
    if world == 1:
        return model
    sharded = ("GemvLinear", "AllReduce", "ShardedMOEFeedForward")
    if any(type(m).__name__ in sharded for m in model.modules()):
        raise TPError(
            "apply_tp needs the loaded model as it is: load with use_kernels=False, shard, "
            "then call setup_for_device; and shard once"
        )
    problem = split_problem(model, world, moe_parallel)
    if problem is not None:
        sizes = ", ".join(str(w) for w in valid_world_sizes(model, moe_parallel))
        raise TPError(f"cannot split the model over {world} ranks: {problem} (valid: {sizes})")
    group = dist.group.WORLD  # None without a process group: shards that cannot run yet
    for layer in model.layers:
        shard_attention(layer.attention, rank, world, group)
        ff = layer.feed_forward
        moe = isinstance(ff, MOEFeedForward)
        if moe and moe_parallel == "expert":
            shard_experts(ff, rank, world)
        else:  # the same cut for a dense MLP and for each expert
            inter = ff.w2.in_features
            i0, i1 = rank * inter // world, (rank + 1) * inter // world
            shard_columns(ff.w13, [(i0, i1), (inter + i0, inter + i1)])  # [gate | up] halves
            shard_rows(ff.w2, i0, i1)
        if moe:
            ff.__class__, ff.group = ShardedMOEFeedForward, group
        else:
            ff.w2 = AllReduce(ff.w2, group)
    # Over the vocabulary; a tied head gets its own shard, the embedding stays whole.
    vocab = model.output.out_features
    per_rank = -(-vocab // world)
    v0, v1 = min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab)
    shard_columns(model.output, [(v0, v1)], pad_to=per_rank)
    model.output = GatherVocab(model.output, vocab, world, group)
    if device is not None:
        model.to(device)
    int4 = [m for m in model.modules() if hasattr(m, "tinygemm_weight")]
    if int4:
        import quantize  # the int4 kernel's repacked copy was made from the full weights

        for m in int4:
            m.tinygemm_weight = m.tinygemm_scales_and_zeros = None
        quantize.finalize_model(model, model.tok_embeddings.weight.device)
    return model


def shard_attention(attn: nn.Module, rank: int, world: int, group):
    n_head, n_kv, hd = attn.n_head, attn.n_kv_heads, attn.head_dim
    h0, h1 = rank * n_head // world, (rank + 1) * n_head // world  # this rank's q heads
    # Its kv heads: its share of them, or (fewer kv heads than ranks) the one its q heads read.
    k0 = rank * n_kv // world
    k1 = max(k0 + 1, (rank + 1) * n_kv // world)
    q_dim, kv_dim = n_head * hd, n_kv * hd
    # wqkv rows: [q heads | k heads | v heads], each head hd rows.
    q_rows = (h0 * hd, h1 * hd)
    k_rows = (q_dim + k0 * hd, q_dim + k1 * hd)
    v_rows = (q_dim + kv_dim + k0 * hd, q_dim + kv_dim + k1 * hd)
    shard_columns(attn.wqkv, [q_rows, k_rows, v_rows])
    shard_rows(attn.wo, h0 * hd, h1 * hd)
    attn.wo = AllReduce(attn.wo, group)
    attn.n_head, attn.n_kv_heads = h1 - h0, k1 - k0
