# Speculative decoding for generate.py: a draft model or prompt lookup proposes k tokens, the
# target checks all of them in one forward of k+1 positions, and an acceptance rule keeps the
# output distributed exactly as plain sampling from the target would be.
#
#   python generate.py --draft_checkpoint_path checkpoints/small/model.pth --speculate_k 5
#   python generate.py --speculate_ngram 3 --speculate_k 8 --chat --prompt "Repeat this: ..."
#
#   import speculative as spec
#   speculator = spec.setup(model, tok, None, 8, 3, device, max_seq_len, compile=True)
#   rows = spec.generate(speculator, prompt, 200, temperature=0)  # prompt [1, T] -> [[ids]]
#   spec.report(speculator)  # or read speculator.stats (SpecStats) yourself
#
# Acceptance (Leviathan et al. 2023; Chen et al. 2023). Where the target gives p and the draft
# drew token d from q, d is kept with probability min(1, p(d) / q(d)); at the first rejection the
# token is drawn from max(0, p - q) renormalised instead, and when all k are kept a bonus token
# is drawn from the target's next distribution. Every emitted token then follows p exactly.
# Prompt lookup has no distribution: its proposal is a point mass q = one_hot(d), so d is kept
# with probability p(d) and otherwise the token comes from p with d removed, which is again p.
# Greedy (temperature 0) keeps d while d == argmax p and emits argmax p after the last keep.
# Temperature, top_k and top_p go through generate.logits_to_probs for target and draft alike, so
# the result equals plain sampling under the same filters.
#
# Rollback is by position, with no cache copies. The slots of rejected tokens keep stale keys and
# values, but each forward writes its own slots before attending and attends only to slots <= its
# positions (model.forward's mask), so a stale slot is overwritten before anything reads it.
#
# The draft's cache follows the same rule. Each round's first draft forward feeds two tokens,
# the one before the newest and the newest: the first is already in the draft's cache (written
# again, harmlessly) unless all k proposals were kept, and then it is the k-th proposal, which
# the draft sampled but never fed. Tokens the draft never saw (the prompt, plain steps) are fed
# in one catch-up forward before the round.
#
# Adaptivity. A round costs a target forward of k+1 tokens plus k draft steps and yields n+1
# tokens; when few proposals are kept it is slower than plain decoding. Every step is timed (one
# host sync per step is needed anyway to learn n); over the last PROBE_STEPS steps the
# speculative rate is compared with plain decoding's, measured in short bursts of plain steps
# (the first right after the first timed step). When speculation loses, plain steps run before
# it is tried again: long enough that the probe's lost time is a small share (PROBE_COST) of
# theirs, at least FIRST_FALLBACK tokens, doubling while it keeps losing, at most MAX_FALLBACK.
# Speculation's overhead where it cannot pay stays near PROBE_COST. When even the fastest of
# two rounds, all k proposals kept, would lose (a draft about as slow as the target), no
# acceptance can help: MAX_FALLBACK at once. With no n-gram match a round is one plain step.
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

import tp
from generate import (
    CheckpointError,
    compile_steps,
    load_for_rank,
    log,
    logits_to_probs,
    race,
    read_config,
    read_later,
    sample,
)
from model import ConfigError, Transformer
from tokenizer import Tokenizer, TokenizerError, get_tokenizer

# Must encode alike with both tokenizers: letters, digits, spaces, accents, CJK, markup, a special.
PROBE_TEXT = "Draft and target: 3 tokens, 1 check.  naïve café, 東京 <b>x</b>\n\t<|im_end|> end"
PROBE_STEPS = 4  # timed speculative steps in a verdict
MEASURE_TOKENS = 8  # plain steps that measure plain decoding's rate
FIRST_FALLBACK = 16  # plain tokens after speculation first loses
MAX_FALLBACK = 2048  # at 250 tok/s, probes that lose 0.25 s (draft catch-up included) cost 3%
PROBE_COST = 0.03  # a losing probe's lost time, at most this share of the fallback after it
WARMUP_STEPS = 3  # the first steps compile and capture CUDA graphs: never timed


