# Converts a Hugging Face Llama-family checkpoint (safetensors, sharded or not, or
# pytorch_model*.bin) into fastgen's layout: DIR/model.pth plus config.json and the tokenizer
# files beside it.
#
#   python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-3.1-8B
#
# It goes tensor by tensor through one shard at a time, so peak memory is about one shard plus
# the output.
import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from tqdm import tqdm

# Files copied beside model.pth when the output goes to another directory.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
)

_LAYER_KEYS = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.o_proj.bias": "attention.wo.bias",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL_KEYS = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
# Parts fused into one of our tensors, in the order they are concatenated.
_FUSED = {
    "attention.wqkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "attention.wqkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "feed_forward.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_PART_OF = {part: fused for fused, parts in _FUSED.items() for part in parts}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


class ConversionError(Exception):
    pass


def hf_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # HF stores each head's rotary dims as two halves (rotate_half); we rotate adjacent pairs.
    # w [n_heads * head_dim, in] (or a bias [n_heads * head_dim]).
    rest = w.shape[1:]
    head_dim = w.shape[0] // n_heads
    w = w.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2)
    return w.reshape(n_heads * head_dim, *rest)


def list_weight_files(checkpoint_dir: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = checkpoint_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [checkpoint_dir / s for s in shards]
    for pattern in ("model*.safetensors", "pytorch_model*.bin"):
        files = sorted(checkpoint_dir.glob(pattern))
        if files:
            return files
    raise ConversionError(f"no *.safetensors or pytorch_model*.bin weights in {checkpoint_dir}")


def iter_tensors(path: Path):
    if not path.is_file():
        raise ConversionError(f"missing weight shard {path}")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    else:
        # weights_only refuses pickles that would run code.
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise ConversionError(f"cannot read {path}: {str(e).splitlines()[0]}") from e
        yield from state.items()


def convert_state_dict(tensor_iter, config: dict, dtype: torch.dtype | None = None) -> dict:
    n_head = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_head
    out, pending = {}, {}
    for name, t in tensor_iter:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if name in _GLOBAL_KEYS:
            out[_GLOBAL_KEYS[name]] = t
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer HF recomputes; nothing we need
        m = _LAYER_RE.fullmatch(name)
        if m is None:  # e.g. an lm_head bias: a layout model.py does not have
            raise ConversionError(f"unexpected tensor {name} in checkpoint")
        layer, key = m.group(1), m.group(2)
        try:
            if key.startswith("self_attn.q_proj"):
                t = hf_to_interleaved(t, n_head)
            elif key.startswith("self_attn.k_proj"):
                t = hf_to_interleaved(t, n_kv_heads)
        except (RuntimeError, IndexError) as e:  # rows that do not split into the config's heads
            raise ConversionError(
                f"tensor {name} has shape {list(t.shape)}, which does not split into the "
                f"{n_head if 'q_proj' in key else n_kv_heads} heads config.json gives"
            ) from e
        if key in _LAYER_KEYS:
            out[f"layers.{layer}.{_LAYER_KEYS[key]}"] = t
        elif key in _PART_OF:
            fused = _PART_OF[key]
            parts = pending.setdefault((layer, fused), {})
            parts[key] = t
            if len(parts) == len(_FUSED[fused]):  # all parts seen (maybe across shards)
                try:
                    out[f"layers.{layer}.{fused}"] = torch.cat([parts[p] for p in _FUSED[fused]])
                except RuntimeError as e:  # parts whose columns (or ranks) differ
                    shapes = ", ".join(f"{p} {list(parts[p].shape)}" for p in _FUSED[fused])
                    raise ConversionError(f"layer {layer}: cannot stack {shapes}") from e
                del pending[(layer, fused)]
        else:
            raise ConversionError(f"unexpected tensor {name} in checkpoint")
    if pending:
        (layer, fused), parts = next(iter(pending.items()))
        missing = sorted(set(_FUSED[fused]) - set(parts))
        raise ConversionError(f"missing tensor model.layers.{layer}.{missing[0]}")
    if config.get("tie_word_embeddings") and "output.weight" in out:
        del out["output.weight"]  # tied: the model reuses tok_embeddings.weight
    return out


def save_atomic(obj, path: Path):
    # Write beside the target and rename, so an interrupted run never leaves half a file.
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def convert_hf_checkpoint(
    checkpoint_dir: Path, output_dir: Path | None = None, dtype: torch.dtype | None = None
) -> Path:
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"no config.json in {checkpoint_dir}")
    config = json.loads(config_path.read_text())
    files = list_weight_files(checkpoint_dir)
    output_dir = output_dir or checkpoint_dir
    output_dir.mkdir(parents=True, exist_ok=True)

    def tensors():
        for path in tqdm(files, desc="converting shards", unit="shard", file=sys.stderr):
            yield from iter_tensors(path)

    state = convert_state_dict(tensors(), config, dtype)
    save_atomic(state, output_dir / "model.pth")
    if output_dir.resolve() != checkpoint_dir.resolve():
        for name in SIDE_FILES:
            if (checkpoint_dir / name).is_file():
                shutil.copy2(checkpoint_dir / name, output_dir / name)
        if (
            not (output_dir / "tokenizer.model").exists()
            and (checkpoint_dir / "original" / "tokenizer.model").is_file()
        ):
            shutil.copy2(checkpoint_dir / "original" / "tokenizer.model", output_dir)
    return output_dir / "model.pth"


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(checkpoint_dir: Path, output_dir: Path | None, dtype: str | None):
    try:
        out = convert_hf_checkpoint(checkpoint_dir, output_dir, DTYPES.get(dtype))
    except ConversionError as e:
        sys.exit(f"error: {e}")
    except KeyError as e:
        sys.exit(f"error: config.json in {checkpoint_dir} lacks field {e}")
    except KeyboardInterrupt:  # Ctrl-C: save_atomic has already removed its temporary file
        print("interrupted, no model.pth written", file=sys.stderr)
        sys.exit(130)
    print(f"wrote {out}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Convert a Hugging Face Llama-family checkpoint into fastgen's model.pth."
    )
    p.add_argument(
        "--checkpoint_dir",
        type=Path,
        required=True,
        help="HF checkpoint folder (config.json and weights)",
    )
    p.add_argument(
        "--output_dir",
        type=Path,
        default=None,
        help="where model.pth goes (default: the checkpoint folder)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast floating weights (default: keep the checkpoint's dtype)",
    )
    return p


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))
