"""The rotary embedding's cos and sin tables of a model, made once for a prefix of positions
and regrown (doubling) when a forward reaches past them."""

from __future__ import annotations

import torch

from pipeline.model.layers import signed_sin


class RotaryTables:
    def __init__(self, rotary: torch.nn.Module, head_dim: int, max_context: int, dtype: torch.dtype, device) -> None:
        """`rotary`: transformers' rotary embedding of the model's config (its scaling included)."""
        self.rotary, self.max_context, self.dtype, self.device = rotary, max_context, dtype, device
        self.cos = torch.empty(0, 1, head_dim, device=device)
        self.sin = torch.empty(0, 1, head_dim, device=device)

    def up_to(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [n >= end, 1, head_dim]: rows broadcast over heads, the sine signed as
        layers.apply_rotary takes it."""
        if end > self.cos.shape[0]:
            size = min(max(end, 2 * self.cos.shape[0], 1024), max(end, self.max_context))
            positions = torch.arange(size, device=self.device)[None]
            probe = torch.empty(0, dtype=torch.float32, device=self.device)
            cos, sin = self.rotary(probe, positions)
            self.cos, self.sin = cos[0, :, None].to(self.dtype), signed_sin(sin[0, :, None].to(self.dtype))
        return self.cos, self.sin