class SpeculativeError(Exception):
    pass


@dataclass
class SpecStats:
    k: int
    accepted: list[int]  # accepted[n]: verify steps that kept n of their k proposals
    plain_tokens: int = 0  # tokens from target-only steps (no n-gram match, adaptive fallback)
    plain_seconds: float = 0.0  # time those steps took
    tokens: int = 0  # all new tokens, the one from prefill included
    seconds: float = 0.0

    @property
    def verify_steps(self) -> int:
        return sum(self.accepted)

    @property
    def mean_accepted(self) -> float:
        # proposals kept per verify step; each step also emits one token of its own
        return sum(n * c for n, c in enumerate(self.accepted)) / max(self.verify_steps, 1)


@dataclass
class Speculator:
    target: Transformer
    draft: Transformer | None  # None: prompt lookup
    k: int
    ngram: int | None
    verify_fn: Callable
    draft_fn: Callable
    decode_fn: Callable
    prefill_fn: Callable
    adaptive: bool = True
    stats: SpecStats | None = None  # of the latest generate()
    # Adaptive state, kept across calls: costs do not change with the prompt.
    plain_rate: float | None = None  # tokens/s of plain decoding, from timed bursts
    fallback: int = FIRST_FALLBACK  # plain tokens to run the next time speculation loses
    steps_seen: int = 0
    bursts_seen: int = 0
    plain_pending: int = 0  # fallback tokens a call ended before running: the next call runs them


# ---------------------------------------------------------------------------------------------
# Proposals
# ---------------------------------------------------------------------------------------------


@dataclass
class NgramIndex:
    n: int
    last_start: dict[tuple[int, ...], int] = field(default_factory=dict)  # latest start per n-gram
    indexed: int = 0  # starts below this are in last_start


def propose_ngram(index: NgramIndex, history: list[int], k: int) -> list[int] | None:
    # k tokens that followed the latest earlier occurrence of history's last n tokens, or None.
    n = index.n
    # Only starts with at least one token after the n-gram are useful; history only grows.
    for j in range(index.indexed, len(history) - n):
        index.last_start[tuple(history[j : j + n])] = j
    index.indexed = max(index.indexed, len(history) - n)
    j = index.last_start.get(tuple(history[-n:]))
    if j is None:
        return None
    # Past the end of history keep copying from the proposal itself: a repeating pattern goes on.
    proposal: list[int] = []
    for i in range(j + n, j + n + k):
        proposal.append(history[i] if i < len(history) else proposal[i - len(history)])
    return proposal


def draft_step(
    model: Transformer, x: Tensor, input_pos: Tensor, temperature: float, top_k, top_p
) -> tuple[Tensor, Tensor | None]:
    # x [1, T] at slots input_pos [T] -> token [1, 1] and the distribution it came from [1, vocab]
    # (None when greedy).
    logits = model(x, input_pos, last_logits_only=True)
    return sample(logits, temperature, top_k, top_p)


# ---------------------------------------------------------------------------------------------
# Verification: one target forward over the newest token and k proposals, acceptance on device
# ---------------------------------------------------------------------------------------------


