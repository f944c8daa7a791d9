# The decode loop, sampling and the generate.py command line on tiny checkpoints.
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convert_hf_checkpoint import convert_hf_checkpoint
from generate import compile_steps, generate, left_pad, logits_to_probs
from helpers import make_hf_model, random_model, save_hf

ROOT = Path(__file__).resolve().parents[1]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def naive_greedy(model, ids: list[int], n: int) -> list[int]:
    # Reference: a full forward over the whole sequence for every token, no cache reuse.
    ids = list(ids)
    out = []
    for _ in range(n):
        model.setup_caches(1, len(ids))
        with torch.no_grad():
            logits = model(torch.tensor([ids]), torch.arange(len(ids)))
        t = int(logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
    return out


def test_greedy_equals_naive_loop():
    model = random_model(num_key_value_heads=2)
    prompt = torch.randint(0, 128, (6,)).tolist()
    ref = naive_greedy(model, prompt, 12)
    model.setup_caches(1, 64)
    got = generate(model, torch.tensor([prompt]), 12, temperature=0)[0]
    assert got == ref


def test_batch_of_prompts_equals_each_alone():
    model = random_model()
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (3, 9, 6)]
    model.setup_caches(3, 64)
    alone = [generate(model, torch.tensor([p]), 10, temperature=0)[0] for p in prompts]
    x, pad = left_pad(prompts, "cpu")
    batched = generate(model, x, 10, pad=pad, temperature=0)
    assert batched == alone


def test_stop_ids_cut_each_row():
    model = random_model()
    model.setup_caches(1, 64)
    free = generate(model, torch.tensor([[1, 2, 3]]), 10, temperature=0)[0]
    stop = free[4]
    cut = generate(model, torch.tensor([[1, 2, 3]]), 10, temperature=0, stop_ids={stop})[0]
    assert cut == free[: free.index(stop) + 1]


def test_decode_step_inputs_share_one_dtype():
    # The step's tensor inputs that change (token, position, sampling seed) share one dtype:
    # CUDA graph trees then copy them into the graph with one foreach kernel, and with one
    # memcpy each when they differ (round 25's H100 profile: about 2.7 us of a step apiece).
    from generate import decode_one_token

    model = random_model()
    model.setup_caches(1, 64)
    seen = []

    def spy(model, x, input_pos, pad, **sampling):
        tensors = (x, input_pos, *sampling.values())
        seen.append({t.dtype for t in tensors if isinstance(t, torch.Tensor)})
        return decode_one_token(model, x, input_pos, pad, **sampling)

    generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0.8, top_k=20, decode_fn=spy)
    assert len(seen) == 3 and all(s == {torch.int64} for s in seen)


def test_compiled_decode_equals_eager():
    model = random_model()
    model.setup_caches(1, 64)
    prompt = torch.tensor([[5, 6, 7, 8]])
    eager = generate(model, prompt, 8, temperature=0)[0]
    steps = compile_steps(compile=True, compile_prefill=True)
    assert generate(model, prompt, 8, temperature=0, **steps)[0] == eager


