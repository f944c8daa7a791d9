# model.py and the HF converter against Hugging Face transformers on tiny random models.
import json

import pytest
import torch

from helpers import convert_and_load, make_hf_model, random_model, save_hf
from model import ConfigError, ModelArgs, transformer_configs

VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "mqa_tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "bias": dict(attention_bias=True),
    "llama31_rope": dict(
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        rope_theta=500000.0,
    ),
    "linear_rope": dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
    "head_dim": dict(head_dim=24),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_hf(tmp_path, variant):
    hf = make_hf_model(**VARIANTS[variant])
    model = convert_and_load(save_hf(hf, tmp_path))
    x = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        ref = hf(x).logits
        ours = model(x, torch.arange(40))
    assert (ours - ref).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "save_kwargs", [dict(max_shard_size="40KB"), dict(safe_serialization=False)], ids=str
)
def test_sharded_and_bin(tmp_path, save_kwargs):
    hf = make_hf_model(num_key_value_heads=2)
    try:
        save_hf(hf, tmp_path, **save_kwargs)
    except TypeError:
        pytest.skip("this transformers cannot save .bin files")
    names = sorted(p.name for p in tmp_path.iterdir())
    if "max_shard_size" in save_kwargs:
        assert "model.safetensors.index.json" in names
    model = convert_and_load(tmp_path)
    x = torch.randint(0, 128, (1, 17))
    with torch.no_grad():
        assert (model(x, torch.arange(17)) - hf(x).logits).abs().max() <= 1e-4


def test_bin_checkpoint(tmp_path):
    hf = make_hf_model()
    save_hf(hf, tmp_path)
    # transformers 5 only writes safetensors: write the .bin form ourselves.
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    model = convert_and_load(tmp_path)
    x = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert (model(x, torch.arange(9)) - hf(x).logits).abs().max() <= 1e-4


def test_incremental_decode_equals_full_forward():
    model = random_model(num_key_value_heads=2)
    model.setup_caches(2, 64)
    x = torch.randint(0, 128, (2, 30))
    with torch.no_grad():
        full = model(x, torch.arange(30))
        model.setup_caches(2, 48)  # another cache size: slots past the prompt must not matter
        parts = [model(x[:, :7], torch.arange(7))]
        for i in range(7, 30):
            parts.append(model(x[:, i : i + 1], torch.tensor([i])))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_left_padding_matches_unpadded():
    model = random_model()
    model.setup_caches(2, 64)
    a = torch.randint(0, 128, (12,))
    b = torch.randint(0, 128, (5,))
    with torch.no_grad():
        ref_a = model(a[None], torch.arange(12))[0]
        ref_b = model(b[None], torch.arange(5))[0]
        x = torch.stack([a, torch.cat([torch.zeros(7, dtype=torch.long), b])])
        out = model(x, torch.arange(12), pad=torch.tensor([0, 7]))
    torch.testing.assert_close(out[0], ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 7:], ref_b, atol=1e-5, rtol=1e-5)


def test_compiled_equals_eager():
    model = random_model()
    model.setup_caches(1, 32)
    x = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        eager = model(x, torch.arange(8))
        compiled = torch.compile(model, fullgraph=True)(x, torch.arange(8))
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_name_table_covers_known_models():
    for name in transformer_configs:
        args = ModelArgs.from_name(name)
        assert args.dim % args.n_head == 0 or args.head_dim is not None
    # Case-insensitive exact names only: no guessing from substrings of a path.
    assert ModelArgs.from_name("llama-3.1-8b").rope_scaling["factor"] == 8.0
    with pytest.raises(ConfigError, match="closest: Llama-3.1-8B"):
        ModelArgs.from_name("Llama-3.1-8")
    with pytest.raises(ConfigError, match="unknown model name"):
        ModelArgs.from_name("checkpoints/foo/7B")


def test_from_config_reads_both_rope_styles():
    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        model_type="llama",
    )
    old = ModelArgs.from_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    )
    new = ModelArgs.from_config(
        {**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    )
    assert old.rope_base == new.rope_base == 5e5
    assert old.rope_scaling["factor"] == new.rope_scaling["factor"] == 2.0
    plain = ModelArgs.from_config(
        {**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}
    )
    assert plain.rope_scaling is None
    with pytest.raises(ConfigError, match="unsupported architecture"):
        ModelArgs.from_config({**base, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    roundtrip = ModelArgs.from_config(json.loads(json.dumps(new.to_config())))
    assert roundtrip == new