def verify(
    model: Transformer,
    x: Tensor,
    input_pos: Tensor,
    draft_probs: Tensor | None,
    temperature: float,
    top_k: int | None,
    top_p: float,
) -> Tensor:
    # x [1, k+1]: the newest token, then k proposals, at slots input_pos [k+1]; draft_probs
    # [k, vocab] the distributions the proposals were drawn from (None: point masses).
    # -> [2]: n, how many proposals were kept, then the token that follows the kept ones.
    logits = model(x, input_pos)[0].float()  # [k+1, vocab]
    proposed = x[0, 1:]  # [k]
    if temperature == 0:
        best = logits.argmax(dim=-1)  # [k+1]
        n = (proposed == best[:-1]).long().cumprod(0).sum(0, keepdim=True)  # [1] leading matches
        return torch.cat([n, best.gather(0, n)])
    p = logits_to_probs(logits, temperature, top_k, top_p)  # [k+1, vocab]
    if draft_probs is None:
        q = torch.zeros_like(p[:-1]).scatter_(1, proposed[:, None], 1.0)  # [k, vocab]
    else:
        q = draft_probs
    p_at = p[:-1].gather(1, proposed[:, None])[:, 0]  # [k]
    q_at = q.gather(1, proposed[:, None])[:, 0]  # [k], > 0: the proposals were drawn from q
    # Keep with probability min(1, p/q): u * q < p, u ~ U[0, 1), with no division.
    kept = torch.rand_like(p_at) * q_at < p_at
    n = kept.long().cumprod(0).sum(0, keepdim=True)  # [1]
    # Row n of max(0, p - q): the residual at the first rejection, or p itself after k keeps.
    # (index_select, not p[n]: indexing by a tensor value would make the graph data-dependent.)
    q = torch.cat([q, torch.zeros_like(q[:1])])  # [k+1, vocab]
    p_n = p.index_select(0, n)  # [1, vocab]
    residual = (p_n - q.index_select(0, n)).clamp(min=0)
    # Where p == q nothing is left, but then rejection had probability 0 (rounding): use p.
    residual = torch.where(residual.sum() > 0, residual, p_n)
    return torch.cat([n, race(residual)[0]])  # the residual needs no normalising


# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------


def spelling(tok: Tokenizer, token_id: int) -> str | None:
    try:
        return tok.decode_ids([token_id])
    except Exception:  # noqa: BLE001 - backends differ in how they refuse an id they lack
        return None


