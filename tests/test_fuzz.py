# Fuzzing with hypothesis, bounded: each test has a fixed number of examples and a derandomized
# seed (the same inputs on every run, so CI cannot flake), and the file runs in about a minute.
# Tokenizers round-trip random text; the converters meet truncated, bit-flipped and misshaped
# inputs; every script meets random argument combinations. What may come out is a result or a
# one-line error: never a traceback, never a hang.
import io
import json
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hardening import HF_CONFIG, evil_pickle, hf_state_dict, run_main
from test_tokenizer import (  # noqa: F401 - module fixtures, reused
    hf_tokenizer_json,
    make_hf_dir,
    sp_dir,
    tiktoken_dir,
    tiktoken_ranks,
)

import convert_gguf
import convert_hf_checkpoint
import eval as fastgen_eval
import generate
import quantize
from helpers import save_tiny_checkpoint
from tokenizer import StreamDecoder, get_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def bounded(n: int):
    return settings(
        max_examples=n,
        deadline=None,  # per-example time varies with the machine; the count bounds the total
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def assert_one_line(message: str):
    assert message.strip() and "\n" not in message.strip(), repr(message)


# ---------------------------------------------------------------------------------------------
# Tokenizers: random unicode round-trips, random ids never crash
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers(sp_dir, tiktoken_dir, hf_tokenizer_json, tmp_path_factory):  # noqa: F811
    hf_dir = make_hf_dir(tmp_path_factory.mktemp("hf_fuzz"), hf_tokenizer_json)
    folders = {"sentencepiece": sp_dir, "tiktoken": tiktoken_dir, "tokenizers": hf_dir}
    return {name: get_tokenizer(folder) for name, folder in folders.items()}


# Pieces that tokenizers treat specially: special and added tokens typed as text (encode does not
# turn them into their ids unless asked), byte fallback, whitespace runs, NUL.
PIECES = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "<unk>",
    "<think>",
    "<|begin_of_text|>",
    " ",
    "  ",
    "\n",
    "\t",
    "\x00",
    "é",
    "日本",
    "🚀",
    "▁",
    "Ġ",
    "12",
]
texts = st.one_of(st.text(max_size=40), st.lists(st.sampled_from(PIECES), max_size=8).map("".join))


@bounded(150)
@given(text=texts, ids=st.lists(st.integers(0, 399), max_size=20))
def test_tokenizers_round_trip_random_unicode(tokenizers, text, ids):
    for name, tok in tokenizers.items():
        # SentencePiece writes spaces as "▁" (U+2581), so a "▁" in the text comes back as a
        # space, in the sentencepiece library as here; everything else comes back exactly.
        expected = text.replace("▁", " ") if name == "sentencepiece" else text
        encoded = tok.encode(text, bos=False)
        assert tok.decode(encoded) == expected, name
        # Any ids in the vocabulary decode, all at once or streamed, without an exception.
        tok.decode(ids)
        stream = StreamDecoder(tok)
        streamed = "".join(stream.push(i) for i in encoded) + stream.flush()
        assert streamed == expected, name


# ---------------------------------------------------------------------------------------------
# GGUF: truncated and bit-flipped files
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> tuple[bytes, int]:
    import gguf
    from test_gguf import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path)
    header = min(t.data_offset for t in gguf.GGUFReader(path).tensors)
    return path.read_bytes(), header  # flips below `header` hit metadata, the fragile part


@bounded(60)
@given(
    cut=st.one_of(st.none(), st.floats(0, 1)),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)), max_size=3),
    in_header=st.booleans(),
)
def test_convert_gguf_on_truncated_and_bit_flipped_files(gguf_bytes, cut, flips, in_header):
    data, header = gguf_bytes
    data = bytearray(data)
    span = header if in_header else len(data)
    for where, bit in flips:
        data[min(int(where * span), len(data) - 1)] ^= 1 << bit
    if cut is not None:
        data = data[: int(cut * len(data))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzzed.gguf"
        path.write_bytes(bytes(data))
        try:
            convert_gguf.convert_gguf(path, Path(tmp) / "ckpt", progress=False)
        except convert_gguf.ConversionError as e:
            assert_one_line(str(e))
            assert not (Path(tmp) / "ckpt" / "model.pth").exists()


# ---------------------------------------------------------------------------------------------
# HF checkpoints: missing, extra and misshaped tensors, through conversion and loading
# ---------------------------------------------------------------------------------------------

HF_NAMES = sorted(hf_state_dict())
EXTRA_NAMES = [
    "model.layers.2.mlp.up_proj.weight",  # a layer the config does not have
    "model.layers.0.mlp.bogus.weight",
    "model.layers.1.self_attn.q_proj.bias",
    "lm_head.bias",
    "model.something_else",
    "model.layers.0.self_attn.rotary_emb.inv_freq",  # harmless: HF recomputes it
]
mutation = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(HF_NAMES)),
    st.tuples(st.just("extra"), st.sampled_from(EXTRA_NAMES)),
    st.tuples(
        st.just("reshape"),
        st.sampled_from(HF_NAMES),
        st.lists(st.sampled_from([0, 1, 3, 16, 31, 32, 33, 48, 64]), min_size=1, max_size=3),
    ),
)


