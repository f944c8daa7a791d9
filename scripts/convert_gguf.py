"""Convert a llama-architecture GGUF file (llama.cpp's format) into a fastgen checkpoint directory.

    python scripts/convert_gguf.py --gguf_file model.Q4_1.gguf --checkpoint_dir checkpoints/NAME

Writes into the checkpoint directory:
- model.pth: our state dict, every tensor dequantized (float32 unless --dtype says otherwise);
- config.json: Hugging Face LlamaConfig keys, mapped from the GGUF metadata;
- tokenizer.json, tokenizer_config.json, generation_config.json: built from the GGUF vocabulary.

Weights need no rotary permutation: llama.cpp's converter already stores q and k rows in the
interleaved-pairs rotary layout that model.py uses. We only fuse q/k/v into wqkv and gate/up into
w13. Any tensor type `gguf.quants` can dequantize is accepted (F32, F16, BF16, Q4_0 ... Q8_0,
the K-quants, the IQ types).

Llama 3 rope scaling: llama.cpp drops HF's four `rope_scaling` numbers and stores the resulting
per-frequency divisors as a `rope_freqs.weight` tensor. We fit the numbers back from that tensor
(see llama3_rope_scaling); the original context length is not in the file, so it comes from
`llama.rope.scaling.original_context_length` when present and is 8192 (every Llama 3.x) otherwise.
Any value gives the same frequencies, because low/high_freq_factor scale with it.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# llama.cpp's token types (gguf.TokenType); these three are matched whole in text, never merged.
ADDED_TOKEN_TYPES = (gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)

# Context length llama3 rope scaling was trained from when the file does not say (all Llama 3.x).
LLAMA3_ORIGINAL_CONTEXT = 8192


class ConversionError(Exception):
    """A problem with the input file or arguments: main() prints it as one line."""


# ---------------------------------------------------------------------------------------------
# Reading the file
# ---------------------------------------------------------------------------------------------


def open_gguf(gguf_file: Path) -> gguf.GGUFReader:
    # GGUFReader memory-maps the file: tensor data is only read when dequantized.
    try:
        reader = gguf.GGUFReader(gguf_file)
    except OSError as e:
        raise ConversionError(f"cannot read {gguf_file}: {e.strerror or e}") from e
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        # The reader slices the memmap past its end on a short file and fails on what comes back.
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversionError(
            f"{gguf_file} is not a valid GGUF file (truncated or corrupt: {reason})"
        ) from e
    file_size = os.path.getsize(gguf_file)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > file_size:
            raise ConversionError(
                f"{gguf_file} is truncated: tensor {tensor.name} ends past the file"
            )
    return reader


def field(reader: gguf.GGUFReader, key: str, default=None):
    """The value of a metadata key (a list for arrays), or default when the file lacks it."""
    entry = reader.get_field(key)
    return default if entry is None else entry.contents()


def required_field(reader: gguf.GGUFReader, key: str, gguf_file: Path):
    value = field(reader, key)
    if value is None:
        raise ConversionError(f"{gguf_file} lacks metadata key {key}")
    return value


def is_supported_type(tensor_type: gguf.GGMLQuantizationType) -> bool:
    # gguf.quants answers "can you dequantize this" only by trying; one zero block is enough.
    _, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def float32_value(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 reads back as 9.999999747378752e-06. Keep the shortest
    # decimal that rounds to the same float32, which is what the original config said.
    return float(str(np.float32(value)))


def llama3_rope_scaling(
    rope_factors: np.ndarray, head_dim: int, rope_theta: float, original_context: int
) -> dict | None:
    """HF's llama3 `rope_scaling` dict that yields llama.cpp's per-frequency divisors.

    HF's rule, for the wavelength w_j = 2*pi*theta^(2j/head_dim) of each rotary pair j and the
    original context L: divisor 1 when w_j < L/high, factor when w_j > L/low, otherwise
    1 / ((1 - s)/factor + s) with s = (L/w_j - low) / (high - low).
    So factor is the largest divisor, and between the plateaus L/w_j = low + s_j * (high - low)
    is a line in s_j (which each divisor gives): fitting it gives low and high.
    """
    factors = np.asarray(rope_factors, dtype=np.float64)  # [head_dim // 2]
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    pair = np.arange(0, head_dim, 2, dtype=np.float64)
    wavelength = 2 * math.pi * rope_theta ** (pair / head_dim)  # [head_dim // 2]
    x = original_context / wavelength
    between = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    if between.sum() < 2:
        raise ConversionError(
            "rope_freqs.weight has fewer than two interpolated frequencies; "
            "cannot recover llama3 low_freq_factor/high_freq_factor from it"
        )
    s = (factor / factors[between] - 1) / (factor - 1)
    slope, low = np.polyfit(s, x[between], 1)
    high = low + slope
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": round(float(low), 6),
        "high_freq_factor": round(float(high), 6),
        "original_max_position_embeddings": int(original_context),
    }
    # Recompute every divisor from the fitted numbers: a file made by another rule must not pass.
    s_all = np.clip((x - low) / (high - low), 0.0, 1.0)
    rebuilt = 1 / ((1 - s_all) / factor + s_all)
    if not np.allclose(rebuilt, factors, rtol=1e-3, atol=0):
        raise ConversionError("rope_freqs.weight does not follow Llama 3 rope scaling")
    return scaling


def rope_scaling_from_gguf(reader, tensors, arch, head_dim, rope_theta, gguf_file) -> dict | None:
    scaling_type = field(reader, f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        rope_factors = gguf.quants.dequantize(
            tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type
        ).reshape(-1)  # [head_dim // 2]
        if rope_factors.shape[0] != head_dim // 2:
            raise ConversionError(
                f"rope_freqs.weight has {rope_factors.shape[0]} values, expected {head_dim // 2}"
            )
        context = field(reader, f"{arch}.rope.scaling.original_context_length")
        context = LLAMA3_ORIGINAL_CONTEXT if context is None else int(context)
        return llama3_rope_scaling(rope_factors, head_dim, rope_theta, context)
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        factor = required_field(reader, f"{arch}.rope.scaling.factor", gguf_file)
        return {"rope_type": "linear", "factor": float32_value(factor)}
    raise ConversionError(
        f"{gguf_file}: rope scaling type {scaling_type!r} is not supported (none, linear, llama3)"
    )


def config_from_gguf(reader: gguf.GGUFReader, gguf_file: Path, dtype: str) -> dict:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"{gguf_file} has architecture {arch!r}; only 'llama' is supported")
    if int(field(reader, "split.count", 1)) > 1:
        raise ConversionError(
            f"{gguf_file} is one shard of a split GGUF; merge it first (llama-gguf-split --merge)"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConversionError(f"{gguf_file} lacks tensor token_embd.weight")

    dim = int(required_field(reader, f"{arch}.embedding_length", gguf_file))
    n_head = int(required_field(reader, f"{arch}.attention.head_count", gguf_file))
    n_kv_heads = field(reader, f"{arch}.attention.head_count_kv", n_head)
    if isinstance(n_kv_heads, list):
        raise ConversionError(f"{gguf_file}: a different KV head count per layer is not supported")
    head_dim = int(field(reader, f"{arch}.attention.key_length", dim // n_head))
    value_dim = int(field(reader, f"{arch}.attention.value_length", head_dim))
    rope_dim = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ConversionError(
            f"{gguf_file}: key/value/rotary sizes {head_dim}/{value_dim}/{rope_dim} differ; "
            "only full rotary with equal key and value sizes is supported"
        )
    rope_theta = float32_value(field(reader, f"{arch}.rope.freq_base", 10000.0))
    # GGUF shapes list the fastest dimension first: token_embd is [dim, vocab] there.
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": dim,
        "intermediate_size": int(required_field(reader, f"{arch}.feed_forward_length", gguf_file)),
        "num_hidden_layers": int(required_field(reader, f"{arch}.block_count", gguf_file)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(n_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(required_field(reader, f"{arch}.context_length", gguf_file)),
        "rms_norm_eps": float32_value(
            required_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", gguf_file)
        ),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling_from_gguf(
            reader, tensors, arch, head_dim, rope_theta, gguf_file
        ),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": dtype,
    }


# ---------------------------------------------------------------------------------------------
# model.pth
# ---------------------------------------------------------------------------------------------


def tensor_plan(config: dict) -> list[tuple[str, list[str], tuple[int, ...]]]:
    """(our name, GGUF names concatenated along dim 0, our shape) for every output tensor."""
    dim, vocab = config["hidden_size"], config["vocab_size"]
    n_head, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, hidden = config["head_dim"], config["intermediate_size"]
    qkv_rows = (n_head + 2 * n_kv_heads) * head_dim
    plan = [("tok_embeddings.weight", ["token_embd.weight"], (vocab, dim))]
    for i in range(config["num_hidden_layers"]):
        src, dst = f"blk.{i}.", f"layers.{i}."
        qkv = [src + "attn_q", src + "attn_k", src + "attn_v"]
        plan += [
            (dst + "attention_norm.weight", [src + "attn_norm.weight"], (dim,)),
            (dst + "attention.wqkv.weight", [n + ".weight" for n in qkv], (qkv_rows, dim)),
            (dst + "attention.wo.weight", [src + "attn_output.weight"], (dim, n_head * head_dim)),
            (dst + "ffn_norm.weight", [src + "ffn_norm.weight"], (dim,)),
            (
                dst + "feed_forward.w13.weight",
                [src + "ffn_gate.weight", src + "ffn_up.weight"],
                (2 * hidden, dim),
            ),
            (dst + "feed_forward.w2.weight", [src + "ffn_down.weight"], (dim, hidden)),
        ]
        if config["attention_bias"]:
            plan.append((dst + "attention.wqkv.bias", [n + ".bias" for n in qkv], (qkv_rows,)))
            plan.append((dst + "attention.wo.bias", [src + "attn_output.bias"], (dim,)))
    plan.append(("norm.weight", ["output_norm.weight"], (dim,)))
    if not config["tie_word_embeddings"]:
        plan.append(("output.weight", ["output.weight"], (vocab, dim)))
    return plan


def check_tensors(reader: gguf.GGUFReader, plan, gguf_file: Path) -> None:
    """Fail before any work on a missing, unexpected, misshapen or undecodable tensor."""
    tensors = {t.name: t for t in reader.tensors}
    wanted = {name for _, names, _ in plan for name in names}
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise ConversionError(f"{gguf_file} lacks tensor {missing[0]}")
    # rope_freqs went into config.json; attn_rot_embd is an unused leftover of old llama.cpp.
    ignored = {"rope_freqs.weight"} | {n for n in tensors if n.endswith(".attn_rot_embd")}
    unexpected = sorted(tensors.keys() - wanted - ignored)
    if unexpected:
        raise ConversionError(
            f"{gguf_file} has tensor {unexpected[0]}, which a plain llama model lacks"
        )
    for _, names, shape in plan:
        rows = 0
        for name in names:
            tensor = tensors[name]
            if not is_supported_type(tensor.tensor_type):
                raise ConversionError(
                    f"{gguf_file}: tensor {name} has type {tensor.tensor_type.name}, "
                    "which gguf.quants cannot dequantize"
                )
            torch_shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims reversed
            if torch_shape[1:] != shape[1:]:
                raise ConversionError(
                    f"{gguf_file}: tensor {name} has shape {list(torch_shape)}, "
                    f"expected [*, {', '.join(map(str, shape[1:]))}] from the metadata"
                )
            rows += torch_shape[0]
        if rows != shape[0]:
            raise ConversionError(
                f"{gguf_file}: tensors {', '.join(names)} have {rows} rows in all, "
                f"expected {shape[0]} from the metadata"
            )


def dequantize(tensor) -> torch.Tensor:
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32, [out, in]
    if not array.flags.writeable:
        array = array.copy()  # F32 comes back as a view of the read-only memmap
    return torch.from_numpy(array)


def convert_tensors(
    reader: gguf.GGUFReader, plan, dtype: torch.dtype, progress: bool = True
) -> dict[str, torch.Tensor]:
    tensors = {t.name: t for t in reader.tensors}
    state_dict = {}
    for name, gguf_names, shape in tqdm(
        plan, desc="converting", unit="tensor", file=sys.stderr, disable=not progress
    ):
        # One output tensor alive at a time besides the result: memory stays ~ the output size.
        parts = [dequantize(tensors[n]) for n in gguf_names]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        assert weight.shape == shape, (name, weight.shape, shape)
        state_dict[name] = weight.to(dtype)
    return state_dict


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

# llama.cpp's split for Llama 3 ("llama-bpe"): contractions in any case, letters with one leading
# non-letter, digits in threes, punctuation runs, newlines, other whitespace.
LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BYTE_LEVEL_PRE = ("default", "gpt2", "smollm", "starcoder", "llama-bpe", "llama3")


def byte_level_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) for a tokenizer.ggml.pre value in BYTE_LEVEL_PRE."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre in ("smollm", "starcoder"):
        # Each digit alone, then GPT-2's split: SmolLM2's own tokenizer.json does this.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]), False
    if pre in ("llama-bpe", "llama3"):
        # Llama 3 also looks a whole pre-token up in the vocabulary before merging.
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level]), True
    # "default" is what llama.cpp writes for a BPE vocabulary it does not recognise; we read
    # it as GPT-2's, as transformers does.
    return gpt2, False


def unique_vocab(tokens: list[str]) -> dict[str, int]:
    # A few files repeat a token string; the first id keeps it, as in llama.cpp's lookup.
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def bpe_tokenizer(gguf_file: Path, tokens: list[str], merges, **options) -> Tokenizer:
    try:
        return Tokenizer(models.BPE(vocab=unique_vocab(tokens), merges=merges, **options))
    # tokenizers raises a plain Exception (e.g. for a merge of tokens not in the vocabulary).
    except Exception as e:  # noqa: BLE001
        raise ConversionError(f"{gguf_file}: invalid BPE vocabulary: {e}") from e


def byte_level_model(reader, tokens, gguf_file) -> Tokenizer:
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in BYTE_LEVEL_PRE:
        raise ConversionError(
            f"{gguf_file}: pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(BYTE_LEVEL_PRE)})"
        )
    merges = []
    for merge in required_field(reader, "tokenizer.ggml.merges", gguf_file):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ConversionError(f"{gguf_file}: merge {merge!r} is not two tokens")
        merges.append(tuple(pair))
    pre_tokenizer, ignore_merges = byte_level_pre_tokenizer(pre)
    tokenizer = bpe_tokenizer(gguf_file, tokens, merges, ignore_merges=ignore_merges)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens, scores, token_types) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece BPE, which joins the pair whose result scores best.

    Every split of a normal token into two vocabulary pieces is a merge, ranked by the merged
    token's score (best first).
    """
    vocab = unique_vocab(tokens)
    ranked = []
    for index, (token, score, token_type) in enumerate(
        zip(tokens, scores, token_types, strict=True)
    ):
        if token_type != gguf.TokenType.NORMAL or vocab[token] != index:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_model(reader, tokens, token_types, unk, gguf_file) -> Tokenizer:
    if field(reader, "tokenizer.ggml.merges") is not None:
        merges = [tuple(m.split(" ")) for m in field(reader, "tokenizer.ggml.merges")]
    else:
        scores = required_field(reader, "tokenizer.ggml.scores", gguf_file)
        merges = sentencepiece_merges(tokens, scores, token_types)
    tokenizer = bpe_tokenizer(
        gguf_file,
        tokens,
        merges,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,  # characters outside the vocabulary become <0xNN> byte tokens
    )
    add_space_prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    # SentencePiece: spaces become "▁", the text gets one leading "▁", and no pre-splitting.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def token_text(reader: gguf.GGUFReader, key: str, tokens: list[str], gguf_file: Path) -> str | None:
    """The token a metadata id key (e.g. tokenizer.ggml.bos_token_id) names, if the file has it."""
    index = field(reader, key)
    if index is not None and not 0 <= index < len(tokens):
        raise ConversionError(f"{gguf_file}: {key} {index} is outside the vocabulary")
    return None if index is None else tokens[index]


