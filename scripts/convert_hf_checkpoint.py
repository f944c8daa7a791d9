# Converts a Hugging Face Llama-family checkpoint (safetensors, sharded or not, or
# pytorch_model*.bin) into fastgen's layout: DIR/model.pth plus config.json and the tokenizer
# files beside it. Mixtral (MoE) too: HF's per-expert tensors (block_sparse_moe.experts.E.w1/w2/w3)
# or fused ones (mlp.experts.gate_up_proj/down_proj) are stacked into feed_forward.w13/w2
# [E, out, in]; and Mistral's original release (params.json plus consolidated.*.pth or
# consolidated.safetensors, whole tensors per file, q/k already in our rotary layout).
#
#   python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-3.1-8B
#
# It goes tensor by tensor through one shard at a time, so peak memory is about one shard plus
# the output.
import argparse
import json
import os
import pickle
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
    # Mixtral: the router, and the expert stacks transformers 5 keeps fused (gate | up rows)
    "block_sparse_moe.gate.weight": "feed_forward.gate.weight",
    "mlp.gate.weight": "feed_forward.gate.weight",
    "mlp.experts.gate_up_proj": "feed_forward.w13.weight",
    "mlp.experts.down_proj": "feed_forward.w2.weight",
}
_EXPERT_RE = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
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
# Meta's and Mistral's original (consolidated) names -> the HF names above.
_ORIGINAL_GLOBAL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight":
                    "model.norm.weight", "output.weight": "lm_head.weight"}  # fmt: skip
_ORIGINAL_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.gate.weight": "block_sparse_moe.gate.weight",
}
_ORIGINAL_RE = re.compile(r"layers\.(\d+)\.(.+)")


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
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:  # a truncated or corrupt header or tensor
            raise ConversionError(f"cannot read {path}: {e}") from e
    else:
        # weights_only refuses pickles that would run code.
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError as e:  # torch's message advises weights_only=False: no
            raise ConversionError(
                f"refusing {path}: it holds Python objects besides tensors, and loading them "
                "could run code"
            ) from e
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise ConversionError(f"cannot read {path}: {str(e).splitlines()[0]}") from e
        if not isinstance(state, dict):
            raise ConversionError(f"{path} holds a {type(state).__name__}, not a state dict")
        yield from state.items()


def convert_state_dict(
    tensor_iter, config: dict, dtype: torch.dtype | None = None, rotary_interleaved: bool = False
) -> dict:
    # rotary_interleaved: q/k rows are in our layout already (original files), not HF's.
    n_head = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_head
    out, pending, experts_seen = {}, {}, {}
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
        expert = _EXPERT_RE.fullmatch(key)
        if expert is not None:
            put_expert(out, experts_seen, layer, int(expert.group(1)), expert.group(2), t, config)
            continue
        try:
            if rotary_interleaved:
                pass
            elif key.startswith("self_attn.q_proj"):
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
    n_experts = config.get("num_local_experts", 0)
    for name, seen in experts_seen.items():
        parts = ("w2",) if name.endswith("w2.weight") else ("w1", "w3")
        for e, part in ((e, part) for e in range(n_experts) for part in parts):
            if (e, part) not in seen:
                layer = name.split(".")[1]
                missing = f"block_sparse_moe.experts.{e}.{part}.weight"
                raise ConversionError(f"missing tensor model.layers.{layer}.{missing}")
    if config.get("tie_word_embeddings") and "output.weight" in out:
        del out["output.weight"]  # tied: the model reuses tok_embeddings.weight
    return out


def put_expert(out: dict, seen: dict, layer: str, e: int, part: str, t: torch.Tensor, config):
    # One expert's w1 or w3 [inter, dim] or w2 [dim, inter] into its slice of the layer's stack,
    # feed_forward.w13.weight [E, 2 * inter, dim] (gate | up rows) or w2.weight [E, dim, inter],
    # made when the layer's first expert tensor arrives: the experts are never held twice.
    n_experts, inter = config.get("num_local_experts", 0), config["intermediate_size"]
    name = f"layers.{layer}.feed_forward.{'w2' if part == 'w2' else 'w13'}.weight"
    if not 0 <= e < n_experts:
        raise ConversionError(f"layer {layer}: expert {e}, but config.json has {n_experts}")
    if name not in out:
        shape = (n_experts, *t.shape) if part == "w2" else (n_experts, 2 * inter, t.shape[1])
        out[name] = torch.empty(shape, dtype=t.dtype)
    rows = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter), "w2": slice(None)}[part]
    try:
        out[name][e, rows] = t
    except RuntimeError as err:
        want = list(out[name][e, rows].shape)
        raise ConversionError(
            f"layer {layer} expert {e} {part}: shape {list(t.shape)}, expected {want}"
        ) from err
    seen.setdefault(name, set()).add((e, part))