def test_short_prompt_prefill_by_steps_equals_prefill():
    # With --compile a short prompt goes through the decode step token by token: the same first
    # token and the same cache as one prefill forward, batched and left-padded rows included.
    from functools import partial

    from generate import SHORT_PROMPT, decode_one_token, prefill, prefill_by_steps

    model = random_model(num_key_value_heads=2)
    by_steps = partial(prefill_by_steps, decode_one_token)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (SHORT_PROMPT, 3)]
    x, pad = left_pad(prompts, "cpu")
    for start in (0, 5):  # a fresh cache, and a prompt after earlier turns
        pos = torch.arange(start, start + x.shape[1])
        caches = []
        firsts = []
        for fn in (prefill, by_steps):
            model.setup_caches(2, 64)
            torch.manual_seed(0)
            with torch.no_grad():
                if start:  # the earlier turns: the same tokens in both
                    prefill(model, torch.ones(2, start, dtype=torch.long), torch.arange(start),
                            pad, temperature=0.0, top_k=None, top_p=1.0)  # fmt: skip
                firsts.append(fn(model, x, pos, pad, start == 0, temperature=0.0, top_k=None,
                                 top_p=1.0))  # fmt: skip
            layer = model.layers[-1].attention.kv_cache
            caches.append((layer.k_cache.clone(), layer.v_cache.clone()))
        assert firsts[0].tolist() == firsts[1].tolist()
        for a, b in zip(caches[0], caches[1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Longer prompts take prefill itself.
    long = torch.randint(0, 128, (1, SHORT_PROMPT + 1))
    model.setup_caches(1, 64)
    calls = []

    def counting_step(*args, **kwargs):
        calls.append(1)
        return decode_one_token(*args, **kwargs)

    with torch.no_grad():
        prefill_by_steps(counting_step, model, long, torch.arange(long.shape[1]), None, True,
                         temperature=0.0, top_k=None, top_p=1.0)  # fmt: skip
    assert not calls


def test_sampling_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = logits_to_probs(logits, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    p = logits_to_probs(logits, 1.0, top_p=float(full[0]) + 1e-3)  # needs the top two
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    p = logits_to_probs(logits, 1.0, top_p=0.01)  # the top token always stays
    assert p[0, 0] == 1
    torch.manual_seed(0)
    model = random_model()
    model.setup_caches(1, 64)
    # Sampled tokens must stay inside top_k=1, i.e. equal greedy.
    greedy = generate(model, torch.tensor([[1, 2]]), 6, temperature=0)[0]
    assert generate(model, torch.tensor([[1, 2]]), 6, temperature=1.0, top_k=1)[0] == greedy


def test_top_k_keeps_ties_with_the_kth_like_hf():
    # Hugging Face's TopKLogitsWarper as the reference: a tie at the k-th logit stays.
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([[3.0, 1.0, 2.0, 1.0, 0.5, 1.0]])
    p = logits_to_probs(logits, 0.5, top_k=3)
    hf = torch.softmax(TopKLogitsWarper(3)(None, logits / 0.5), dim=-1)
    torch.testing.assert_close(p, hf)
    assert (p > 0).sum() == 5


def test_top_k_sampling_draws_from_logits_to_probs():
    # sample's PyTorch path (off CUDA; fastgen_kernels.sample_top_k's draws are tested in
    # test_kernels.py) against the distribution logits_to_probs defines: the probs it returns,
    # and 40000 draws by a chi-square test.
    from scipy.stats import chisquare

    from generate import sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1, 64, generator=g) * 2
    want = logits_to_probs(logits[:, -1], 0.7, top_k=6)[0]
    torch.manual_seed(1)
    tokens, probs = sample(logits.expand(40000, 1, 64), 0.7, top_k=6)
    torch.testing.assert_close(probs[0], want, rtol=1e-6, atol=1e-7)
    counts = torch.bincount(tokens.flatten(), minlength=64).double()
    assert counts[want == 0].sum() == 0  # never outside the top 6
    kept = want > 0
    expected = want[kept].double() / want[kept].double().sum() * 40000
    assert chisquare(counts[kept], expected).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_tokenizer(path: Path, vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["Hello, my name is fastgen. The capital of France is Paris."] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            dict(
                bos_token=None, eos_token="<|endoftext|>", add_bos_token=False, chat_template=CHATML
            )
        )
    )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    hf = make_hf_model(vocab_size=320, num_key_value_heads=2, tie_word_embeddings=True)
    save_hf(hf, path)
    build_tokenizer(path)
    convert_hf_checkpoint(path)
    return path / "model.pth"


def run(*args, check=True, **kwargs):
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, **kwargs
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_end_to_end_generate(tiny_checkpoint):
    args = [
        "generate.py",
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--device",
        "cpu",
        "--temperature",
        "0",
        "--max_new_tokens",
        "12",
        "--ignore_eos",
    ]
    proc = run(*args, "--prompt", "Hello, my name is")
    assert "tok/s" in proc.stderr and "GB/s" in proc.stderr
    assert "tok/s" not in proc.stdout
    # The same text through the library equals what the script printed.
    from generate import load_model
    from tokenizer import get_tokenizer

    tok = get_tokenizer(tiny_checkpoint.parent)
    model = load_model(tiny_checkpoint, "cpu", torch.float32)
    model.setup_caches(1, 64)
    ids = generate(model, torch.tensor([tok.encode("Hello, my name is")]), 12, temperature=0)[0]
    assert proc.stdout.strip() == tok.decode(ids).strip()
    chat = run(*args, "--chat", "--prompt", "Hi", "--compile")
    assert chat.stdout.strip()


def test_prompts_file(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nThe capital of France is a long prompt\n")
    base = [
        "generate.py",
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--temperature",
        "0",
        "--max_new_tokens",
        "6",
        "--ignore_eos",
    ]
    batched = run(*base, "--prompts_file", str(prompts)).stdout.splitlines()
    alone = [run(*base, "--prompt", p).stdout.strip() for p in prompts.read_text().splitlines()]
    assert [b.strip() for b in batched] == alone


def test_interactive_keeps_conversation(tiny_checkpoint):
    proc = run(
        "generate.py",
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--interactive",
        "--temperature",
        "0",
        "--max_new_tokens",
        "5",
        input="Hello\nParis\n",
    )
    assert proc.stdout.count("Assistant:") == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--checkpoint_path", "nowhere/model.pth"], "does not exist"),
        (["--device", "tpu"], "device"),
        (["--device", "cuda:0"], "not available"),
        (["--temperature", "-1"], "--temperature"),
        (["--top_p", "0"], "--top_p"),
        (["--top_p", "1.5"], "--top_p"),
        (["--top_k", "0"], "--top_k"),
        (["--prompt", "300"], "context"),
    ],
)
def test_bad_input_is_one_line(tiny_checkpoint, extra, message):
    if "cuda:0" in extra and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args = ["generate.py", "--checkpoint_path", str(tiny_checkpoint), *extra]
    proc = run(*args, check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_mismatched_checkpoint_names_tensor(tiny_checkpoint, tmp_path):
    for name in tiny_checkpoint.parent.iterdir():
        if name.name != "model.pth" and name.is_file():
            (tmp_path / name.name).write_bytes(name.read_bytes())
    state = torch.load(tiny_checkpoint, weights_only=True)
    state["layers.1.feed_forward.w2.weight"] = state["layers.1.feed_forward.w2.weight"][:, :10]
    torch.save(state, tmp_path / "model.pth")
    proc = run("generate.py", "--checkpoint_path", str(tmp_path / "model.pth"), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "layers.1.feed_forward.w2.weight" in proc.stderr and "(64, 10)" in proc.stderr


def test_missing_default_checkpoint_says_how_to_prepare(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "generate.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "prepare.sh" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and kernels need a GPU")
def test_no_recompiles_while_decoding():
    # After warm-up, prompts of other lengths (so other cache positions) run the same compiled
    # prefill and decode graphs: a recompile raises under this stance. A run's sampling
    # settings are fixed; both kinds (sampled and greedy) are warmed up.
    from generate import setup_for_device

    model = random_model(hidden_size=256, num_key_value_heads=2).to("cuda", torch.bfloat16)
    setup_for_device(model, "cuda")
    model.setup_caches(1, 512)
    steps = compile_steps(compile=True, compile_prefill=True)
    g = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(0, 128, (1, n), generator=g).cuda()

    generate(model, prompt(7), 20, temperature=0.8, top_k=50, **steps)
    generate(model, prompt(12), 20, temperature=0, top_k=50, **steps)
    with torch.compiler.set_stance("fail_on_recompile"):
        for n, temperature in ((3, 0.8), (30, 0), (100, 0.8), (250, 0)):
            out = generate(model, prompt(n), 40, temperature=temperature, top_k=50, **steps)
            assert len(out[0]) == 40


def test_weight_bytes_counts_what_a_step_reads():
    # The embedding table is a row lookup: a step reads it only as a tied output head.
    from generate import weight_bytes

    for tied in (False, True):
        model = random_model(tie_word_embeddings=tied)
        table = model.tok_embeddings.weight
        every = sum(t.numel() * t.element_size() for t in {*model.parameters()})
        assert weight_bytes(model, per_token=False) == every
        read = every - (0 if tied else table.numel() * table.element_size())
        assert weight_bytes(model) == read