def build_tokenizer(reader: gguf.GGUFReader, gguf_file: Path) -> tuple[Tokenizer, dict]:
    """The `tokenizers` Tokenizer the GGUF vocabulary describes, and tokenizer_config.json."""
    kind = required_field(reader, "tokenizer.ggml.model", gguf_file)
    tokens = required_field(reader, "tokenizer.ggml.tokens", gguf_file)
    token_types = field(reader, "tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        values = field(reader, key)
        if values is not None and len(values) != len(tokens):
            raise ConversionError(
                f"{gguf_file}: {key} has {len(values)} entries for {len(tokens)} tokens"
            )

    def token_at(key: str) -> str | None:
        return token_text(reader, key, tokens, gguf_file)

    if kind == "gpt2":
        tokenizer, add_bos_default = byte_level_model(reader, tokens, gguf_file), False
    elif kind == "llama":
        # llama.cpp adds BOS for a SentencePiece vocabulary that does not say otherwise.
        unk = token_at("tokenizer.ggml.unknown_token_id")
        tokenizer = sentencepiece_model(reader, tokens, token_types, unk, gguf_file)
        add_bos_default = True
    else:
        raise ConversionError(
            f"{gguf_file}: tokenizer model {kind!r} is not supported (gpt2, llama)"
        )
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=True)
            if token_type in ADDED_TOKEN_TYPES
        ]
    )

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    add_bos = (
        bool(field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    )
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        # As in HF's tokenizer.json: encode(add_special_tokens=True) adds them.
        single = " ".join(
            ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        )
        pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
        specials = [
            (t, tokenizer.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on
        ]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": field(reader, "tokenizer.chat_template"),
    }
    return tokenizer, {k: v for k, v in tokenizer_config.items() if v is not None}


def generation_config(reader: gguf.GGUFReader, config: dict) -> dict:
    # End-of-turn/end-of-message tokens also stop generation when the file names them.
    keys = (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    )
    stop_ids = []
    for index in (field(reader, key) for key in keys):
        if index is not None and index not in stop_ids:
            stop_ids.append(index)
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None),
    }


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def write_atomic(path: Path, write) -> None:
    """Write through a temporary file in the same directory, then rename over path."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False)))


def convert_gguf(
    gguf_file: Path, checkpoint_dir: Path, dtype: str = "float32", progress: bool = True
) -> dict:
    """Convert gguf_file into checkpoint_dir; returns the config written to config.json.

    Everything is read and checked before the first write, and model.pth is written last, so a
    failed conversion leaves no model.pth behind (prepare.sh takes model.pth as "done").
    """
    gguf_file, checkpoint_dir = Path(gguf_file), Path(checkpoint_dir)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    reader = open_gguf(gguf_file)
    try:
        config = config_from_gguf(reader, gguf_file, dtype)
        plan = tensor_plan(config)
        check_tensors(reader, plan, gguf_file)
        tokenizer, tokenizer_config = build_tokenizer(reader, gguf_file)
        state_dict = convert_tensors(reader, plan, DTYPES[dtype], progress=progress)
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as e:
        # A flipped bit turns a count into a string, a name into bytes that are not UTF-8, a
        # shape into nonsense: whatever the reader or this parsing trips on is the file's fault.
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"{gguf_file} is not a valid GGUF file (corrupt: {reason})") from e

    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        write_json(checkpoint_dir / "config.json", config)
        write_json(checkpoint_dir / "generation_config.json", generation_config(reader, config))
        write_json(checkpoint_dir / "tokenizer_config.json", tokenizer_config)
        write_atomic(checkpoint_dir / "tokenizer.json", lambda tmp: tokenizer.save(str(tmp)))
        write_atomic(checkpoint_dir / "model.pth", lambda tmp: torch.save(state_dict, tmp))
    except OSError as e:  # no space left, no permission, a file where the folder should be
        raise ConversionError(f"cannot write {checkpoint_dir}: {e.strerror or e}") from e
    return config


def main(gguf_file: Path, checkpoint_dir: Path, dtype: str) -> None:
    start = time.perf_counter()
    try:
        config = convert_gguf(gguf_file, checkpoint_dir, dtype)
    except ConversionError as e:
        print(f"convert_gguf: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C: write_atomic has already removed its temporary file
        print("convert_gguf: interrupted, no model.pth written", file=sys.stderr)
        sys.exit(130)
    print(
        f"wrote {checkpoint_dir} ({config['num_hidden_layers']} layers, dim "
        f"{config['hidden_size']}, {dtype}) in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_file", type=Path, required=True, help="llama.cpp GGUF file")
    parser.add_argument(
        "--checkpoint_dir", type=Path, required=True, help="directory to write (created)"
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="dtype of model.pth tensors"
    )
    return parser


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))
