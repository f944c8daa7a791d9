# Text generation with a torch.compile'd decode step (CUDA graphs on GPU).
#
#   python generate.py --prompt "Hello, my name is" --max_new_tokens 100
#   python generate.py --chat --prompt "What is the capital of France?"
#   python generate.py --interactive                 # multi-turn chat, Ctrl-C or Ctrl-D ends it
#   python generate.py --compile --prompt 5 --ignore_eos --num_samples 5   # benchmark
#
# stdout carries only the generated text; timing, bandwidth and memory go to stderr.
import argparse
import contextlib
import json
import os
import pickle
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

import fastgen_kernels as kernels
import tp
from model import ConfigError, ModelArgs, Transformer
from tokenizer import StreamDecoder, TokenizerError, get_tokenizer

DEFAULT_CHECKPOINT = Path("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth")
QUANT_KEY = "_fastgen_quantization"  # metadata entry in a quantized checkpoint's state dict
# With --compile, prompts up to this long prefill through the decode step (prefill_by_steps): past
# ~12 tokens a 7B's steps cost more than one uncompiled prefill, sooner on bigger models.
SHORT_PROMPT = 8
PRECISIONS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class UserError(Exception):
    pass


def log(*args):
    # Under torchrun only rank 0 talks.
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Sampling (no host sync: everything stays on the device)
# ---------------------------------------------------------------------------------------------


def logits_to_probs(
    logits: Tensor, temperature: float, top_k: int | None = None, top_p: float = 1.0
) -> Tensor:
    # logits [B, vocab] float32 -> probs [B, vocab]
    if top_k is not None and top_k < logits.shape[-1]:
        # The top_k largest logits and any tied with the k-th, as Hugging Face's and gpt-fast's
        # top_k keep them; chosen before the temperature divides (which could round two
        # different logits into a tie), as fastgen_kernels.sample_top_k chooses them.
        kth = torch.topk(logits, top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
        logits = logits.masked_fill(logits < kth, -float("inf"))
    logits = logits / max(temperature, 1e-5)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already cover top_p; the first always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) > top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -float("inf"))
    return torch.softmax(logits, dim=-1)


def race(weights: Tensor) -> Tensor:
    # weights [..., n] >= 0, not all zero -> an index [..., 1] drawn with probability
    # proportional to them: argmax(w / Exp(1)) (an exponential race), no normalising needed and
    # none of torch.multinomial's host sync.
    q = torch.empty_like(weights).exponential_(1)
    return torch.argmax(weights / q, dim=-1, keepdim=True)