@bounded(50)
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_convert_hf_on_missing_extra_and_misshaped_tensors(mutations):
    from safetensors.torch import save_file

    state = hf_state_dict()
    for kind, name, *shape in mutations:
        if kind == "drop":
            state.pop(name, None)
        elif kind == "extra":
            state[name] = torch.randn(8)
        else:
            state[name] = torch.randn(shape[0])
    base = hf_state_dict()
    harmless = set(state) - {n for n in state if n.endswith("inv_freq")} == set(base) and all(
        state[n].shape == base[n].shape for n in base
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(HF_CONFIG))
        save_file(state, folder / "model.safetensors")
        try:
            with redirect_stderr(io.StringIO()):  # the progress bar
                convert_hf_checkpoint.convert_hf_checkpoint(folder)
            generate.load_model(folder / "model.pth", "cpu", torch.float32)
        except (convert_hf_checkpoint.ConversionError, generate.CheckpointError) as e:
            assert_one_line(str(e))
            assert not harmless, e  # a valid checkpoint must convert and load
            return
    assert harmless, "a broken checkpoint converted and loaded"


# ---------------------------------------------------------------------------------------------
# Every script on random arguments, in-process (cheap) and a few as real subprocesses
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_fuzz")
    tiny = save_tiny_checkpoint(root / "tiny", max_position_embeddings=128)
    evil = root / "evil"
    evil.mkdir()
    for f in (root / "tiny").glob("*.json"):
        (evil / f.name).write_text(f.read_text())
    evil_pickle(evil / "model.pth", root / "pwned")
    (root / "garbage.pth").write_bytes(b"\x80\x04 not a checkpoint")
    (root / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    (root / "prompts.txt").write_text("Hello\nThe capital of France is\n")
    (root / "empty.txt").write_text("\n\n")
    (root / "out").mkdir()
    from test_gguf import write_gguf

    write_gguf(root / "tiny.gguf")
    (root / "truncated.gguf").write_bytes((root / "tiny.gguf").read_bytes()[:5000])
    return dict(
        root=root,
        tiny=tiny,
        evil=evil / "model.pth",
        garbage=root / "garbage.pth",
        missing=root / "nowhere" / "model.pth",
        folder=root,
        binary=root / "binary.txt",
        prompts=root / "prompts.txt",
        empty=root / "empty.txt",
        gguf=root / "tiny.gguf",
        truncated=root / "truncated.gguf",
        marker=root / "pwned",
    )


def flag_values(files: dict) -> dict:
    # Per script: flag -> strategy of its values (None: a boolean flag given bare).
    paths = st.sampled_from(["tiny", "evil", "garbage", "missing", "folder"]).map(
        lambda k: str(files[k])
    )
    ints = st.sampled_from(["-1", "0", "1", "3", "17", "99999999999", "x", "1e3"])
    floats = st.sampled_from(["-1", "0", "0.5", "1", "2", "nan", "inf", "x"])
    out_file = st.sampled_from(["new", "nofolder", "folder"]).map(
        lambda k: str(
            {
                "new": files["root"] / "out" / "o.pth",
                "nofolder": files["missing"],
                "folder": files["root"],
            }[k]
        )
    )
    return {
        "generate": {
            "--checkpoint_path": paths,
            "--prompt": st.sampled_from(["", "0", "5", "127", "500", "²", "Hello", "a\x00b"]),
            "--prompts_file": st.sampled_from(
                ["prompts", "empty", "binary", "missing", "folder"]
            ).map(lambda k: str(files[k])),
            "--chat": st.none(),
            "--system": st.text(max_size=10),
            "--interactive": st.none(),
            "--num_samples": st.sampled_from(["-1", "0", "1", "2"]),
            "--max_new_tokens": ints,
            "--batch_size": st.sampled_from(["-1", "0", "1", "3"]),
            "--top_k": ints,
            "--top_p": floats,
            "--temperature": floats,
            "--seed": ints,
            "--ignore_eos": st.none(),
            "--speculate_k": st.sampled_from(["-1", "0", "2"]),
            "--speculate_ngram": st.sampled_from(["-1", "0", "2"]),
            "--draft_checkpoint_path": paths,
            "--device": st.sampled_from(["cpu", "cuda", "cuda:7", "tpu", "", "cpu:0"]),
            "--precision": st.sampled_from(["float32", "bfloat16", "int3"]),
            "--max_seq_length": ints,
            "--profile": out_file,
        },
        "quantize": {
            "--checkpoint_path": paths,
            "--mode": st.sampled_from(["int8", "int4", "fp8", "int4-gptq", "int2"]),
            "--groupsize": st.sampled_from(["32", "64", "7", "-1"]),
            "--skip_output": st.none(),
            "--calibration_file": st.sampled_from(["prompts", "binary", "missing", "empty"]).map(
                lambda k: str(files[k])
            ),
            "--calibration_limit": st.sampled_from(["-1", "0", "1", "2"]),
            "--calibration_seq_length": st.sampled_from(["-1", "0", "1", "8"]),
            "--percdamp": floats,
            "--blocksize": st.sampled_from(["-1", "0", "32"]),
            "--device": st.sampled_from(["cpu", "cuda", "tpu"]),
            "--output_path": out_file,
        },
        "convert_hf_checkpoint": {
            "--checkpoint_dir": st.sampled_from(["folder", "missing"]).map(lambda k: str(files[k])),
            "--output_dir": out_file,
            "--dtype": st.sampled_from(["float32", "bfloat16", "int8"]),
        },
        "convert_gguf": {
            "--gguf_file": st.sampled_from(
                ["gguf", "truncated", "missing", "folder", "garbage"]
            ).map(lambda k: str(files[k])),
            "--checkpoint_dir": out_file,
            "--dtype": st.sampled_from(["float32", "bfloat16", "int8"]),
        },
    }


MODULES = {
    "generate": generate,
    "quantize": quantize,
    "convert_hf_checkpoint": convert_hf_checkpoint,
    "convert_gguf": convert_gguf,
}


@st.composite
def command_lines(draw, files, scripts):
    script = draw(st.sampled_from(scripts))
    flags = flag_values(files)[script]
    chosen = draw(st.lists(st.sampled_from(sorted(flags)), unique=True, max_size=5))
    argv = []
    for flag in chosen:
        argv.append(flag)
        if flag not in ("--chat", "--interactive", "--ignore_eos", "--skip_output"):
            argv.append(draw(flags[flag]))
    # Required flags, mostly valid, so that runs get past argparse.
    if script == "quantize":
        argv = ["--checkpoint_path", str(files["tiny"]), "--mode", "int8", *argv]
    if script == "convert_hf_checkpoint" and "--checkpoint_dir" not in argv:
        argv = ["--checkpoint_dir", str(files["folder"]), *argv]
    if script == "convert_gguf":
        argv = ["--gguf_file", str(files["gguf"]), "--checkpoint_dir", str(files["root"] / "c"),
                *argv]  # fmt: skip
    if script == "generate":
        if "--checkpoint_path" not in argv:
            argv = ["--checkpoint_path", str(files["tiny"]), *argv]
        argv += ["--max_new_tokens", "4"] if "--max_new_tokens" not in argv else []
    return script, argv


@bounded(150)
@given(data=st.data())
def test_scripts_on_random_arguments_in_process(files, data, monkeypatch):
    script, argv = data.draw(command_lines(files, list(MODULES)))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))  # for --interactive
    code, _, err = run_main(MODULES[script], argv)
    # Reaching here means no exception escaped main(). A failure is one line on stderr.
    if code:
        assert "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert "error" in last or last.startswith(("convert_gguf:", "interrupted")), err
    assert not files["marker"].exists()


