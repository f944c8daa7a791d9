# Tiny random Hugging Face Llama checkpoints for tests, converted into fastgen's layout.
import json
from pathlib import Path

import torch

from convert_hf_checkpoint import convert_hf_checkpoint
from model import ModelArgs, Transformer

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def make_hf_model(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    # Default init leaves norms at 1 and biases at 0; randomise so every parameter matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.1)
    return model


def save_hf(model, path: Path, **save_kwargs) -> Path:
    model.save_pretrained(path, **save_kwargs)
    return path


def convert_and_load(hf_dir: Path, max_batch_size: int = 2, max_seq_len: int = 256):
    convert_hf_checkpoint(hf_dir)
    from generate import load_model

    model = load_model(hf_dir / "model.pth", "cpu", torch.float32)
    model.setup_caches(max_batch_size, max_seq_len)
    return model


def random_model(seed: int = 0, **overrides) -> Transformer:
    # A fastgen model with random weights (no HF involved), for loop and cache tests.
    torch.manual_seed(seed)
    cfg = {"model_type": "llama", **TINY, **overrides}
    model = Transformer(ModelArgs.from_config(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def write_config(path: Path, cfg: dict):
    (path / "config.json").write_text(json.dumps(cfg))