def sample(
    logits: Tensor, temperature: float, top_k: int | None = None, top_p: float = 1.0,
    seed: Tensor | None = None, pos: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    # logits [B, T, vocab] -> next token [B, 1] from the last position, and its distribution
    # (None for greedy, where the distribution is a point mass on the argmax). seed [B] (below
    # 2^31) and pos [1], the step's position: the CUDA top-k kernels key their draw by both, so a
    # CUDA-graphed step draws no random numbers of its own; elsewhere torch's generator draws.
    logits = logits[:, -1]
    if temperature == 0:
        return logits.float().argmax(dim=-1, keepdim=True), None
    if top_p == 1.0 and kernels.samples_top_k(logits, top_k):
        # On CUDA, two kernels draw from logits_to_probs's distribution (torch.topk alone was
        # about 20 kernels, 45 us of a Llama-2-7B step on an H200). probs is computed apart:
        # a compiled caller that drops it never computes it.
        token = kernels.sample_top_k(logits, max(temperature, 1e-5), top_k, seed, pos)
        return token, logits_to_probs(logits.float(), temperature, top_k)
    probs = logits_to_probs(logits.float(), temperature, top_k, top_p)
    return race(probs), probs


# ---------------------------------------------------------------------------------------------
# The two steps the loop runs (compiled by main() when asked)
# ---------------------------------------------------------------------------------------------


def prefill(
    model: Transformer,
    x: Tensor,
    input_pos: Tensor,
    pad: Tensor | None,
    from_zero: bool = False,
    **sampling,
) -> Tensor:
    # x [B, T] prompt tokens at cache slots input_pos [T] -> first new token [B, 1]
    logits = model(x, input_pos, pad, last_logits_only=True, from_zero=from_zero)
    return sample(logits, pos=input_pos[-1:], **sampling)[0]


def read_later(t: Tensor) -> Callable[[], list]:
    # -> a function that returns t's values as a list. On CUDA the copy to (pinned) host memory
    # is queued now and the function waits for it alone: t.tolist() later would also wait for
    # every step launched after t, and the GPU would idle while the host launches the next.
    if t.device.type != "cuda":
        return t.tolist
    host = t.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list:
        copied.synchronize()
        return host.tolist()

    return read


def decode_one_token(
    model: Transformer, x: Tensor, input_pos: Tensor, pad: Tensor | None, **sampling
) -> Tensor:
    # x [B, 1] at slot input_pos [1] -> next token [B, 1]
    logits = model(x, input_pos, pad)
    return sample(logits, pos=input_pos, **sampling)[0]


def prefill_by_steps(
    decode_fn, model: Transformer, x: Tensor, input_pos: Tensor, pad: Tensor | None,
    from_zero: bool = False, **sampling,
) -> Tensor:  # fmt: skip
    # prefill's contract, but a prompt of at most SHORT_PROMPT tokens goes through decode_fn (the
    # compiled, CUDA-graphed decode step) one token at a time: on Llama-2-7B bf16 (H200) an
    # uncompiled prefill of 5 tokens costs 52 ms of kernel launches, five decode steps 20 ms.
    # Each step writes its slot and attends to the slots before it, as prefill does.
    T = x.shape[1]
    if T > SHORT_PROMPT:
        return prefill(model, x, input_pos, pad, from_zero, **sampling)
    for i in range(T):  # clones: the compiled step expects contiguous [B, 1] and [1] inputs
        token = decode_fn(model, x[:, i : i + 1].clone(), input_pos[i : i + 1].clone(), pad,
                          **sampling)  # fmt: skip
    return token


def compile_steps(compile: bool, compile_prefill: bool) -> dict:
    # The step functions generate() takes, compiled or not; generate.py, eval.py, speculative.py
    # and scripts/bench.py all get theirs here, so the benchmark times what the scripts run.
    steps = {"prefill_fn": prefill, "decode_fn": decode_one_token}
    if compile:
        # Inductor's on-disk cache makes a second run's compile seconds, not a minute. No
        # coordinate-descent tuning: the heavy kernels are fastgen's own on CUDA, and tuning
        # Inductor's small ones (sampling, norms) lengthens a cold compile.
        torch._inductor.config.fx_graph_cache = True
        steps["decode_fn"] = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
        steps["prefill_fn"] = partial(prefill_by_steps, steps["decode_fn"])
    if compile_prefill:
        steps["prefill_fn"] = torch.compile(prefill, fullgraph=True, dynamic=True)
    return steps


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    pad: Tensor | None = None,
    start_pos: int = 0,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float = 1.0,
    stop_ids: set[int] | frozenset = frozenset(),
    on_token=None,
    prefill_fn=prefill,
    decode_fn=decode_one_token,
) -> list[list[int]]:
    # prompt [B, T] (left-padded by pad [B] when rows differ in length), written to cache slots
    # start_pos.. start_pos+T-1. Returns each row's new tokens, cut after its first stop token.
    # on_token(list[int]) sees each step's tokens for all rows as they are known.
    B, T = prompt.shape
    device = prompt.device
    # floats always: an int 0 and a float 0.8 would be two compiled graphs. One seed per row
    # from torch's generator keys every step's draw with the step's position (see sample).
    sampling = dict(temperature=float(temperature), top_k=top_k, top_p=float(top_p))
    # int64 like the token and the position: CUDA graph trees copy a step's inputs in with one
    # foreach kernel when they share a dtype, and with a memcpy each when they do not.
    sampling["seed"] = torch.randint(1 << 31, (B,), device=device)
    input_pos = torch.arange(start_pos, start_pos + T, device=device)
    from_zero = start_pos == 0 and pad is None
    token = prefill_fn(model, prompt, input_pos, pad, from_zero, **sampling).clone()  # [B, 1]
    watch = bool(stop_ids) or on_token is not None
    done = [False] * B
    out = [token]
    read = read_later(token[:, 0]) if watch else None
    # every step's slot up front: a view per step, where `pos += 1` was one more kernel a step
    positions = torch.arange(start_pos + T, start_pos + T + max_new_tokens, device=device)
    for i in range(max_new_tokens - 1):
        # Launch step i+1 before looking at token i on the host, so the check overlaps the GPU.
        pos = positions[i : i + 1]
        nxt = decode_fn(model, token, pos, pad, **sampling).clone()  # CUDA graphs reuse outputs
        if watch:
            read_nxt = read_later(nxt[:, 0])
            ids = read()  # waits for step i only, not for step i+1 queued behind it
            done = [d or t in stop_ids for d, t in zip(done, ids)]
            if on_token is not None:
                on_token(ids)
            if all(done):
                break
            read = read_nxt
        out.append(nxt)
        token = nxt
    else:
        if on_token is not None:
            on_token(read())
    tokens = torch.cat(out, dim=1).tolist()  # [B, n]
    for row in tokens:
        cut = next((i for i, t in enumerate(row) if t in stop_ids), None)
        if cut is not None:
            del row[cut + 1 :]
    return tokens


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


