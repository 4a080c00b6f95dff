"""ModelConfig: the model's hyper-parameters, read from GGUF metadata and checked for sanity."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import GGUFError

SUPPORTED_ARCHS = ("llama", "qwen2")
ROPE_TYPE = {"llama": "normal", "qwen2": "neox"}  # normal: adjacent pairs; neox: halves

# Upper limits for fields that size allocations; far above any 7B-class model.
_LIMITS = {"block_count": 512, "embedding_length": 65536, "feed_forward_length": 262144,
           "attention.head_count": 1024, "attention.head_count_kv": 1024,
           "context_length": 1 << 22}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    n_ctx_train: int
    rope_base: float
    rope_type: str
    rms_eps: float
    has_qkv_bias: bool
    tied_output: bool

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_metadata(cls, md: dict[str, Any], tensor_names: set[str], vocab_size: int,
                      source: str) -> "ModelConfig":
        arch = md.get("general.architecture")
        if arch is None:
            raise GGUFError(f"{source}: missing metadata field 'general.architecture'")
        if arch not in SUPPORTED_ARCHS:
            raise GGUFError(f"{source}: field 'general.architecture' = {arch!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHS)})")

        def field(name: str, kind: type, default: Any = None):
            key = f"{arch}.{name}"
            value = md.get(key, default)
            if value is None:
                raise GGUFError(f"{source}: missing metadata field '{key}'")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GGUFError(f"{source}: metadata field '{key}' = {value!r} is not a number")
            if kind is int:
                if int(value) != value or value <= 0 or value > _LIMITS.get(name, 1 << 31):
                    raise GGUFError(f"{source}: metadata field '{key}' = {value} is out of range")
                return int(value)
            if not value > 0:
                raise GGUFError(f"{source}: metadata field '{key}' = {value} must be positive")
            return float(value)

        n_layers = field("block_count", int)
        d_model = field("embedding_length", int)
        d_ff = field("feed_forward_length", int)
        n_heads = field("attention.head_count", int)
        n_kv_heads = field("attention.head_count_kv", int, n_heads)
        n_ctx = field("context_length", int)
        rope_base = field("rope.freq_base", float, 10000.0)
        rms_eps = field("attention.layer_norm_rms_epsilon", float, 1e-5)
        head_dim = md.get(f"{arch}.attention.key_length", d_model // n_heads)
        if d_model % n_heads or head_dim * n_heads != d_model:
            raise GGUFError(f"{source}: field '{arch}.embedding_length' = {d_model} is not "
                            f"head_count ({n_heads}) x head size")
        if head_dim % 2:
            raise GGUFError(f"{source}: head size {head_dim} is odd; RoPE needs pairs")
        if n_heads % n_kv_heads:
            raise GGUFError(f"{source}: field '{arch}.attention.head_count_kv' = {n_kv_heads} "
                            f"does not divide head_count = {n_heads}")
        scaling = md.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise GGUFError(f"{source}: field '{arch}.rope.scaling.type' = {scaling!r} is not supported")
        return cls(arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                   n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=d_ff, vocab_size=vocab_size,
                   n_ctx_train=n_ctx, rope_base=rope_base, rope_type=ROPE_TYPE[arch],
                   rms_eps=rms_eps, has_qkv_bias="blk.0.attn_q.bias" in tensor_names,
                   tied_output="output.weight" not in tensor_names)
