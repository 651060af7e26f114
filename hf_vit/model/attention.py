"""The attention functions the model can run, chosen in one place: transformers' own (`ALL_ATTENTION_FUNCTIONS`),
with `"sdpa"` overridden locally, as transformers' `AttentionInterface` is meant to be, by a function that takes two
batched matmuls where they beat torch's SDPA kernels (CPU training in half precision).

Saved next to checkpoints as remote code with the model, so it imports only torch and transformers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "MATMUL_ATTENTION_MAX_TOKENS",
    "eager_attention_forward",
    "matmul_attention_forward",
    "prefers_matmul_attention",
]


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_h)) v and the probabilities. Inputs `(B, heads, N, d_h)`, output `(B, N, heads, d_h)`."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(F.dropout(probs, p=dropout, training=module.training), value)
    return output.transpose(1, 2), probs


def matmul_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """softmax(q k^T / sqrt(d_h)) v with two batched matmuls and the softmax in the inputs' dtype.

    The same function as SDPA, used where it is faster: training on CPU in bf16/fp16, where torch's CPU
    flash-attention backward runs its small matmuls far below the AMX/AVX-512 matmul speed and takes a third of a
    ViT-S step. It is not `eager_attention_forward` with another softmax dtype because it scales the (B, heads, N,
    d_h) queries rather than the larger (N, N) scores: a shared version scaling the scores made a bf16 ViT-S
    training step 2-7% slower. Inputs `(B, heads, N, d_h)`, output `(B, N, heads, d_h)`.
    """
    scores = torch.matmul(query * scaling, key.transpose(-1, -2))
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = F.dropout(scores.softmax(dim=-1), p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2), None


# Above this many tokens the matmul attention is left to SDPA: the probabilities it keeps for the backward grow as
# tokens², and its lead shrinks with them (measured: docs/benchmarks.md, "Measurements behind choices in the code").
MATMUL_ATTENTION_MAX_TOKENS = 1024


def prefers_matmul_attention(query: torch.Tensor, training: bool) -> bool:
    """Whether `matmul_attention_forward` beats SDPA's kernels for `query`: CPU, half precision, training.

    On CPU in half precision SDPA's math kernel is the slower of the two for training; without autograd, and in
    fp32, SDPA is faster (measured: docs/benchmarks.md, "Measurements behind choices in the code"). GPUs keep
    SDPA's fused kernels.

    "Training" is the module's mode or autograd being on: reentrant activation checkpointing runs the forward without
    autograd and recomputes it with autograd, and both passes must take the same path.
    """
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and (training or query.requires_grad)
        and query.shape[-2] <= MATMUL_ATTENTION_MAX_TOKENS
    )


def sdpa_or_matmul_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, or `matmul_attention_forward` where `prefers_matmul_attention` says so."""
    if prefers_matmul_attention(query, module.training):
        return matmul_attention_forward(module, query, key, value, attention_mask, scaling, dropout)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


# transformers' attention functions, with "sdpa" overridden for this model only.
ALL_ATTENTION_FUNCTIONS = AttentionInterface()
ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_or_matmul_attention_forward