def test_eval_on_bad_arguments(files):
    # eval.py loads lm_eval's task index (~10 s) before the model, so only the checks before it
    # are fuzzed here; its loading path is generate.load_model, fuzzed above.
    base = ["--checkpoint_path", str(files["tiny"]), "--device", "cpu"]
    cases = [
        ["--tasks", "fastgen_mc", "--limit", "-1"],
        ["--tasks", "fastgen_mc", "--batch_size", "0"],
        ["--tasks", ","],
        ["--tasks", "fastgen_mc", "--device", "tpu"],
        ["--tasks", "fastgen_mc", "--bench_batching", "0"],
    ]
    for argv in cases:
        code, _, err = run_main(fastgen_eval, base + argv)
        assert code and "Traceback" not in err, (argv, err)
        assert_one_line(err.strip().splitlines()[-1])


SUBPROCESS_SCRIPTS = {
    "generate": ["generate.py"],
    "quantize": ["quantize.py"],
    "eval": ["eval.py"],
    "tokenizer": ["tokenizer.py"],
    "convert_hf_checkpoint": ["scripts/convert_hf_checkpoint.py"],
    "convert_gguf": ["scripts/convert_gguf.py"],
    "download": ["scripts/download.py"],
    "perplexity": ["-m", "scripts.perplexity"],
}


@bounded(8)
@given(
    script=st.sampled_from(sorted(SUBPROCESS_SCRIPTS)),
    argv=st.lists(
        st.sampled_from(
            [
                "--checkpoint_path",
                "--checkpoint_dir",
                "--mode",
                "--tasks",
                "--repo_id",
                "--gguf_file",
                "--prompt",
                "--device",
                "--limit",
                "--text",
                "--bogus",
                "-1",
                "0",
                "nan",
                "cuda",
                "x",
                "int8",
                "nowhere/model.pth",
            ]
        ),
        max_size=6,
    ),  # fmt: skip
)
def test_scripts_on_random_arguments_as_subprocesses(script, argv):
    try:
        proc = subprocess.run(
            [sys.executable, *SUBPROCESS_SCRIPTS[script], *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} {argv} hung")
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode != 0:
        assert proc.stderr.strip(), "a failure must say why"
