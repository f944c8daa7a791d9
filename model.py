# The Llama-family decoder: GQA, RoPE (plain, linear and Llama-3.1 scaled), SwiGLU, RMSNorm,
# optional q/k/v bias (Qwen2), tied or untied output head, Mixture-of-Experts feed-forward layers
# (Mixtral; moe.py, imported only for such models), and a static KV cache written in place at
# `input_pos` so that shapes never change under torch.compile.
#
#   from model import ModelArgs, Transformer
#   model = Transformer(ModelArgs.from_name("stories15M"))
#   model.setup_caches(max_batch_size=1, max_seq_len=256)
#   logits = model(idx, input_pos)  # idx [B, T] long, input_pos [T] long -> [B, T, vocab]
#
# Checkpoint layout (what the converters write): q/k rows of `wqkv` use the interleaved-pairs
# rotary layout (dims 2j and 2j+1 rotate together), as Meta's original weights and GGUF do.
import difflib
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


class ConfigError(ValueError):
    pass


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class ModelArgs:
    block_size: int = 2048  # the context length the model was trained for
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: dict | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # Llama's attention_bias also biases o_proj; Qwen2 biases q/k/v only
    num_experts: int = 0  # Mixture-of-Experts feed-forward with this many experts; 0: dense
    num_activated_experts: int = 2  # experts per token (MoE only)

    def __post_init__(self):
        # Fill only what was left unset; never overwrite a given value.
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_head
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = find_multiple(int(2 * 4 * self.dim / 3), 256)
        if self.n_head % self.n_kv_heads:
            raise ConfigError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.num_experts and not 0 < self.num_activated_experts <= self.num_experts:
            raise ConfigError(
                f"num_activated_experts ({self.num_activated_experts}) must be in "
                f"1..num_experts ({self.num_experts})"
            )
        if self.o_bias and not self.qkv_bias:
            raise ConfigError("an o_proj bias without q/k/v bias is not a supported layout")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise ConfigError(f"unsupported rope scaling type {kind!r} (llama3, linear)")

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        table = {k.lower(): k for k in transformer_configs}
        if name.lower() not in table:
            close = difflib.get_close_matches(name, list(transformer_configs), n=4, cutoff=0.3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise ConfigError(f"unknown model name {name!r}{hint}")
        return cls(**transformer_configs[table[name.lower()]])

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        # Maps a Hugging Face config.json (Llama, Mistral, Qwen2, Mixtral; transformers 4 or 5
        # style). Mixtral's router options (jitter noise, aux loss) only matter in training; its
        # sliding window is null in the released configs and otherwise treated as Mistral's.
        arch = (cfg.get("architectures") or [""])[0]
        model_type = cfg.get("model_type", "")
        known_type = model_type in ("llama", "mistral", "qwen2", "mixtral")
        if not known_type and arch not in _ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch or model_type!r} "
                f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
            )
        # transformers 5 nests rope_theta and the scaling under rope_parameters.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_base = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rope or None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        window = cfg.get("sliding_window")
        max_pos = cfg.get("max_position_embeddings", 2048)
        if cfg.get("use_sliding_window", model_type == "mistral") and window and window < max_pos:
            # A sliding window only changes attention beyond `window` tokens; cap the context.
            max_pos = window
        return cls(
            block_size=max_pos,
            vocab_size=cfg["vocab_size"],
            n_layer=cfg["num_hidden_layers"],
            n_head=cfg["num_attention_heads"],
            dim=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rope_base=float(rope_base),
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_scaling=scaling,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2",
            o_bias=bool(cfg.get("attention_bias", False)),
            num_experts=cfg.get("num_local_experts", 0),
            num_activated_experts=cfg.get("num_experts_per_tok", 2),
        )

    def to_config(self) -> dict:
        # The inverse of from_config: a Hugging Face style config.json for this model.
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.block_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_base,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.qkv_bias,
            **({} if self.o_bias == self.qkv_bias else {"model_type": "qwen2"}),
            **(
                {
                    "architectures": ["MixtralForCausalLM"],
                    "model_type": "mixtral",
                    "num_local_experts": self.num_experts,
                    "num_experts_per_tok": self.num_activated_experts,
                }
                if self.num_experts
                else {}
            ),
        }

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
}