def original_to_hf_names(tensor_iter):
    # (name, tensor) of Meta's / Mistral's consolidated files -> the same under HF's names. A
    # name met twice means model-parallel shards (Meta's consolidated.0N.pth), which would have
    # to be concatenated: not supported.
    seen = set()
    for name, t in tensor_iter:
        if name in seen:
            raise ConversionError(
                f"tensor {name} is in two consolidated files: model-parallel shards are not "
                "supported (convert the Hugging Face release instead)"
            )
        seen.add(name)
        m = _ORIGINAL_RE.fullmatch(name)
        if name in _ORIGINAL_GLOBAL:
            yield _ORIGINAL_GLOBAL[name], t
        elif m is not None and m.group(2) in _ORIGINAL_LAYER:
            yield f"model.layers.{m.group(1)}.{_ORIGINAL_LAYER[m.group(2)]}", t
        elif m is not None and m.group(2).startswith("feed_forward.experts."):  # .E.w1.weight
            expert = m.group(2).removeprefix("feed_forward.")
            yield f"model.layers.{m.group(1)}.block_sparse_moe.{expert}", t
        elif not name.startswith("rope.freqs"):  # a buffer Meta saved; recomputed by model.py
            raise ConversionError(f"unexpected tensor {name} in checkpoint")


def config_from_params(params: dict) -> dict:
    # Mistral's (or Meta's) params.json -> a Hugging Face style config.json. Its sliding window,
    # if any, is left out: Mixtral's is unset.
    if "hidden_dim" not in params:
        raise ConversionError(
            "params.json has no hidden_dim (Meta's Llama releases): convert the Hugging Face "
            "release instead"
        )
    moe = params.get("moe") or {}
    n_heads = params["n_heads"]
    config = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "vocab_size": params["vocab_size"],
        "hidden_size": params["dim"],
        "intermediate_size": params["hidden_dim"],
        "num_hidden_layers": params["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": params.get("n_kv_heads") or n_heads,
        "head_dim": params.get("head_dim") or params["dim"] // n_heads,
        "rms_norm_eps": params.get("norm_eps", 1e-5),
        "rope_theta": params.get("rope_theta", 10000.0),
        # params.json does not say; 32768 is Mixtral 8x7B's context
        "max_position_embeddings": params.get("max_seq_len", 32768),
        "tie_word_embeddings": False,
    }
    if moe:
        config["num_local_experts"] = moe["num_experts"]
        config["num_experts_per_tok"] = moe["num_experts_per_tok"]
    return config


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
    original = (
        sorted(checkpoint_dir.glob("consolidated*.safetensors"))
        or sorted(checkpoint_dir.glob("consolidated*.pt"))
        or sorted(checkpoint_dir.glob("consolidated*.pth"))
    )
    if not config_path.is_file() and original and (checkpoint_dir / "params.json").is_file():
        config = config_from_params(json.loads((checkpoint_dir / "params.json").read_text()))
        files = original
    elif not config_path.is_file():
        raise ConversionError(
            f"no config.json (nor params.json and consolidated files) in {checkpoint_dir}"
        )
    else:
        try:
            config = json.loads(config_path.read_text())
        except ValueError as e:  # not JSON, or not UTF-8
            raise ConversionError(f"{config_path} is not valid JSON: {e}") from e
        files, original = list_weight_files(checkpoint_dir), []
    output_dir = output_dir or checkpoint_dir
    output_dir.mkdir(parents=True, exist_ok=True)

    def tensors():
        for path in tqdm(files, desc="converting shards", unit="shard", file=sys.stderr):
            yield from iter_tensors(path)

    if original:
        state = convert_state_dict(original_to_hf_names(tensors()), config, dtype, True)
        (output_dir / "config.json").write_text(json.dumps(config, indent=2))
    else:
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
        help="HF checkpoint folder (config.json and weights), or Mistral's original one "
        "(params.json and consolidated files)",
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
