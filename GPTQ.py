# GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
# Pre-trained Transformers") into quantize.py's int4 format. Run it through quantize.py:
#
#   python quantize.py --checkpoint_path DIR/model.pth --mode int4-gptq --groupsize 32 \
#       --calibration_file some_english.txt [--act_order] [--percdamp 0.01] [--blocksize 128]
#
# Per linear layer with calibration inputs X [n, in], GPTQ minimises ||X W^T - X Q^T|| column
# by column: it quantizes column j, then spreads that column's error over the columns not yet
# quantized, weighted by the inverse Hessian H^-1 of H = 2/n X^T X. The Cholesky factor of H^-1
# gives those weights one row at a time; "lazy batch" updates touch the rest of the matrix once
# per block of columns (--blocksize, speed only).
#
# The model is walked block by block: calibration tokens go through the embeddings once; each
# TransformerBlock then runs twice over the calibration inputs (once with hooks that accumulate
# the Hessians of wqkv, wo, w13 and w2, once more with the quantized weights to produce the next
# block's inputs) and is freed. Only the current block's inputs are held, so peak memory is about
# the model plus n_samples * seq_len * dim activations (see the README for the measured formula).
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from model import KVCache, precompute_freqs_cis
from quantize import dequantize_int4, int4_group_params, int4_round, linear_names, pack_int4


class GPTQError(Exception):
    # A problem the user can fix (calibration text, damping); quantize.py prints it as one line.
    pass


# ---------------------------------------------------------------------------------------------
# Calibration text
# ---------------------------------------------------------------------------------------------


def pydoc_text() -> str:
    # English prose every Python install carries: the language reference topics behind help().
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def lm_eval_text(tasks: list[str]) -> str:
    # The documents of lm_eval tasks (names or YAML paths), question and answer joined.
    try:
        import lm_eval.tasks
    except ImportError as e:
        raise GPTQError(
            "--calibration_tasks needs lm_eval (pip install lm_eval); or pass --calibration_file"
        ) from e
    try:
        task_dict = lm_eval.tasks.get_task_dict(tasks, lm_eval.tasks.TaskManager())
    except Exception as e:  # noqa: BLE001 - unknown names, datasets that cannot be fetched
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise GPTQError(
            f"cannot load lm_eval tasks {' '.join(tasks)}: {first}; pass --calibration_file"
        ) from e
    texts = []
    for task in flatten_tasks(task_dict):
        for doc in task.eval_docs:
            target = task.doc_to_target(doc)
            if isinstance(target, int) and task.config.output_type == "multiple_choice":
                target = task.doc_to_choice(doc)[target]
            texts.append(f"{task.doc_to_text(doc)} {target}")
    return "\n\n".join(texts)


def flatten_tasks(task_dict: dict) -> Iterable:
    # get_task_dict nests groups as dicts of tasks.
    for value in task_dict.values():
        if isinstance(value, dict):
            yield from flatten_tasks(value)
        else:
            yield value


def calibration_text(calibration_file: Path | None, calibration_tasks: list[str] | None):
    # -> (text, a few words saying where it came from)
    if calibration_file is not None:
        if not calibration_file.is_file():
            raise GPTQError(f"calibration file {calibration_file} does not exist")
        return calibration_file.read_text(encoding="utf-8", errors="replace"), str(calibration_file)
    if calibration_tasks:
        return lm_eval_text(calibration_tasks), f"lm_eval {' '.join(calibration_tasks)}"
    return pydoc_text(), "the Python documentation in pydoc_data.topics"


def calibration_tokens(
    tok, text: str, limit: int, seq_len: int, source: str = "the text"
) -> Tensor:
    # Consecutive, non-overlapping windows of the tokenized text -> [n_samples, seq_len] long.
    if limit < 1 or seq_len < 2:
        raise GPTQError(
            f"need --calibration_limit >= 1 and --calibration_seq_length >= 2, "
            f"got {limit} and {seq_len}"
        )
    # Enough text for the windows at any sane characters-per-token, not the whole of a big file.
    ids = tok.encode(text[: limit * seq_len * 16], bos=False)
    n = min(limit, len(ids) // seq_len)
    if n == 0:
        raise GPTQError(
            f"{source} has {len(ids)} tokens, fewer than one --calibration_seq_length ({seq_len})"
        )
    if n < limit:
        print(f"calibration: {source} has only {n} windows of {seq_len} tokens", file=sys.stderr)
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def calibration_from_args(checkpoint_path, calibration_file, calibration_tasks, limit, seq_len):
    # quantize.py's flags -> calibration token ids, with the checkpoint's own tokenizer.
    from generate import CheckpointError
    from tokenizer import TokenizerError, get_tokenizer

    if not checkpoint_path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint_path} does not exist")
    try:
        tok = get_tokenizer(checkpoint_path.parent)
    except TokenizerError as e:
        raise GPTQError(f"GPTQ needs the checkpoint's tokenizer: {e}") from e
    text, source = calibration_text(calibration_file, calibration_tasks)
    tokens = calibration_tokens(tok, text, limit, seq_len, source)
    print(f"calibration: {tokens.shape[0]} x {seq_len} tokens from {source}", file=sys.stderr)
    return tokens