def check_tokenizers(tok: Tokenizer, target: Transformer, draft_path: Path) -> None:
    try:
        config = read_config(draft_path)
        draft_tok = get_tokenizer(draft_path.parent)
    except (CheckpointError, ConfigError, TokenizerError) as e:
        raise SpeculativeError(f"draft checkpoint {draft_path}: {e}") from e
    if config.vocab_size != target.config.vocab_size:
        raise SpeculativeError(
            f"draft checkpoint {draft_path} has vocab_size {config.vocab_size}, the target "
            f"{target.config.vocab_size}: draft and target must share a tokenizer"
        )
    # A probe text, the special tokens, and the spelling of up to ~1000 ids spread over the vocab.
    ids = range(0, config.vocab_size, max(1, config.vocab_size // 1000))
    same = (
        draft_tok.encode(PROBE_TEXT, allow_special=True)
        == tok.encode(PROBE_TEXT, allow_special=True)
        and draft_tok.special_tokens == tok.special_tokens
        and (draft_tok.bos_id, draft_tok.eos_id) == (tok.bos_id, tok.eos_id)
        and [spelling(draft_tok, i) for i in ids] == [spelling(tok, i) for i in ids]
    )
    if not same:
        raise SpeculativeError(
            f"the tokenizer beside draft checkpoint {draft_path} differs from the target's: "
            "draft and target must share a tokenizer"
        )


def setup(
    model: Transformer,
    tok: Tokenizer,
    draft_checkpoint_path: Path | None,
    speculate_k: int,
    speculate_ngram: int | None,
    device: torch.device | str,
    max_seq_len: int,
    compile: bool,
    *,
    batch_size: int = 1,
    adaptive: bool = True,
    draft: Transformer | None = None,
    use_kernels: bool = True,
) -> Speculator:
    # model: the target, its caches set up for max_seq_len. A draft checkpoint is loaded in the
    # target's dtype (under torchrun, sharded like the target), after its tokenizer is checked
    # against tok. draft: an already loaded draft model instead (benchmarks, tests), whose
    # tokenizer the caller vouches for.
    if batch_size != 1:
        raise SpeculativeError(f"speculative decoding takes one prompt at a time, not {batch_size}")
    if speculate_k < 1:
        raise SpeculativeError(f"--speculate_k must be >= 1, got {speculate_k}")
    if sum(x is not None for x in (draft_checkpoint_path, draft, speculate_ngram)) != 1:
        raise SpeculativeError("give exactly one of --draft_checkpoint_path and --speculate_ngram")
    if speculate_ngram is not None and speculate_ngram < 1:
        raise SpeculativeError(f"--speculate_ngram must be >= 1, got {speculate_ngram}")
    if draft is not None and draft.config.vocab_size != model.config.vocab_size:
        raise SpeculativeError(
            f"the draft's vocab_size {draft.config.vocab_size} differs from the target's "
            f"{model.config.vocab_size}"
        )
    if draft_checkpoint_path is not None:
        draft_checkpoint_path = Path(draft_checkpoint_path)
        check_tokenizers(tok, model, draft_checkpoint_path)
        t0 = time.perf_counter()
        try:
            draft = load_for_rank(
                draft_checkpoint_path, device, model.norm.weight.dtype, use_kernels
            )
        except (CheckpointError, ConfigError, tp.TPError) as e:
            raise SpeculativeError(f"draft: {e}") from e
        log(f"loaded draft {draft_checkpoint_path} in {time.perf_counter() - t0:.2f} s")
    if draft is not None:
        draft.setup_caches(1, max_seq_len)
    verify_fn, draft_fn = verify, draft_step
    steps = compile_steps(compile, compile_prefill=False)  # short prompts through decode_fn
    if compile:
        # Static shapes: verify always sees k+1 tokens; the draft 2 (a round's first step) or 1.
        verify_fn = torch.compile(verify, mode="reduce-overhead", fullgraph=True, dynamic=False)
        draft_fn = torch.compile(draft_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return Speculator(
        target=model,
        draft=draft,
        k=speculate_k,
        ngram=speculate_ngram,
        verify_fn=verify_fn,
        draft_fn=draft_fn,
        decode_fn=steps["decode_fn"],
        prefill_fn=steps["prefill_fn"],
        adaptive=adaptive,
    )


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def speculate_round(
    spec: Speculator, history: list[int], proposal: list[int] | None, draft_valid: int, sampling
) -> tuple[list[int], int]:
    # One verify step after history[-1], the newest token (sampled, not yet in any cache).
    # proposal: the n-gram proposal, or None to draw k tokens from the draft model, whose cache
    # holds the right keys and values in slots [0, draft_valid).
    # -> the new tokens (kept proposals and the one after them) and n, the proposals kept.
    k, device = spec.k, spec.target.freqs_cis.device
    pos = len(history) - 1
    positions = torch.arange(pos - 1, pos + k + 1, device=device)  # [k+2]
    if proposal is not None:
        x = torch.tensor([history[-1:] + proposal], device=device)  # [1, k+1]
        probs = None
    else:
        draft = spec.draft
        if draft_valid < pos - 1:  # catch up on tokens the draft never saw
            seen = torch.tensor([history[draft_valid : pos - 1]], device=device)
            seen_pos = torch.arange(draft_valid, pos - 1, device=device)
            draft(seen, seen_pos, last_logits_only=True, from_zero=draft_valid == 0)
        last_two = torch.tensor([history[-2:]], device=device)  # [1, 2]
        # Outputs are cloned: a CUDA graph's next replay overwrites them.
        token, p = spec.draft_fn(draft, last_two, positions[:2], **sampling)
        tokens, dists = [token.clone()], [p.clone() if p is not None else None]
        for j in range(1, k):
            token, p = spec.draft_fn(draft, tokens[-1], positions[j + 1 : j + 2], **sampling)
            tokens.append(token.clone())
            dists.append(p.clone() if p is not None else None)
        x = torch.cat([last_two[:, 1:], *tokens], dim=1)  # [1, k+1]
        probs = None if dists[0] is None else torch.cat(dists)  # [k, vocab]
    out = spec.verify_fn(spec.target, x, positions[1:], probs, **sampling)
    vals = torch.cat([x[0, 1:], out]).tolist()  # the one host sync of the step
    n = vals[k]
    return vals[:n] + [vals[k + 1]], n


def plain_steps(
    spec: Speculator, history: list[int], n: int, stop_ids, on_token, sampling, until=None
) -> list[int]:
    # Up to n target-only steps after history[-1], cut after a stop token, or once until(out)
    # is true for the tokens so far. As in generate.generate, step i+1 is launched before token
    # i is read (read_later: without waiting for step i+1), so the host's look at each token
    # overlaps the device's next step; when until fires, the token already in flight is kept and
    # judged too.
    pos = torch.tensor([len(history) - 1], device=spec.target.freqs_cis.device)
    out: list[int] = []

    def launch(token: Tensor) -> tuple[Tensor, Callable]:  # token [1, 1] -> the next, its reader
        nxt = spec.decode_fn(spec.target, token, pos, None, **sampling).clone()
        return nxt, read_later(nxt[0])

    def take(read: Callable) -> bool:  # True when the token read is a stop token
        out.extend(read())
        if on_token is not None:
            on_token(out[-1:])
        return out[-1] in stop_ids

    nxt, read_nxt = launch(torch.tensor([history[-1:]], device=pos.device))
    while len(out) < n:
        read = read_nxt  # token nxt: not read yet, its successor not launched yet
        launched = len(out) + 1 < n
        if launched:
            pos += 1
            nxt, read_nxt = launch(nxt)
        if take(read) or not launched:
            break
        if until is not None and until(out):
            if take(read_nxt) or until(out) or len(out) >= n:
                break
            pos += 1  # the in-flight token broke the match: go on after it
            nxt, read_nxt = launch(nxt)
    return out


def verdict(spec: Speculator, window: deque) -> int:
    # -> plain tokens to decode before speculating again (0: keep speculating)
    if not spec.adaptive or not window:
        return 0
    if spec.plain_rate is None:  # plain decoding's rate first: its tokens are never wasted
        return MEASURE_TOKENS
    fastest = min(s for _, s in window)
    if len(window) >= 2 and (spec.k + 1) / fastest < spec.plain_rate:
        # Even with all k proposals kept, no round matches plain decoding (a draft about as slow
        # as the target): no acceptance can make speculation pay, so back off the longest.
        spec.fallback = MAX_FALLBACK
        window.clear()
        return MAX_FALLBACK
    if len(window) < PROBE_STEPS:
        return 0
    tokens, seconds = sum(t for t, _ in window), sum(s for _, s in window)
    if tokens / seconds >= spec.plain_rate:
        spec.fallback = FIRST_FALLBACK
        return 0
    # Lost: plain steps for long enough that the time this probe lost against plain decoding is
    # at most PROBE_COST of theirs (a badly losing draft backs off at once, a near miss is
    # retried soon), and no fewer than twice the last fallback while it keeps losing.
    lost = seconds - tokens / spec.plain_rate
    n = min(max(spec.fallback, math.ceil(lost * spec.plain_rate / PROBE_COST)), MAX_FALLBACK)
    spec.fallback = min(2 * n, MAX_FALLBACK)
    window.clear()  # judge speculation afresh when it resumes
    return n


@torch.no_grad()
def generate(
    spec: Speculator,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float = 1.0,
    stop_ids: set[int] | frozenset = frozenset(),
    on_token=None,
) -> list[list[int]]:
    # prompt [1, T] at cache slots 0..T-1 -> [new tokens], cut after the first stop token, like
    # generate.generate. on_token([id]) sees each new token in order. Stats go to spec.stats.
    if prompt.shape[0] != 1:
        raise SpeculativeError(
            f"speculative decoding takes one prompt at a time, not a batch of {prompt.shape[0]}"
        )
    target, k = spec.target, spec.k
    if prompt.shape[1] + max_new_tokens > target.max_seq_len:
        raise SpeculativeError(
            f"prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the KV cache "
            f"({target.max_seq_len})"
        )
    # floats always: an int 0 and a float 0.8 would be two compiled graphs
    sampling = dict(temperature=float(temperature), top_k=top_k, top_p=float(top_p))
    stats = spec.stats = SpecStats(k=k, accepted=[0] * (k + 1))
    start = time.perf_counter()
    history = prompt[0].tolist()  # history[i] sits, or will sit, in cache slot i
    new: list[int] = []

    def keep(tokens: list[int], announce: bool = True) -> bool:
        # Appends tokens; True once a stop token or max_new_tokens ends generation.
        for t in tokens:
            new.append(t)
            history.append(t)
            if announce and on_token is not None:
                on_token([t])
            if t in stop_ids or len(new) >= max_new_tokens:
                return True
        return False

    def plain(n: int, until=None) -> bool:
        # Each token is kept as it is read, so until() sees it in history already.
        t0 = time.perf_counter()
        got = plain_steps(spec, history, n, stop_ids, keep, sampling, until)
        stats.plain_tokens += len(got)
        stats.plain_seconds += time.perf_counter() - t0  # plain_steps ends on a read: synced
        return bool(new) and (new[-1] in stop_ids or len(new) >= max_new_tokens)

    input_pos = torch.arange(len(history), device=prompt.device)
    first = spec.prefill_fn(target, prompt, input_pos, None, True, **sampling)
    done = keep([int(first)])
    ngrams = NgramIndex(spec.ngram) if spec.ngram else None
    draft_valid = 0  # draft cache slots [0, draft_valid) hold the right keys and values
    window: deque = deque(maxlen=PROBE_STEPS)  # (tokens, seconds) of recent timed rounds
    plain_left, spec.plain_pending = spec.plain_pending, 0  # a losing verdict outlives a call
    while not done:
        left = max_new_tokens - len(new)
        room = target.max_seq_len - (len(history) - 1)  # > left: checked above
        if plain_left or room <= k:
            # Adaptive fallback, or too near the cache's end for k+1 slots.
            n = min(plain_left or left, left)
            tokens0, seconds0 = stats.plain_tokens, stats.plain_seconds
            done = plain(n)
            if done and plain_left > n:
                spec.plain_pending = plain_left - n
            if plain_left and spec.bursts_seen:
                rate = (stats.plain_tokens - tokens0) / (stats.plain_seconds - seconds0)
                spec.plain_rate = rate if spec.plain_rate is None else (spec.plain_rate + rate) / 2
            spec.bursts_seen += plain_left > 0
            plain_left = 0
            continue
        t0 = time.perf_counter()
        proposal = propose_ngram(ngrams, history, k) if ngrams else None
        if ngrams and proposal is None:
            # No match: plain steps, pipelined, until the newest tokens have a match. Not timed:
            # the verdict is about speculation.
            done = plain(left, until=lambda out: propose_ngram(ngrams, history, k) is not None)
            continue
        tokens, n = speculate_round(spec, history, proposal, draft_valid, sampling)
        stats.accepted[n] += 1
        draft_valid = len(history) - 1 + n
        made = len(tokens)
        done = keep(tokens)
        spec.steps_seen += 1
        if spec.steps_seen > WARMUP_STEPS:
            window.append((made, time.perf_counter() - t0))
        # Under torchrun every rank must take the same branch, and each has its own clock.
        plain_left = tp.rank0_int(verdict(spec, window), prompt.device)
    stats.tokens = len(new)
    stats.seconds = time.perf_counter() - start
    return [new]


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def report(spec: Speculator) -> None:
    s = spec.stats
    kind = f"{spec.ngram}-gram lookup" if spec.draft is None else "draft model"
    histogram = " ".join(f"{n}:{c}" for n, c in enumerate(s.accepted))
    log(
        f"speculative ({kind}, k={s.k}): {s.verify_steps} verify steps kept n proposals "
        f"[{histogram}]; mean kept {s.mean_accepted:.2f} of {s.k} "
        f"({s.mean_accepted + 1:.2f} tokens per verify); {s.plain_tokens} tokens from plain steps "
        f"in {s.plain_seconds:.2f} s; "
        f"{s.tokens} tokens in {s.seconds:.2f} s, {s.tokens / max(s.seconds, 1e-9):.2f} tok/s"
    )
