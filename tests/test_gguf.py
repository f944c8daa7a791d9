# scripts/convert_gguf.py on tiny GGUF files written here with gguf.GGUFWriter: every tensor type,
# the fused layout, config mapping, both tokenizer kinds, and the one-line errors.
import json
import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from convert_gguf import (
    ConversionError,
    convert_gguf,
    llama3_rope_scaling,
    sentencepiece_merges,
)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "convert_gguf.py"

DIM, N_LAYER, N_HEAD, N_KV_HEADS, HEAD_DIM, HIDDEN, CONTEXT = 64, 2, 4, 2, 16, 256, 128

# One type per tensor, covering every family; K-quants need rows of 256, so only ffn_down.
LAYER_TYPES = [
    dict(attn_q=Q.Q4_0, attn_k=Q.Q4_1, attn_v=Q.Q5_0, attn_output=Q.Q5_1,
         ffn_gate=Q.F16, ffn_up=Q.BF16, ffn_down=Q.Q4_K),
    dict(attn_q=Q.Q8_0, attn_k=Q.F32, attn_v=Q.F16, attn_output=Q.BF16,
         ffn_gate=Q.Q4_0, ffn_up=Q.Q5_1, ffn_down=Q.Q6_K),
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Writing tiny GGUF files
# ---------------------------------------------------------------------------------------------


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable spelling of bytes 0..255 (byte-level BPE vocabularies use it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


GPT2_MERGES = [
    ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"),
    ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld"), ("Ġ", "Ġ"),
]  # fmt: skip
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = GPT2_SPECIALS + byte_level_alphabet() + [a + b for a, b in GPT2_MERGES] + ["<think>"]
    types = [3] * len(GPT2_SPECIALS) + [1] * (len(tokens) - len(GPT2_SPECIALS) - 1) + [4]
    return tokens, types, [f"{a} {b}" for a, b in GPT2_MERGES]


# SentencePiece pieces with their scores (higher merges first).
SPM_PIECES = [
    ("▁", -1.0), ("h", -2.0), ("e", -2.1), ("l", -2.2), ("o", -2.3), ("w", -2.4), ("r", -2.5),
    ("d", -2.6), ("ll", -3.0), ("he", -3.1), ("hell", -3.2), ("hello", -3.3), ("▁hello", -3.4),
    ("▁w", -3.5), ("or", -3.6), ("▁wor", -3.7), ("ld", -3.8), ("▁world", -3.9),
]  # fmt: skip


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    tokens += [piece for piece, _ in SPM_PIECES] + ["<|user|>"]
    types += [1] * len(SPM_PIECES) + [4]
    scores += [score for _, score in SPM_PIECES] + [0.0]
    return tokens, types, scores


def random_k_quant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes [rows, cols/256*type_size]; gguf.quants cannot quantize these."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, type_size), dtype=np.uint8)
    # Random bytes in the float16 scales could be inf/NaN; write small finite ones instead.
    scale = rng.uniform(0.001, 0.01, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin, scales[12], qs[128]
        blocks[:, 0:2], blocks[:, 2:4] = scale, scale
    elif qtype == Q.Q6_K:  # ql[128], qh[64], scales[16], d
        blocks[:, -2:] = scale
    return blocks.reshape(rows, -1)


def encode_tensor(array: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return array.astype(np.float32)
    if qtype == Q.F16:
        return array.astype(np.float16)
    if qtype in (Q.Q4_K, Q.Q6_K):
        return random_k_quant(*array.shape, qtype, rng)
    return gguf.quants.quantize(array, qtype)


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tokenizer: str = "gpt2",
    pre: str = "gpt2",
    tied: bool = False,
    rope_freqs: np.ndarray | None = None,
    drop: tuple[str, ...] = (),
    retype: dict[str, Q] | None = None,
    seed: int = 0,
) -> dict[str, tuple[np.ndarray, Q]]:
    """Write a tiny llama GGUF; returns {gguf name: (stored array, type)}."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", N_LAYER)
    writer.add_uint32(f"{arch}.context_length", CONTEXT)
    writer.add_uint32(f"{arch}.embedding_length", DIM)
    writer.add_uint32(f"{arch}.feed_forward_length", HIDDEN)
    writer.add_uint32(f"{arch}.attention.head_count", N_HEAD)
    writer.add_uint32(f"{arch}.attention.head_count_kv", N_KV_HEADS)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    writer.add_string("tokenizer.ggml.model", tokenizer)
    if tokenizer == "gpt2":
        tokens, types, merges = gpt2_vocab()
        writer.add_string("tokenizer.ggml.pre", pre)
        writer.add_array("tokenizer.ggml.merges", merges)
        bos, eos = 1, 2
        writer.add_bool("tokenizer.ggml.add_bos_token", False)
        writer.add_string("tokenizer.chat_template", "{{ messages[0]['content'] }}")
    else:
        tokens, types, scores = spm_vocab()
        writer.add_array("tokenizer.ggml.scores", scores)
        writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
        bos, eos = 1, 2
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.bos_token_id", bos)
    writer.add_uint32("tokenizer.ggml.eos_token_id", eos)
    vocab = len(tokens)

    shapes = {"token_embd.weight": ((vocab, DIM), Q.Q8_0), "output_norm.weight": ((DIM,), Q.F32)}
    if not tied:
        shapes["output.weight"] = ((vocab, DIM), Q.Q4_1)
    layer_shapes = dict(
        attn_q=(N_HEAD * HEAD_DIM, DIM), attn_k=(N_KV_HEADS * HEAD_DIM, DIM),
        attn_v=(N_KV_HEADS * HEAD_DIM, DIM), attn_output=(DIM, N_HEAD * HEAD_DIM),
        ffn_gate=(HIDDEN, DIM), ffn_up=(HIDDEN, DIM), ffn_down=(DIM, HIDDEN),
    )  # fmt: skip
    for i, types_i in enumerate(LAYER_TYPES):
        shapes[f"blk.{i}.attn_norm.weight"] = ((DIM,), Q.F32)
        shapes[f"blk.{i}.ffn_norm.weight"] = ((DIM,), Q.F32)
        for part, shape in layer_shapes.items():
            shapes[f"blk.{i}.{part}.weight"] = (shape, types_i[part])
    if rope_freqs is not None:
        shapes["rope_freqs.weight"] = (rope_freqs.shape, Q.F32)
    stored = {}
    for name, (shape, qtype) in shapes.items():
        if name in drop:
            continue
        qtype = (retype or {}).get(name, qtype)
        if name == "rope_freqs.weight":
            values = rope_freqs.astype(np.float32)
        elif name.endswith("norm.weight"):
            values = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
        else:
            values = rng.normal(0, 0.2, size=shape).astype(np.float32)
        if qtype == Q.Q8_1:  # no quantizer or dequantizer exists: raw blocks of the right size
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = shape[1] // block_size * type_size
            data = rng.integers(0, 256, size=(shape[0], row_bytes), dtype=np.uint8)
        else:
            data = encode_tensor(values, qtype, rng)
        raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        stored[name] = (data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def dequantized(stored, name: str) -> torch.Tensor:
    data, qtype = stored[name]
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype)))


def expected_state_dict(stored, tied: bool = False) -> dict[str, torch.Tensor]:
    """Our layout, built independently: q|k|v and gate|up stacked, nothing permuted."""
    out = {
        "tok_embeddings.weight": dequantized(stored, "token_embd.weight"),
        "norm.weight": dequantized(stored, "output_norm.weight"),
    }
    if not tied:
        out["output.weight"] = dequantized(stored, "output.weight")
    for i in range(N_LAYER):
        b = f"blk.{i}."

        def get(part, b=b):
            return dequantized(stored, b + part + ".weight")

        out[f"layers.{i}.attention_norm.weight"] = get("attn_norm")
        out[f"layers.{i}.ffn_norm.weight"] = get("ffn_norm")
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat(
            [get("attn_q"), get("attn_k"), get("attn_v")]
        )
        out[f"layers.{i}.attention.wo.weight"] = get("attn_output")
        out[f"layers.{i}.feed_forward.w13.weight"] = torch.cat([get("ffn_gate"), get("ffn_up")])
        out[f"layers.{i}.feed_forward.w2.weight"] = get("ffn_down")
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    stored = write_gguf(root / "tiny.gguf")
    convert_gguf(root / "tiny.gguf", root / "ckpt", progress=False)
    return root, stored


# ---------------------------------------------------------------------------------------------
# Tensors and config
# ---------------------------------------------------------------------------------------------


def test_every_tensor_equals_gguf_dequantize(tiny):
    root, stored = tiny
    state = torch.load(root / "ckpt" / "model.pth", mmap=True, weights_only=True)
    expected = expected_state_dict(stored)
    assert sorted(state) == sorted(expected)
    for name, want in expected.items():
        assert state[name].dtype == torch.float32, name
        assert state[name].shape == want.shape, name
        assert torch.equal(state[name], want), name


def test_shapes_come_out_in_torch_order(tiny):
    # F32/F16 need no dequantizer: their values must land unreshuffled in [out, in] order.
    root, stored = tiny
    state = torch.load(root / "ckpt" / "model.pth", mmap=True, weights_only=True)
    k_f32 = stored["blk.1.attn_k.weight"][0]  # [32, 64] as written
    wqkv = state["layers.1.attention.wqkv.weight"]
    q_rows = N_HEAD * HEAD_DIM
    assert torch.equal(wqkv[q_rows : q_rows + N_KV_HEADS * HEAD_DIM], torch.from_numpy(k_f32))
    gate_f16 = stored["blk.0.ffn_gate.weight"][0].astype(np.float32)  # [256, 64]
    assert torch.equal(
        state["layers.0.feed_forward.w13.weight"][:HIDDEN], torch.from_numpy(gate_f16)
    )


def test_config(tiny):
    root, _ = tiny
    config = json.loads((root / "ckpt" / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(gpt2_vocab()[0]),
        "hidden_size": DIM,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert json.loads((root / "ckpt" / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    tokenizer_config = json.loads((root / "ckpt" / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["chat_template"] == "{{ messages[0]['content'] }}"


def test_logits_equal_transformers_on_tiny_gguf(tiny):
    # transformers reads the same file its own way (and un-permutes q/k for HF's rotary layout).
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    from generate import load_model

    root, _ = tiny
    hf = AutoModelForCausalLM.from_pretrained(root, gguf_file="tiny.gguf", dtype=torch.float32)
    ours = load_model(root / "ckpt" / "model.pth", "cpu", torch.float32)
    ours.setup_caches(1, 64)
    idx = torch.randint(
        0, len(gpt2_vocab()[0]), (1, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = hf(idx).logits
        got = ours(idx, torch.arange(40))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tied_bfloat16(tmp_path):
    stored = write_gguf(tmp_path / "tied.gguf", tied=True)
    convert_gguf(tmp_path / "tied.gguf", tmp_path / "ckpt", dtype="bfloat16", progress=False)
    state = torch.load(tmp_path / "ckpt" / "model.pth", mmap=True, weights_only=True)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"
    expected = expected_state_dict(stored, tied=True)
    assert sorted(state) == sorted(expected)
    for name, want in expected.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], want.to(torch.bfloat16)), name


def llama3_factors(head_dim, theta, factor, low, high, context) -> np.ndarray:
    # HF's llama3 rule, written out per frequency the way llama.cpp's converter does.
    out = []
    for j in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (j / head_dim)
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(factor)
        else:
            s = (context / wavelength - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_recovered_for_llama31():
    factors = llama3_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert llama3_rope_scaling(factors, 128, 500000.0, 8192) == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert llama3_rope_scaling(np.ones(64, np.float32), 128, 500000.0, 8192) is None
    with pytest.raises(ConversionError, match="does not follow"):
        llama3_rope_scaling(factors[::-1].copy(), 128, 500000.0, 8192)


def test_rope_freqs_tensor_becomes_llama3_config(tmp_path):
    from model import rope_frequencies

    factors = llama3_factors(HEAD_DIM, 10000.0, 4.0, 1.0, 8.0, 8192)
    assert ((factors > 1) & (factors < 4)).sum() == 2  # two points between the plateaus
    write_gguf(tmp_path / "rope.gguf", rope_freqs=factors)
    config = convert_gguf(tmp_path / "rope.gguf", tmp_path / "ckpt", progress=False)
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["original_max_position_embeddings"] == 8192
    assert scaling["factor"] == 4.0
    assert scaling["low_freq_factor"] == pytest.approx(1.0, abs=1e-4)
    assert scaling["high_freq_factor"] == pytest.approx(8.0, abs=1e-4)
    # What matters: model.py's frequencies equal llama.cpp's (base frequencies / rope_freqs).
    base = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    got = rope_frequencies(HEAD_DIM, 10000.0, scaling).double().numpy()
    np.testing.assert_allclose(got, base / factors, rtol=1e-6)
    state = torch.load(tmp_path / "ckpt" / "model.pth", mmap=True, weights_only=True)
    assert not any("rope" in name for name in state)


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------


TEXTS = [
    "hello world",
    "hello  world  ",
    "Hello World!",
    "hello\n\nworld\t",
    "héllo wörld 日本 🦙",
    "<|im_start|>user\nhello<|im_end|>\n",
    "say <think>hello</think>",
    "12345 world's",
    "",
]


def test_gpt2_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from tokenizer import get_tokenizer

    write_gguf(tmp_path / "bpe.gguf", tokenizer="gpt2")
    convert_gguf(tmp_path / "bpe.gguf", tmp_path / "ckpt", progress=False)
    tok = get_tokenizer(tmp_path / "ckpt")
    tokens = gpt2_vocab()[0]
    ids = tok.encode("hello world")
    assert [tokens[i] for i in ids] == ["hello", "Ġworld"]
    assert [tokens[i] for i in tok.encode("<|im_end|><think>", allow_special=True)] == [
        "<|im_end|>",
        "<think>",
    ]
    assert tok.eos_id == 2 and tok.bos_id == 1 and not tok.add_bos
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="bpe.gguf")
    for text in TEXTS:
        assert tok.encode(text, allow_special=True) == reference.encode(text), text
        assert tok.decode(tok.encode(text, allow_special=True)) == text


def test_llama_bpe_pre_tokenizer(tmp_path):
    # Llama 3's split keeps "'s" alone and digits in threes; the vocabulary here is the tiny one.
    from tokenizer import get_tokenizer

    write_gguf(tmp_path / "l3.gguf", tokenizer="gpt2", pre="llama-bpe")
    convert_gguf(tmp_path / "l3.gguf", tmp_path / "ckpt", progress=False)
    spec = json.loads((tmp_path / "ckpt" / "tokenizer.json").read_text())
    assert spec["model"]["ignore_merges"] is True
    tok = get_tokenizer(tmp_path / "ckpt")
    tokens = gpt2_vocab()[0]
    pieces = [tokens[i] for i in tok.encode("hello world 12345")]
    assert pieces == ["hello", "Ġworld", "Ġ", "1", "2", "3", "4", "5"]


def test_sentencepiece_merges_follow_scores():
    tokens, types, scores = spm_vocab()
    merges = sentencepiece_merges(tokens, scores, types)
    # "ll" (-3.0) beats "he" (-3.1); "hello" has one split into two pieces of the vocabulary.
    assert merges.index(("l", "l")) < merges.index(("h", "e"))
    assert ("hell", "o") in merges and ("▁", "hello") in merges
    assert not any("<" in a or "<" in b for a, b in merges)  # no byte or control pieces


def test_llama_sentencepiece_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from tokenizer import get_tokenizer

    write_gguf(tmp_path / "spm.gguf", tokenizer="llama")
    convert_gguf(tmp_path / "spm.gguf", tmp_path / "ckpt", progress=False)
    tok = get_tokenizer(tmp_path / "ckpt")
    tokens = spm_vocab()[0]
    # add_bos_token is absent: llama.cpp's default for SentencePiece is to add BOS.
    assert tok.add_bos and tok.bos_id == 1
    assert [tokens[i] for i in tok.encode("hello world")] == ["<s>", "▁hello", "▁world"]
    # é is not a piece: byte fallback spells its two UTF-8 bytes.
    assert [tokens[i] for i in tok.encode("hé", bos=False)] == ["▁", "h", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("hello wörld", bos=False)) == "hello wörld"
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["hello world", "hello  world", " hello", "héllo wörld 日本", "<|user|>hello"]:
        assert tok.encode(text, allow_special=True) == reference.encode(text), text


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def run_script(gguf_file: Path, checkpoint_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--gguf_file", str(gguf_file), "--checkpoint_dir",
         str(checkpoint_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip


def truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    "case, expected",
    [
        ("architecture", "architecture 'qwen2'"),
        ("truncated", "truncated"),
        ("unsupported_type", "blk.0.attn_q.weight has type Q8_1"),
        ("missing_tensor", "lacks tensor blk.1.ffn_up.weight"),
    ],
)
def test_script_errors_are_one_line(tmp_path, case, expected):
    path = tmp_path / "bad.gguf"
    if case == "architecture":
        write_gguf(path, arch="qwen2")
    elif case == "truncated":
        write_gguf(path)
        truncate(path, 0.6)
    elif case == "unsupported_type":
        write_gguf(path, retype={"blk.0.attn_q.weight": Q.Q8_1})
    elif case == "missing_tensor":
        write_gguf(path, drop=("blk.1.ffn_up.weight",))
    result = run_script(path, tmp_path / "ckpt")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert expected in lines[0] and str(path) in lines[0]
    assert not (tmp_path / "ckpt" / "model.pth").exists()
    assert not list(tmp_path.glob("ckpt/.*tmp"))


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: truncate(p, 0.001), "not a valid GGUF file"),  # cut inside the header
        (lambda p: p.write_bytes(b"not a gguf file at all"), "not a valid GGUF file"),
        (lambda p: p.write_bytes(b""), "not a valid GGUF file"),
        (lambda p: p.unlink(), "cannot read"),
    ],
)
def test_unreadable_files(tmp_path, make, expected):
    path = tmp_path / "bad.gguf"
    write_gguf(path)
    make(path)
    with pytest.raises(ConversionError, match=expected):
        convert_gguf(path, tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt").exists()


def test_unknown_pre_tokenizer_and_tokenizer_model(tmp_path):
    write_gguf(tmp_path / "pre.gguf", pre="qwen2")
    with pytest.raises(ConversionError, match=r"pre-tokenizer 'qwen2'.*smollm"):
        convert_gguf(tmp_path / "pre.gguf", tmp_path / "ckpt", progress=False)
    write_gguf(tmp_path / "t5.gguf", tokenizer="t5")
    with pytest.raises(ConversionError, match="tokenizer model 't5'"):
        convert_gguf(tmp_path / "t5.gguf", tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt").exists()


def test_help():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0 and "--gguf_file" in result.stdout


def test_script_converts(tmp_path):
    write_gguf(tmp_path / "tiny.gguf")
    result = run_script(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stderr and result.stdout == ""
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.pth",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
