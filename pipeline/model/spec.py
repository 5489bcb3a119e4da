"""The shape of a supported decoder, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import UnsupportedModelError
from pipeline.model import items

# Llama-style decoders: RMSNorm, rotary attention with grouped KV heads, gated SiLU MLP.
# Qwen2 adds q/k/v biases, Qwen3 adds per-head RMSNorm of q and k.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def num_items(self) -> int:
        """Sublayers (pipeline.model.items): an attention and an MLP item per layer."""
        return items.num_items(self.num_layers)

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config) -> ModelSpec:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; this engine runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"activation {act!r} is not supported (expected 'silu')")
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(f"{num_heads} attention heads do not split into {num_kv_heads} KV groups")
        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(getattr(config, "attention_bias", False))
        if getattr(config, "mlp_bias", False):
            raise UnsupportedModelError("MLP biases are not supported")
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
        )


def sliding_window_of(config) -> int | None:
    """The attention window a config actually applies to every layer, or None."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if getattr(config, "model_type", None) in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return int(window)
