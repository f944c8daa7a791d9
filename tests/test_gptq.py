# GPTQ.py: lower layer-output error than round-to-nearest int4 on the calibration inputs, with
# and without act-order, on one matrix and on a whole (tiny) model; the same stored format as
# int4; calibration text handling and the command line.
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import GPTQ
import quantize
from generate import QUANT_KEY, load_model
from helpers import random_model, save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def output_error(x, w, w_q) -> float:
    # ||X W^T - X W_q^T|| / ||X W^T||
    return float((x @ w.T - x @ w_q.T).norm() / (x @ w.T).norm())


def rtn(w, groupsize):
    return quantize.dequantize_int4(*quantize.quantize_int4(w, groupsize), groupsize)


def gptq(w, hessian, groupsize, **kwargs):
    q, scales, zeros = GPTQ.gptq_int4(w, hessian, groupsize, **kwargs)
    packed = quantize.pack_int4(q)
    return quantize.dequantize_int4(packed, scales.bfloat16(), zeros.bfloat16(), groupsize)


def correlated_inputs(n_rows, n_in, seed=0):
    # Inputs with correlated features of uneven size, like a transformer's activations.
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n_in, n_in, generator=g) / n_in**0.5 + torch.eye(n_in)
    return torch.randn(n_rows, n_in, generator=g) @ mix * (torch.rand(n_in, generator=g) * 3)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("groupsize", [32, 64])
def test_gptq_beats_round_to_nearest(act_order, groupsize):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.05
    x = correlated_inputs(2048, 128)
    hessian = 2 * x.T @ x / x.shape[0]
    e_rtn = output_error(x, w, rtn(w, groupsize))
    e_gptq = output_error(x, w, gptq(w, hessian, groupsize, act_order=act_order))
    assert e_gptq < 0.9 * e_rtn, (e_gptq, e_rtn)


def test_blocksize_changes_speed_not_result():
    torch.manual_seed(1)
    w = torch.randn(24, 256) * 0.05
    x = correlated_inputs(1024, 256, seed=1)
    hessian = x.T @ x
    results = [GPTQ.gptq_int4(w, hessian, 32, blocksize=b) for b in (32, 64, 128, 256)]
    for q, scales, _ in results[1:]:
        assert (q == results[0][0]).float().mean() > 0.99
        torch.testing.assert_close(scales, results[0][1])


def test_dead_inputs_and_stored_format():
    w = torch.randn(16, 64)
    x = correlated_inputs(512, 64)
    x[:, 5] = 0  # an input that is always zero
    q, scales, zeros = GPTQ.gptq_int4(w, x.T @ x, 32, act_order=True)
    assert q.dtype == torch.uint8 and q.shape == (16, 64) and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (16, 2) and scales.isfinite().all()
    # Scales and zeros are bfloat16 values already: storing them loses nothing.
    assert torch.equal(scales.bfloat16().float(), scales)
    assert torch.equal(zeros.bfloat16().float(), zeros)


def test_model_layers_beat_round_to_nearest():
    # Block 0 sees the float model's own inputs, so its layers can be checked exactly.
    model = random_model(intermediate_size=128)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    tokens = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    float_state = {k: v.clone() for k, v in model.state_dict().items()}
    block = model.layers[0]
    inputs = {}
    handles = [
        m.register_forward_pre_hook(
            lambda m, a, name=name: inputs.setdefault(name, []).append(a[0])
        )
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear)
    ]
    model.setup_caches(1, 32)
    with torch.no_grad():
        for row in tokens:
            model(row[None], torch.arange(32))
    for h in handles:
        h.remove()
    weights = {
        name: m.weight.detach().clone() for name, m in block.named_modules() if name in inputs
    }
    for act_order in (False, True):
        fresh = random_model(intermediate_size=128)
        fresh.load_state_dict(float_state)
        out = GPTQ.gptq_quantize_model(fresh, tokens, 32, act_order=act_order, progress=False)
        for name, w in weights.items():
            x = torch.cat(inputs[name]).reshape(-1, w.shape[1])
            t = out[f"layers.0.{name}"]
            w_gptq = quantize.dequantize_int4(t["weight"], t["scales"], t["zeros"], 32)
            e_gptq, e_rtn = output_error(x, w, w_gptq), output_error(x, w, rtn(w, 32))
            assert e_gptq < e_rtn, (name, act_order, e_gptq, e_rtn)
        assert set(out) == set(quantize.linear_names(model, skip_output=False))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    return save_tiny_checkpoint(path, tie_word_embeddings=True, intermediate_size=128)


def test_gptq_checkpoint_has_the_int4_format(tiny, tmp_path):
    tokens = torch.randint(0, 320, (4, 24), generator=torch.Generator().manual_seed(0))
    state = quantize.quantize_checkpoint(tiny, "int4-gptq", 32, calibration=tokens, progress=False)
    plain = quantize.quantize_checkpoint(tiny, "int4", 32, progress=False)
    assert state.keys() == plain.keys()
    for key, t in plain.items():
        if key != QUANT_KEY:
            assert state[key].shape == t.shape and state[key].dtype == t.dtype, key
    meta = state[QUANT_KEY]
    assert meta["mode"] == "int4-gptq" and meta["groupsize"] == 32
    assert meta["calibration_samples"] == 4 and meta["calibration_seq_length"] == 24
    quantize.save_atomic(state, tmp_path / "model.pth")
    (tmp_path / "config.json").write_text((tiny.parent / "config.json").read_text())
    model = load_model(tmp_path / "model.pth", "cpu", torch.float32)
    assert isinstance(model.output, quantize.Int4Linear)
    loaded = torch.load(tmp_path / "model.pth", weights_only=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state if k != QUANT_KEY)


def test_calibration_tokens_are_consecutive_windows():
    class Tok:
        def encode(self, text, bos=None):
            return [ord(c) for c in text]

    tokens = GPTQ.calibration_tokens(Tok(), "abcdefghij", limit=3, seq_len=3)
    assert tokens.tolist() == [[97, 98, 99], [100, 101, 102], [103, 104, 105]]
    with pytest.raises(GPTQ.GPTQError, match="fewer than one"):
        GPTQ.calibration_tokens(Tok(), "ab", limit=3, seq_len=3)
    assert "if_stmt" in GPTQ.pydoc_text()  # the default calibration text is there offline


def run(*args, check=True):
    proc = subprocess.run(
        [sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_gptq_with_calibration_file(tiny, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("Hello, my name is fastgen. The capital of France is Paris. " * 40)
    out = tmp_path / "q.pth"
    args = ["quantize.py", "--checkpoint_path", tiny, "--mode", "int4-gptq", "--output_path", out]
    proc = run(*args, "--calibration_file", text, "--calibration_limit", "4",
               "--calibration_seq_length", "32", "--act_order")  # fmt: skip
    assert "4 x 32 tokens" in proc.stderr
    assert torch.load(out, weights_only=True)[QUANT_KEY]["act_order"] is True
    args[-1] = tmp_path / "q2.pth"
    missing = run(*args, "--calibration_file", tmp_path / "nothing.txt", check=False)
    lines = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert len(lines) == 1 and "calibration file" in lines[0]
    assert not args[-1].exists()