class CheckpointError(Exception):
    pass


def read_config(checkpoint_path: Path) -> ModelArgs:
    config_path = checkpoint_path.parent / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no config.json beside {checkpoint_path}")
    try:
        return ModelArgs.from_config(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"bad {config_path}: {type(e).__name__} {e}") from e


def load_checkpoint(checkpoint_path: Path) -> dict:
    if not checkpoint_path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint_path} does not exist")
    try:
        # mmap: tensors stay on disk until used; weights_only refuses code-running pickles.
        return torch.load(checkpoint_path, mmap=True, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        why = unpickling_refusal(e)
        raise CheckpointError(f"refusing checkpoint {checkpoint_path}: {why}") from e
    except Exception as e:  # noqa: BLE001 - unreadable, truncated or hostile files all end here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"cannot read checkpoint {checkpoint_path}: {first}") from e


def unpickling_refusal(e: Exception) -> str:
    # torch's message opens with advice to retry with weights_only=False; ours names what was
    # refused instead (e.g. "unsupported GLOBAL posix.system").
    lines = [line.strip() for line in str(e).splitlines()]
    what = next((line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")), "")
    what = f" ({what.removeprefix('Trying to load ').rstrip('.')})" if what else ""
    return f"it holds Python objects besides tensors, and loading them could run code{what}"


def load_model(
    checkpoint_path: Path,
    device: torch.device | str,
    precision: torch.dtype,
    use_kernels: bool = True,
) -> Transformer:
    config = read_config(checkpoint_path)
    state = load_checkpoint(checkpoint_path)
    quant = state.pop(QUANT_KEY, None)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype=precision)
    if quant is not None:
        import quantize  # only quantized checkpoints need it

        quantize.prepare_model(model, quant)
    if config.tie_embeddings and "output.weight" not in state:
        state["output.weight"] = state.get("tok_embeddings.weight")
    expected = model.state_dict()
    for name, want in expected.items():
        have = state.get(name)
        if have is None:
            raise CheckpointError(f"{checkpoint_path}: missing tensor {name}")
        if have.shape != want.shape:
            raise CheckpointError(
                f"{checkpoint_path}: tensor {name} has shape {tuple(have.shape)}, "
                f"the config expects {tuple(want.shape)}"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise CheckpointError(f"{checkpoint_path}: unexpected tensor {extra[0]}")
    # Before the first byte goes to the device:
    check_memory(device, weight_bytes(model, per_token=False))
    # One tensor at a time: cast floats to the model's dtype, move to the device, assign.
    converted = {}
    for name, want in expected.items():
        t = state[name]
        if (
            name == "output.weight"
            and config.tie_embeddings
            and t is state["tok_embeddings.weight"]
        ):
            continue
        if t.is_floating_point() and want.is_floating_point() and t.dtype != want.dtype:
            t = t.to(want.dtype)
        converted[name] = t.to(device)
    if "output.weight" not in converted:
        converted["output.weight"] = converted["tok_embeddings.weight"]
    model.load_state_dict(converted, assign=True)
    if quant is not None:
        quantize.finalize_model(model, device)
    return setup_for_device(model.eval(), device, use_kernels)


def load_for_rank(
    checkpoint_path: Path,
    device: torch.device | str,
    precision: torch.dtype,
    use_kernels: bool = True,
    moe_parallel: str = "tensor",
) -> Transformer:
    # load_model, and under torchrun this rank's shard of it: each rank loads on the CPU (mmap)
    # and keeps its shard, so a GPU never holds the whole model.
    rank, world = tp.rank_and_world()
    model = load_model(checkpoint_path, device if world == 1 else "cpu", precision, False)
    model = tp.apply_tp(model, rank, world, device, moe_parallel=moe_parallel)
    return setup_for_device(model, device, use_kernels)


def setup_for_device(model: Transformer, device, use_kernels: bool = True) -> Transformer:
    # On CUDA, decode-sized matmuls and attention go to fastgen's Triton kernels.
    if torch.device(device).type == "cuda" and use_kernels:
        kernels.use_kernels(model)
    return model


def weight_bytes(model: torch.nn.Module, per_token: bool = True) -> int:
    # per_token: bytes one decode step must read - every weight but the embedding table (a row
    # lookup) unless it is also the output head, and of MoE expert stacks the share a token uses
    # (k of E). Else: bytes the weights take. Each tensor counts once (a tied head is the table);
    # KV caches and rope tables are not weights.
    share = {}  # id(tensor) -> fraction read per token
    for m in model.modules() if per_token else ():
        if hasattr(m, "num_activated_experts"):
            for t in [*m.w13.parameters(), *m.w13.buffers(), *m.w2.parameters(), *m.w2.buffers()]:
                share[id(t)] = m.num_activated_experts / model.config.num_experts
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    seen, total = set(), 0
    for name, t in tensors:
        if id(t) in seen or "kv_cache" in name or name == "freqs_cis":
            continue
        if name.endswith("group_words"):  # int4 scales and zeros interleaved, counted as those
            continue
        if per_token and name.startswith("tok_embeddings"):
            continue  # not marked seen: output.weight may be this same tensor
        seen.add(id(t))
        total += round(t.numel() * t.element_size() * share.get(id(t), 1.0))
    return total


# ---------------------------------------------------------------------------------------------
# Memory: estimate before allocating, and say what to change when it does not fit
# ---------------------------------------------------------------------------------------------


def kv_cache_bytes(model: Transformer, batch_size: int, max_seq_len: int) -> int:
    # Keys and values [B, n_kv_heads, S, head_dim] in every layer, in the model's float dtype.
    item = model.tok_embeddings.weight.element_size()
    per_slot = sum(2 * b.attention.n_kv_heads * b.attention.head_dim for b in model.layers)
    return batch_size * max_seq_len * per_slot * item


def memory_message(device, weights: int, kv_cache: int, free: int, batch_size=1, seq_len=0) -> str:
    def gb(n):
        return f"{n / 1e9:.2f} GB"

    parts = f"weights {gb(weights)}"
    if kv_cache:
        parts += f" + KV cache {gb(kv_cache)} for {batch_size} x {seq_len} tokens"
    return (
        f"not enough memory on {device}: {gb(weights + kv_cache)} needed ({parts}), "
        f"{gb(free)} free; use a shorter --max_seq_length or a smaller --batch_size, or a "
        "quantized checkpoint (quantize.py --mode int8 or int4 halves or quarters the weights)"
    )


def check_memory(
    device, weights: int, kv_cache: int = 0, *, loaded=False, free: int | None = None, **shape
):
    # Raises UserError when weights + kv_cache exceed the free device memory. loaded: the weights
    # are already on the device, so their bytes count as free. free: a value to use instead of
    # asking CUDA (tests); without it only CUDA devices are checked.
    device = torch.device(device)
    if free is None:
        if device.type != "cuda":
            return
        free = torch.cuda.mem_get_info(device)[0]
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free += weights if loaded else 0
    if weights + kv_cache > free:
        raise UserError(memory_message(device, weights, kv_cache, free, **shape))


def setup_caches(model: Transformer, batch_size: int, max_seq_len: int):
    # The KV cache is the allocation that grows with flags: check it against what is left.
    device = model.tok_embeddings.weight.device
    kv = kv_cache_bytes(model, batch_size, max_seq_len)
    weights = weight_bytes(model, per_token=False)
    check_memory(device, weights, kv, loaded=True, batch_size=batch_size, seq_len=max_seq_len)
    model.setup_caches(batch_size, max_seq_len)


def out_of_memory_message(e: Exception) -> str:
    # torch's own first sentence says how much it tried to allocate and how much is free.
    first = (str(e).strip().splitlines() or ["CUDA out of memory"])[0]
    return (
        f"out of GPU memory: {first} Use a shorter --max_seq_length or a smaller --batch_size, "
        "or a quantized checkpoint (quantize.py --mode int8 or int4)"
    )


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise UserError(f"unknown device {device!r} (try cpu or cuda)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device} is not available: torch sees no CUDA GPU")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"device {device!r} is not supported (cpu or cuda)")
    return dev


def check_sampling(temperature: float, top_k: int | None, top_p: float):
    if not temperature >= 0:  # also refuses nan
        raise UserError(f"--temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top_k must be >= 1, got {top_k}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1], got {top_p}")


def check_counts(**flags):
    # Counts that must be >= 1 when given (None: not given).
    for flag, value in flags.items():
        if value is not None and value < 1:
            raise UserError(f"--{flag} must be >= 1, got {value}")


def is_synthetic(prompt: str) -> bool:
    # "300" asks for a random 300-token prompt; "²" or "٣" are text (isdigit alone says digit).
    return prompt.isascii() and prompt.isdigit()


def too_long(n_tokens: int, limit: int, max_seq_length: int | None) -> UserError:
    where = "--max_seq_length" if max_seq_length else "the model's context"
    return UserError(f"the prompt has {n_tokens} tokens; {where} is {limit}")


def encode_prompts(tok, prompt, prompts_file, chat, system, batch_size, vocab_size, seed):
    # -> list of token-id lists, one per batch row
    def encode(text):
        if not chat:
            return tok.encode(text)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}
        ]
        return tok.encode_chat(messages)

    if prompts_file is not None:
        if not prompts_file.is_file():
            raise UserError(f"prompts file {prompts_file} does not exist")
        try:
            text = prompts_file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = "it is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror
            raise UserError(f"cannot read prompts file {prompts_file}: {why}") from e
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise UserError(f"prompts file {prompts_file} has no prompts")
        return [encode(line) for line in lines]
    if is_synthetic(prompt):
        # A synthetic prompt of that many tokens, for benchmarks (run_main checked its length).
        g = torch.Generator().manual_seed(seed if seed is not None else 0)
        ids = torch.randint(0, min(vocab_size, 1024), (int(prompt),), generator=g).tolist()
    else:
        ids = encode(prompt)
    return [ids] * batch_size