_LLAMA31_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
_LLAMA32_SCALING = dict(_LLAMA31_SCALING, factor=32.0)
_LLAMA3 = dict(vocab_size=128256, n_kv_heads=8, rope_base=500000.0)
_SMOLLM2 = dict(block_size=8192, vocab_size=49152, tie_embeddings=True)
_MIXTRAL = dict(n_kv_heads=8, rope_base=1000000.0, num_experts=8, num_activated_experts=2)

# Names gpt-fast users know and the benchmarks use. A checkpoint's own config.json always wins.
transformer_configs = {
    "Llama-2-7B": dict(block_size=4096, n_layer=32, n_head=32, dim=4096, intermediate_size=11008),
    "Llama-2-13B": dict(block_size=4096, n_layer=40, n_head=40, dim=5120, intermediate_size=13824),
    "Llama-2-70B": dict(
        block_size=4096, n_layer=80, n_head=64, n_kv_heads=8, dim=8192, intermediate_size=28672
    ),
    "CodeLlama-7B": dict(
        block_size=16384,
        vocab_size=32016,
        n_layer=32,
        n_head=32,
        dim=4096,
        intermediate_size=11008,
        rope_base=1000000.0,
    ),
    "CodeLlama-34B": dict(
        block_size=16384,
        n_layer=48,
        n_head=64,
        n_kv_heads=8,
        dim=8192,
        intermediate_size=22016,
        rope_base=1000000.0,
    ),
    "Mistral-7B": dict(
        block_size=32768,
        n_layer=32,
        n_head=32,
        n_kv_heads=8,
        dim=4096,
        intermediate_size=14336,
        rope_base=1000000.0,
    ),
    "Llama-3-8B": dict(
        _LLAMA3, block_size=8192, n_layer=32, n_head=32, dim=4096, intermediate_size=14336
    ),
    "Llama-3-70B": dict(
        _LLAMA3, block_size=8192, n_layer=80, n_head=64, dim=8192, intermediate_size=28672
    ),
    "Llama-3.1-8B": dict(
        _LLAMA3,
        block_size=131072,
        n_layer=32,
        n_head=32,
        dim=4096,
        intermediate_size=14336,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "Llama-3.1-70B": dict(
        _LLAMA3,
        block_size=131072,
        n_layer=80,
        n_head=64,
        dim=8192,
        intermediate_size=28672,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "Llama-3.1-405B": dict(
        _LLAMA3,
        block_size=131072,
        n_layer=126,
        n_head=128,
        dim=16384,
        intermediate_size=53248,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "Llama-3.2-1B": dict(
        _LLAMA3,
        block_size=131072,
        n_layer=16,
        n_head=32,
        dim=2048,
        intermediate_size=8192,
        head_dim=64,
        tie_embeddings=True,
        rope_scaling=_LLAMA32_SCALING,
    ),
    "Llama-3.2-3B": dict(
        _LLAMA3,
        block_size=131072,
        n_layer=28,
        n_head=24,
        dim=3072,
        intermediate_size=8192,
        head_dim=128,
        tie_embeddings=True,
        rope_scaling=_LLAMA32_SCALING,
    ),
    "Mixtral-8x7B": dict(
        _MIXTRAL, block_size=32768, n_layer=32, n_head=32, dim=4096, intermediate_size=14336
    ),
    "Mixtral-8x22B": dict(
        _MIXTRAL,
        block_size=65536,
        vocab_size=32768,  # the Instruct model's (v0.1 base: 32000)
        n_layer=56,
        n_head=48,
        dim=6144,
        intermediate_size=16384,
    ),
    "stories15M": dict(block_size=256, n_layer=6, n_head=6, dim=288, intermediate_size=768),
    "stories42M": dict(block_size=1024, n_layer=8, n_head=8, dim=512, intermediate_size=1376),
    "stories110M": dict(block_size=1024, n_layer=12, n_head=12, dim=768, intermediate_size=2048),
    "SmolLM2-135M": dict(
        _SMOLLM2,
        n_layer=30,
        n_head=9,
        n_kv_heads=3,
        dim=576,
        intermediate_size=1536,
        rope_base=100000.0,
    ),
    "SmolLM2-360M": dict(
        _SMOLLM2,
        n_layer=32,
        n_head=15,
        n_kv_heads=5,
        dim=960,
        intermediate_size=2560,
        rope_base=100000.0,
    ),
    "SmolLM2-1.7B": dict(
        _SMOLLM2,
        n_layer=24,
        n_head=32,
        n_kv_heads=32,
        dim=2048,
        intermediate_size=8192,
        rope_base=130000.0,
    ),
}


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_len, n_kv_heads, head_dim, dtype, device=None):
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # input_pos [T]; k, v [B, n_kv_heads, T, head_dim], written in place.
        B = k.shape[0]
        self.k_cache[:B].index_copy_(2, input_pos, k)
        self.v_cache[:B].index_copy_(2, input_pos, v)
        return self.k_cache[:B], self.v_cache[:B]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Normalise in float32 like the reference implementations, then scale in x's dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        qkv_dim = (config.n_head + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=config.o_bias)
        self.kv_cache: KVCache | None = None
        self.attend = sdpa_attention  # kernels.use_kernels swaps in a flash-decoding kernel

    def forward(
        self,
        x: Tensor,
        freqs_cis: Tensor,
        rope_pos: Tensor,
        mask: Tensor | None,
        input_pos: Tensor,
    ) -> Tensor:
        return self.wo(self.attend_qkv(self.wqkv(x), freqs_cis, rope_pos, mask, input_pos))

    def attend_qkv(
        self,
        qkv: Tensor,
        freqs_cis: Tensor,
        rope_pos: Tensor,
        mask: Tensor | None,
        input_pos: Tensor,
    ) -> Tensor:
        # qkv [B, T, (n_head + 2 * n_kv_heads) * head_dim] -> attention output [B, T, q_dim]:
        # rotary embeddings at rope_pos [B|1, T] (angles: the table freqs_cis
        # [max_seq_len, head_dim/2, 2]), the cache write at input_pos [T], attention over the
        # cache.
        B, T, _ = qkv.shape
        q_dim = self.n_head * self.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        angles = freqs_cis[rope_pos]  # [B|1, T, head_dim/2, 2]
        q = apply_rotary_emb(q.view(B, T, self.n_head, self.head_dim), angles)
        k = apply_rotary_emb(k.view(B, T, self.n_kv_heads, self.head_dim), angles)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, n_kv_heads, max_seq_len, head_dim]
        if mask is None:
            # Prefill from slot 0: the first T slots hold exactly this prompt, so plain causal
            # attention over them is right and lets SDPA pick a flash kernel.
            y = F.scaled_dot_product_attention(
                q, k[:, :, :T], v[:, :, :T], is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            )
        else:
            y = self.attend(q, k, v, mask, input_pos)  # [B, n_head, T, head_dim]
        return y.transpose(1, 2).reshape(B, T, q_dim)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
    # q [B, n_head, T, head_dim]; k, v [B, n_kv_heads, S, head_dim]; mask [T, S] or [B, 1, T, S]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        # Gate (w1) and up (w3) projections fused: one read of x, one GEMV.
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w13(x)))


