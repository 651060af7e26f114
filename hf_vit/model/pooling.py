"""Multi-head attention pooling ("MAP"), the head of big_vision's ViT and of SigLIP's vision tower: the pooled
representation `y` of equation (4) for `classifier="map"`. Its parameters are those of `torch.nn.MultiheadAttention`
(`attention.in_proj_weight` with rows [q; k; v], `attention.out_proj`), the `probe`, a LayerNorm and the model's MLP.
"""

from __future__ import annotations

import torch
from torch import nn


class MultiheadAttentionPooling(nn.Module):
    """`y = z + MLP(LN(z))` where `z = MHA(probe, tokens, tokens)`: one pooled vector per image."""

    def __init__(self, hidden_size: int, num_heads: int, layer_norm_eps: float, mlp: nn.Module) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, hidden_size))
        self.attention = nn.MultiheadAttention(hidden_size, num_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.mlp = mlp

    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens` `(B, N, D)`; `token_mask` `(B, N)` marks those the probe may attend to (all without it: a
        native-aspect batch leaves its padding out)."""
        probe = self.probe.expand(tokens.shape[0], -1, -1)
        ignored = None if token_mask is None else ~token_mask.bool()
        pooled = self.attention(probe, tokens, tokens, key_padding_mask=ignored, need_weights=False)[0]
        pooled = pooled + self.mlp(self.layernorm(pooled))
        return pooled[:, 0]