def left_pad(rows: list[list[int]], device) -> tuple[Tensor, Tensor | None]:
    longest = max(len(r) for r in rows)
    pads = [longest - len(r) for r in rows]
    x = torch.tensor([[0] * p + r for p, r in zip(pads, rows)], device=device)
    pad = torch.tensor(pads, device=device) if any(pads) else None
    return x, pad


def cache_length(needed: int, block_size: int) -> int:
    # Round up so that nearby prompt lengths share one compiled graph.
    return min(block_size, -(-needed // 256) * 256)


def run_interactive(model, tok, steps, sampling, max_new_tokens, system, max_seq_len):
    # A full context drops the oldest exchanges (the system message stays) until the new message
    # plus max_new_tokens fit; a message that does not fit even alone is refused, and the chat
    # goes on. Ctrl-C or end of input at the prompt ends the chat; Ctrl-C in a reply exits 130.
    keep = 1 if system else 0  # messages[:keep] are never dropped
    messages = [{"role": "system", "content": system}] if system else []
    in_cache: list[int] = []  # tokens whose keys/values sit in the cache, in slot order
    while True:
        try:
            user = input("User: ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        trial = messages + [{"role": "user", "content": user}]
        ids = tok.encode_chat(trial)
        while len(ids) + max_new_tokens > max_seq_len and len(trial) > keep + 1:
            del trial[keep : keep + 2]  # the oldest exchange: a user message and its reply
            ids = tok.encode_chat(trial)
        if len(ids) >= max_seq_len:
            log(
                f"context full: this message takes {len(ids)} tokens with the chat template, "
                f"the context holds {max_seq_len}; it was not sent"
            )
            continue
        if len(trial) < len(messages) + 1:
            dropped = len(messages) + 1 - len(trial)
            log(f"context full: dropped the oldest {dropped} messages ({len(ids)} tokens remain)")
        messages = trial
        # Reuse the cache for the longest prefix it already holds.
        common = 0
        for a, b in zip(ids, in_cache):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # always feed at least one token
        budget = min(max_new_tokens, max_seq_len - len(ids))
        stream = StreamDecoder(tok)
        print("Assistant: ", end="", flush=True)

        def show(tokens, stream=stream):
            if tokens[0] not in tok.stop_ids:
                print(stream.push(tokens[0]), end="", flush=True)

        prompt = torch.tensor([ids[common:]], device=model.tok_embeddings.weight.device)
        try:
            new = generate(
                model,
                prompt,
                budget,
                start_pos=common,
                stop_ids=tok.stop_ids,
                on_token=show,
                **sampling,
                **steps,
            )[0]
        except KeyboardInterrupt:
            print(stream.flush(), flush=True)
            log("interrupted")
            sys.exit(130)
        print(stream.flush(), flush=True)
        in_cache = ids + new[:-1]  # the last token was sampled but never fed
        reply = [t for t in new if t not in tok.stop_ids]
        messages.append({"role": "assistant", "content": tok.decode(reply)})


def main(
    prompt: str,
    interactive: bool,
    chat: bool,
    system: str | None,
    prompts_file: Path | None,
    num_samples: int,
    max_new_tokens: int,
    batch_size: int,
    top_k: int | None,
    top_p: float,
    temperature: float,
    seed: int | None,
    ignore_eos: bool,
    checkpoint_path: Path | None,
    compile: bool,
    compile_prefill: bool,
    profile: Path | None,
    speculate_k: int,
    speculate_ngram: int | None,
    draft_checkpoint_path: Path | None,
    device: str | None,
    precision: str | None,
    max_seq_length: int | None,
    kernels: bool,
    moe_parallel: str,
):
    try:
        check_sampling(temperature, top_k, top_p)
        check_counts(
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            max_seq_length=max_seq_length,
        )
        if seed is not None and not 0 <= seed < 2**63:
            raise UserError(f"--seed must be in [0, 2**63), got {seed}")
        if profile is not None and (profile.is_dir() or not profile.parent.is_dir()):
            raise UserError(f"--profile {profile}: not a file path in an existing folder")
        dev = pick_device(device)
        rank, world = tp.maybe_init_distributed(dev)  # torchrun: one rank per GPU
        if checkpoint_path is None:
            checkpoint_path = DEFAULT_CHECKPOINT
            if not checkpoint_path.is_file():
                raise UserError(
                    f"the default model is not prepared ({checkpoint_path} is missing): "
                    "run `bash scripts/prepare.sh` or pass --checkpoint_path"
                )
        if (speculate_ngram or draft_checkpoint_path) and interactive:
            raise UserError("speculative decoding is not available in --interactive mode")
        if interactive and world > 1:
            raise UserError("--interactive is not available under torchrun")
        dtype = PRECISIONS[precision or ("bfloat16" if dev.type == "cuda" else "float32")]
        tp.sync_seed(seed)  # under torchrun, one seed on every rank: all sample the same
        t0 = time.perf_counter()
        tok = get_tokenizer(checkpoint_path.parent)
        model = load_for_rank(checkpoint_path, dev, dtype, kernels, moe_parallel)
        log(f"loaded {checkpoint_path} in {time.perf_counter() - t0:.2f} s")
        run_main(**locals())
    except (UserError, CheckpointError, ConfigError, TokenizerError, tp.TPError) as e:
        sys.exit(f"error: {e}")
    except torch.cuda.OutOfMemoryError as e:  # past the estimates (activations, other processes)
        sys.exit(f"error: {out_of_memory_message(e)}")
    except KeyboardInterrupt:  # Ctrl-C while loading or compiling (generation handles its own)
        log("interrupted")
        sys.exit(130)


def run_main(
    *,
    model,
    tok,
    dev,
    checkpoint_path,
    prompt,
    interactive,
    chat,
    system,
    prompts_file,
    num_samples,
    max_new_tokens,
    batch_size,
    top_k,
    top_p,
    temperature,
    seed,
    ignore_eos,
    compile,
    compile_prefill,
    profile,
    speculate_k,
    speculate_ngram,
    draft_checkpoint_path,
    max_seq_length,
    kernels,
    **_,
):
    block_size = model.config.block_size
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    steps = compile_steps(compile, compile_prefill)
    if max_seq_length is not None and max_seq_length > block_size:
        raise UserError(
            f"--max_seq_length {max_seq_length} exceeds the model's context of {block_size} tokens"
        )
    limit = max_seq_length or block_size  # prompt plus new tokens of one row
    if interactive:
        setup_caches(model, 1, limit)
        run_interactive(model, tok, steps, sampling, max_new_tokens, system, limit)
        return
    if prompts_file is None and is_synthetic(prompt) and int(prompt) >= limit:
        raise too_long(int(prompt), limit, max_seq_length)  # before allocating its tokens
    rows = encode_prompts(
        tok,
        prompt,
        prompts_file,
        chat or interactive,
        system,
        batch_size,
        model.config.vocab_size,
        seed,
    )
    longest = max(len(r) for r in rows)
    if min(len(r) for r in rows) == 0:
        raise UserError("the prompt is empty (it encodes to no tokens)")
    if longest >= limit:
        raise too_long(longest, limit, max_seq_length)
    # At the limit generation stops, and says so after the text (below).
    capped = longest + max_new_tokens > limit
    max_new_tokens = min(max_new_tokens, limit - longest)
    max_seq_len = max_seq_length or cache_length(longest + max_new_tokens, block_size)
    setup_caches(model, len(rows), max_seq_len)
    x, pad = left_pad(rows, dev)
    stop_ids = frozenset() if ignore_eos else frozenset(tok.stop_ids)
    speculative = None
    if speculate_ngram or draft_checkpoint_path:
        import speculative as spec

        try:
            speculative = spec.setup(
                model,
                tok,
                draft_checkpoint_path,
                speculate_k,
                speculate_ngram,
                dev,
                max_seq_len,
                compile,
                batch_size=len(rows),
                use_kernels=kernels,
            )
        except spec.SpeculativeError as e:  # raised through the module `generate`, not __main__
            raise UserError(str(e)) from e
    nbytes = weight_bytes(model)
    stream_one = len(rows) == 1
    rates = []
    for i in range(-1 if compile else 0, num_samples):
        warmup = i < 0
        decoder = StreamDecoder(tok)
        shown = [[] for _ in rows]  # each row's new tokens so far, for an interrupted run

        def show(tokens, decoder=decoder, warmup=warmup, shown=shown):
            for row, t in zip(shown, tokens):
                row.append(t)
            if stream_one and not warmup and tokens[0] not in stop_ids:
                print(decoder.push(tokens[0]), end="", flush=True)

        prof = (
            torch.profiler.profile()
            if profile is not None and i == num_samples - 1
            else contextlib.nullcontext()
        )
        sync(dev)
        t0 = time.perf_counter()
        try:
            with prof:
                if speculative is not None:
                    out = spec.generate(
                        speculative, x, max_new_tokens, stop_ids=stop_ids, on_token=show, **sampling
                    )
                else:
                    out = generate(
                        model,
                        x,
                        max_new_tokens,
                        pad=pad,
                        stop_ids=stop_ids,
                        on_token=show,
                        **sampling,
                        **steps,
                    )
            sync(dev)
        except KeyboardInterrupt:
            # Ctrl-C: print what this sample has so far, then exit as an interrupted program does.
            if warmup:
                pass
            elif stream_one:
                print(decoder.flush(), flush=True)
            else:
                for row in shown:
                    end = next((j for j, t in enumerate(row) if t in stop_ids), len(row))
                    print(tok.decode(row[:end]), flush=True)
            log(f"interrupted after {len(shown[0])} new tokens")
            sys.exit(130)
        dt = time.perf_counter() - t0
        if profile is not None and i == num_samples - 1:
            prof.export_chrome_trace(str(profile))
            log(f"profile written to {profile}")
        if warmup:
            log(f"compilation and warm-up took {dt:.2f} s")
            continue
        if stream_one:
            print(decoder.flush(), flush=True)
        else:
            for row in out:
                print(tok.decode([t for t in row if t not in stop_ids]), flush=True)
        if capped and any(len(r) == max_new_tokens and r[-1] not in stop_ids for r in out):
            log(f"stopped at the context limit: {longest + max_new_tokens} of {limit} tokens")
        n = sum(len(r) for r in out)
        rates.append(n / dt)
        log(
            f"sample {i}: {n} tokens in {dt:.2f} s, {n / dt:.2f} tok/s, "
            f"{nbytes * n / len(out) / dt / 1e9:.2f} GB/s"
        )
        if speculative is not None:
            spec.report(speculative)
    if rates:
        avg = sum(rates) / len(rates)
        log(f"average {avg:.2f} tok/s over {len(rates)} samples, {nbytes / 1e9:.2f} GB of weights")
    if dev.type == "cuda":
        log(f"peak memory {torch.cuda.max_memory_allocated(dev) / 1e9:.2f} GB")


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Generate text with a fastgen checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--prompt",
        default="Hello, my name is",
        help="prompt text, or an integer N for a synthetic N-token prompt",
    )
    p.add_argument(
        "--interactive",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="multi-turn chat; the conversation stays in the KV cache",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="format the prompt with the model's chat template",
    )
    p.add_argument("--system", default=None, help="system message for --chat / --interactive")
    p.add_argument(
        "--prompts_file",
        type=Path,
        default=None,
        help="one prompt per line, generated together as one padded batch",
    )
    p.add_argument("--num_samples", type=int, default=1, help="how many times to generate")
    p.add_argument("--max_new_tokens", type=int, default=200, help="new tokens per sample")
    p.add_argument("--batch_size", type=int, default=1, help="rows, each the same prompt")
    p.add_argument("--top_k", type=int, default=200, help="sample from the k likeliest tokens")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy (argmax)")
    p.add_argument("--seed", type=int, default=None, help="random seed")
    p.add_argument(
        "--ignore_eos",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="do not stop at end-of-sequence tokens (benchmarks)",
    )
    p.add_argument(
        "--checkpoint_path",
        type=Path,
        default=None,
        help=f"model.pth to load (default: {DEFAULT_CHECKPOINT})",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="compile the decode step (CUDA graphs on GPU)",
    )
    p.add_argument(
        "--compile_prefill",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="compile prefill too, with dynamic shapes",
    )
    p.add_argument(
        "--profile", type=Path, default=None, help="write a chrome trace of the last sample here"
    )
    p.add_argument(
        "--speculate_k",
        type=int,
        default=5,
        help="tokens proposed per speculative step; the target checks k+1 in one forward",
    )
    p.add_argument(
        "--speculate_ngram",
        type=int,
        default=None,
        help="prompt-lookup speculation: propose what followed the latest earlier "
        "occurrence of the last N tokens (no draft model)",
    )
    p.add_argument(
        "--draft_checkpoint_path",
        type=Path,
        default=None,
        help="draft model.pth for speculative decoding (any quantization, same tokenizer)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default=None,
        help="weights and activations dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="KV cache length (default: prompt + new tokens, or the context in chat)",
    )
    p.add_argument(
        "--kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="use fastgen's Triton GEMV and attention kernels on CUDA",
    )
    p.add_argument(
        "--moe_parallel",
        choices=tp.MOE_PARALLEL,
        default="tensor",
        help="under torchrun, MoE models: split each expert's hidden units over the ranks "
        "(tensor) or the experts themselves (expert)",
    )
    return p


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))