def swiglu(gate_up: Tensor) -> Tensor:
    # [..., 2 * intermediate] -> [..., intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        if config.num_experts:
            from moe import MOEFeedForward  # only MoE models need it

            self.feed_forward = MOEFeedForward(config)
        else:
            self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self, x: Tensor, freqs_cis: Tensor, rope_pos: Tensor, mask: Tensor | None,
        input_pos: Tensor,
    ) -> Tensor:  # fmt: skip
        h = x + self.attention(self.attention_norm(x), freqs_cis, rope_pos, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_len = -1

    def setup_caches(self, max_batch_size: int, max_seq_len: int):
        if self.max_batch_size >= max_batch_size and self.max_seq_len == max_seq_len:
            return
        dtype = self.tok_embeddings.weight.dtype
        device = self.tok_embeddings.weight.device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        for block in self.layers:
            attn = block.attention
            attn.kv_cache = KVCache(
                max_batch_size, max_seq_len, attn.n_kv_heads, attn.head_dim, dtype, device
            )
        freqs = precompute_freqs_cis(
            max_seq_len, self.config.head_dim, self.config.rope_base, self.config.rope_scaling
        )
        self.register_buffer("freqs_cis", freqs.to(device), persistent=False)

    def forward(
        self,
        idx: Tensor,
        input_pos: Tensor,
        pad: Tensor | None = None,
        last_logits_only: bool = False,
        from_zero: bool = False,
    ) -> Tensor:
        # idx [B, T]; input_pos [T] cache slots to write; pad [B] left-padding per row, so that
        # row b's text starts at slot pad[b] and its rotary positions start at 0 there.
        # from_zero: the caller promises input_pos == arange(T) (a fresh prompt, no padding).
        assert self.max_seq_len > 0, "call setup_caches() first"
        k_pos = torch.arange(self.max_seq_len, device=idx.device)
        mask = k_pos[None, :] <= input_pos[:, None]  # [T, S] causal over cache slots
        # The layers look the rotary angles up by position themselves: the decode kernel reads
        # its row of the table, where a gathered [1, T, head_dim/2, 2] would be one more
        # kernel (Inductor copies a computed input for each custom op call that takes it).
        if pad is None:
            rope_pos = input_pos[None]  # [1, T]
        else:
            # Pad slots stay visible to themselves only, so their rows never go NaN.
            not_pad = k_pos[None, None, :] >= pad[:, None, None]  # [B, 1, S]
            self_slot = k_pos[None, :] == input_pos[:, None]  # [T, S]
            mask = (mask & (not_pad | self_slot))[:, None]  # [B, 1, T, S]
            rope_pos = (input_pos[None, :] - pad[:, None]).clamp(min=0)  # [B, T]
        if from_zero and pad is None:
            mask = None
        elif idx.device.type == "cpu":
            # CPU SDPA is far slower with a boolean mask than with an additive one.
            zero = torch.zeros(mask.shape, device=idx.device, dtype=self.freqs_cis.dtype)
            mask = zero.masked_fill(~mask, -float("inf"))
        x = self.tok_embeddings(idx)  # [B, T, dim]
        for layer in self.layers:
            x = layer(x, self.freqs_cis, rope_pos, mask, input_pos)
        if last_logits_only:
            x = x[:, -1:]
        return self.output(self.norm(x))  # [B, T or 1, vocab]


# ---------------------------------------------------------------------------------------------
# Rotary embeddings
# ---------------------------------------------------------------------------------------------


def rope_frequencies(head_dim: int, base: float, scaling: dict | None) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = scaling and scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        freqs = freqs / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend
        # in between (wavelengths measured against the original context length).
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freqs
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * freqs / factor + smooth * freqs
        scaled = torch.where(wavelen > old_len / low, freqs / factor, blended)
        freqs = torch.where(wavelen < old_len / high, freqs, scaled)
    return freqs.float()


def precompute_freqs_cis(
    seq_len: int, head_dim: int, base: float = 10000.0, scaling: dict | None = None
) -> Tensor:
    freqs = rope_frequencies(head_dim, base, scaling)  # [head_dim/2]
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # [seq_len, head_dim/2, 2]


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    # x [B, T, heads, head_dim] with rotary pairs interleaved; freqs_cis [B|1, T, head_dim/2, 2].
    xp = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, T, heads, head_dim/2, 2]
    fc = freqs_cis[:, :, None]  # [B|1, T, 1, head_dim/2, 2]
    out = torch.stack(
        [
            xp[..., 0] * fc[..., 0] - xp[..., 1] * fc[..., 1],
            xp[..., 1] * fc[..., 0] + xp[..., 0] * fc[..., 1],
        ],
        dim=-1,
    )
    return out.flatten(3).type_as(x)