# ---------------------------------------------------------------------------------------------
# The algorithm, one weight matrix at a time
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def gptq_int4(
    w: Tensor,
    hessian: Tensor,
    groupsize: int,
    percdamp: float = 0.01,
    blocksize: int = 128,
    act_order: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    # w [out, in]; hessian [in, in] (any positive multiple of X^T X) -> q uint8 [out, in] in
    # 0..15, scales, zeros float32 [out, in/groupsize] (bfloat16 values), as quantize_int4.
    W = w.to(torch.float32, copy=True)  # [out, in], updated in place as columns are done
    H = hessian.to(torch.float32, copy=True)
    out, n = W.shape
    n_groups = n // groupsize
    dead = H.diagonal() == 0  # inputs that were always zero: their weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    scales = torch.zeros(out, n_groups, device=W.device)
    zeros = torch.zeros(out, n_groups, device=W.device)
    if act_order:
        # Columns go in order of decreasing H diagonal (the inputs with the most energy first).
        # Group parameters are then fixed up front from the original weights ("static groups"),
        # so the stored layout stays the plain one, with no permutation to keep.
        scales, zeros = int4_group_params(W.view(out, n_groups, groupsize))
        order = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, order], H[order][:, order]
    else:
        order = torch.arange(n, device=W.device)
    group_of = (order // groupsize).tolist()  # column j (in processing order) -> its group
    damp = percdamp * H.diagonal().mean()
    H.diagonal().add_(damp)
    try:
        # U is upper triangular with H^-1 = U^T U; row j of U weighs column j's error.
        L = torch.linalg.cholesky(H)
        U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except torch.linalg.LinAlgError as e:
        raise GPTQError(
            f"the Hessian is not positive definite even with damping {percdamp}: "
            "raise --percdamp or give more calibration text"
        ) from e
    Q = torch.zeros(out, n, dtype=torch.uint8, device=W.device)
    # Whole groups per block, so that a group's parameters see all updates made before it.
    blocksize = max(blocksize // groupsize, 1) * groupsize
    for b0 in range(0, n, blocksize):
        b1 = min(b0 + blocksize, n)
        errors = torch.empty(out, b1 - b0, device=W.device)  # scaled errors of this block
        for j in range(b0, b1):
            if not act_order and j % groupsize == 0:
                g = j // groupsize
                scales[:, g], zeros[:, g] = int4_group_params(W[:, j : j + groupsize])
            g = group_of[j]
            col = W[:, j]
            q = int4_round(col, scales[:, g], zeros[:, g])
            Q[:, j] = q
            err = (col - (q.float() - zeros[:, g]) * scales[:, g]) / U[j, j]
            W[:, j:b1] -= err[:, None] * U[j, j:b1][None, :]  # the rest of this block, now
            errors[:, j - b0] = err
        W[:, b1:] -= errors @ U[b0:b1, b1:]  # everything after the block, once
    if act_order:
        Q = Q[:, torch.argsort(order)]
    return Q, scales, zeros


# ---------------------------------------------------------------------------------------------
# The model, block by block
# ---------------------------------------------------------------------------------------------


def hessian_hooks(linears: dict[str, nn.Linear]):
    # Forward pre-hooks adding X^T X of each linear's input into hessians[name] [in, in] float32
    # and the number of rows into counts[name]. -> (hessians, counts, hook handles)
    hessians, counts, handles = {}, {}, []

    def make_hook(name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [tokens, in]
            hessians[name].addmm_(x.T, x)
            counts[name] += x.shape[0]

        return hook

    for name, linear in linears.items():
        hessians[name] = torch.zeros(
            linear.in_features, linear.in_features, device=linear.weight.device
        )
        counts[name] = 0
        handles.append(linear.register_forward_pre_hook(make_hook(name)))
    return hessians, counts, handles


def quantize_one(
    name: str,
    linear: nn.Linear,
    hessian: Tensor,
    groupsize: int,
    percdamp: float,
    blocksize: int,
    act_order: bool,
) -> dict[str, Tensor]:
    # GPTQ one linear -> its stored int4 tensors (on the CPU).
    try:
        q, scales, zeros = gptq_int4(
            linear.weight, hessian, groupsize, percdamp, blocksize, act_order
        )
    except GPTQError as e:
        raise GPTQError(f"{name}: {e}") from e
    return {
        "weight": pack_int4(q).cpu(),
        "scales": scales.to(torch.bfloat16).cpu(),
        "zeros": zeros.to(torch.bfloat16).cpu(),
    }


def dequantized(tensors: dict[str, Tensor], groupsize: int, like: Tensor) -> Tensor:
    w = dequantize_int4(tensors["weight"], tensors["scales"], tensors["zeros"], groupsize)
    return w.to(device=like.device, dtype=like.dtype)


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module,
    tokens: Tensor,
    groupsize: int,
    percdamp: float = 0.01,
    blocksize: int = 128,
    act_order: bool = False,
    skip_output: bool = False,
    progress: bool = True,
) -> dict[str, dict[str, Tensor]]:
    # tokens [n_samples, seq_len] -> {linear name: stored int4 tensors}. Consumes the model:
    # each block is moved to the meta device once its outputs are computed.
    from tqdm import tqdm

    emb = model.tok_embeddings.weight
    device, dtype = emb.device, emb.dtype
    config = model.config
    n_samples, seq_len = tokens.shape
    quantize = set(linear_names(model, skip_output))
    input_pos = torch.arange(seq_len, device=device)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()  # causal
    freqs_cis = precompute_freqs_cis(
        seq_len, config.head_dim, config.rope_base, config.rope_scaling
    )
    freqs_cis = freqs_cis.to(device)  # [seq_len, head_dim/2, 2]
    rope_pos = input_pos[None]  # [1, seq_len]
    # The current block's inputs, one row per calibration sample, overwritten by its outputs.
    xs = torch.empty(n_samples, seq_len, config.dim, dtype=dtype, device=device)
    for i in range(n_samples):
        xs[i] = model.tok_embeddings(tokens[i].to(device))
    out = {}
    steps = len(model.layers) + ("output" in quantize)
    bar = tqdm(total=steps, desc="int4-gptq", unit="layer", file=sys.stderr, disable=not progress)
    for li, block in enumerate(model.layers):
        attn = block.attention
        attn.kv_cache = KVCache(1, seq_len, attn.n_kv_heads, attn.head_dim, dtype, device)

        linears = {
            f"layers.{li}.{name}": m
            for name, m in block.named_modules()
            if isinstance(m, nn.Linear) and f"layers.{li}.{name}" in quantize
        }
        hessians, counts, handles = hessian_hooks(linears)
        for i in range(n_samples):  # pass 1: Hessians from the float block (outputs dropped)
            block(xs[i : i + 1], freqs_cis, rope_pos, mask, input_pos)
        for handle in handles:
            handle.remove()
        for name, linear in linears.items():
            hessian = hessians.pop(name) * (2 / counts[name])
            out[name] = quantize_one(
                name, linear, hessian, groupsize, percdamp, blocksize, act_order
            )
            linear.weight.data = dequantized(out[name], groupsize, linear.weight)
        for i in range(n_samples):  # pass 2: the quantized block's outputs feed the next block
            xs[i : i + 1] = block(xs[i : i + 1], freqs_cis, rope_pos, mask, input_pos)
        attn.kv_cache = None
        block.to("meta")  # done with this block: free its weights
        bar.update()
    if "output" in quantize:
        hessian = torch.zeros(config.dim, config.dim, device=device)
        for i in range(n_samples):
            x = model.norm(xs[i]).float()  # [seq_len, dim]
            hessian.addmm_(x.T, x)
        hessian *= 2 / (n_samples * seq_len)
        out["output"] = quantize_one(
            "output", model.output, hessian, groupsize, percdamp, blocksize, act_order
        )
        bar.update()
    bar.close()
    return out
