"""ModelConfig: the model's hyper-parameters, read from GGUF metadata and checked for sanity."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engine.errors import GGUFError
from engine.formats.metadata import Metadata

SUPPORTED_ARCHS = ("llama", "qwen2")
ROPE_TYPE = {"llama": "normal", "qwen2": "neox"}  # normal: adjacent pairs; neox: halves

# Upper limits for fields that size allocations; far above any 7B-class model.
_LIMITS = {"block_count": 512, "embedding_length": 65536, "feed_forward_length": 262144,
           "attention.head_count": 1024, "attention.head_count_kv": 1024,
           "context_length": 1 << 22, "attention.key_length": 4096}
_REQUIRED = object()


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
    def from_metadata(cls, md: Mapping[str, Any] | Metadata, tensor_names: set[str], vocab_size: int,
                      source: str) -> "ModelConfig":
        """Every field through the typed accessor (engine.formats.metadata): integers must be
        integer-typed and in range, floats finite, strings strings; the key is named on error."""
        m = md if isinstance(md, Metadata) else Metadata(md, source)
        arch = m.string("general.architecture", choices=SUPPORTED_ARCHS)

        def count(name: str, default: Any = _REQUIRED) -> int:
            kw = {} if default is _REQUIRED else {"default": default}
            return m.integer(f"{arch}.{name}", lo=1, hi=_LIMITS[name], **kw)

        n_layers = count("block_count")
        d_model = count("embedding_length")
        d_ff = count("feed_forward_length")
        n_heads = count("attention.head_count")
        n_kv_heads = count("attention.head_count_kv", n_heads)
        n_ctx = count("context_length")
        rope_base = m.number(f"{arch}.rope.freq_base", default=10000.0, positive=True)
        rms_eps = m.number(f"{arch}.attention.layer_norm_rms_epsilon", default=1e-5, positive=True, hi=1.0)
        if d_model % n_heads:
            raise GGUFError(f"{source}: field '{arch}.embedding_length' = {d_model} is not a "
                            f"multiple of head_count ({n_heads})")
        head_dim = m.integer(f"{arch}.attention.key_length", default=d_model // n_heads, lo=1,
                             hi=_LIMITS["attention.key_length"])
        if head_dim * n_heads != d_model:
            raise GGUFError(f"{source}: field '{arch}.attention.key_length' = {head_dim} x head_count "
                            f"({n_heads}) is not embedding_length ({d_model})")
        value_dim = m.integer(f"{arch}.attention.value_length", default=head_dim, lo=1,
                              hi=_LIMITS["attention.key_length"])
        if value_dim != head_dim:
            raise GGUFError(f"{source}: field '{arch}.attention.value_length' = {value_dim} differs "
                            f"from the key length {head_dim}: not supported")
        if head_dim % 2:
            raise GGUFError(f"{source}: head size {head_dim} is odd; RoPE needs pairs")
        rope_dims = m.integer(f"{arch}.rope.dimension_count", default=head_dim, lo=1,
                              hi=_LIMITS["attention.key_length"])
        if rope_dims != head_dim:
            raise GGUFError(f"{source}: field '{arch}.rope.dimension_count' = {rope_dims} is not the "
                            f"head size {head_dim}: partial RoPE is not supported")
        if n_heads % n_kv_heads:
            raise GGUFError(f"{source}: field '{arch}.attention.head_count_kv' = {n_kv_heads} "
                            f"does not divide head_count = {n_heads}")
        m.string(f"{arch}.rope.scaling.type", default="none", choices=("none",))
        return cls(arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                   n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=d_ff, vocab_size=vocab_size,
                   n_ctx_train=n_ctx, rope_base=rope_base, rope_type=ROPE_TYPE[arch],
                   rms_eps=rms_eps, has_qkv_bias="blk.0.attn_q.bias" in tensor_names,
                   tied_output="output.weight" not in tensor_names)
