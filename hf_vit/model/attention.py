"""The attention functions the model can run, chosen in one place: transformers' own (`ALL_ATTENTION_FUNCTIONS`),
with `"sdpa"` overridden locally, as transformers' `AttentionInterface` is meant to be, by a function that takes two
batched matmuls where they beat torch's SDPA kernels (CPU training in half precision).

Every function it returns also takes, in place of a mask, `AttentionSegments` (`layout.py`): runs of consecutive
tokens that attend only among themselves (the images of a padded or packed batch, each row's padding its own run),
run each implementation's own way (`segment_attention_path`). The runs are data and the longest is bounded by a
shape: nothing here reads a value back from a GPU (on CPU, a packed batch's run lengths are read from host memory),
and a compiled model takes every batch of one shape in one graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface
from transformers.utils import logging

from .layout import AttentionSegments

try:  # torch >= 2.10: flash attention over cumulative sequence lengths, CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

logger = logging.get_logger(__name__)

__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "MATMUL_ATTENTION_MAX_TOKENS",
    "AttentionSegments",
    "eager_attention_forward",
    "matmul_attention_forward",
    "prefers_matmul_attention",
    "segment_attention_path",
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
    """Whether `matmul_attention_forward` beats SDPA's kernels for `query`: CPU, half precision, training (without
    autograd, and in fp32, SDPA is faster: docs/benchmarks.md, "Measurements behind choices in the code").

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


@functools.lru_cache(maxsize=8)
def _device_capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@torch.compiler.assume_constant_result  # a compiled block (fullgraph) asks it too: a constant, not traced
def _flash_capable(device_index: int | None) -> bool:
    """Whether the GPU runs torch's flash attention kernels (Ampere or newer)."""
    return _device_capability(device_index) >= (8, 0)


def segment_attention_path(
    implementation: str, device: torch.device, dtype: torch.dtype, dropout: float, head_dim: int, runs: bool = False
) -> str:
    """How attention restricted to runs (`AttentionSegments`) runs for `implementation` on `device` and `dtype`:

    - "flash": transformers' flash attention over the runs (`cu_seq_lens_q/k`, `max_length_q/k`);
    - "varlen": torch's `varlen_attn` (SDPA or flex attention asked for; CUDA, half precision, no dropout, a head
      size flash kernels take);
    - "runs": SDPA (or flex attention) where the `runs`' lengths were read from host memory (a packed batch on CPU,
      `layout.values_on_host`) and are used in eager mode: the stream split into its runs (views), each attended alone;
    - "images": everything else (a padded batch's SDPA on CPU, or on a GPU in fp32 or with dropout; flex attention by
      SDPA; eager, which returns the probabilities; compiled; attention functions registered by others): each
      image's tokens in a row of their own (a packed batch's gathered there and back), the rest masked as keys.
    No path computes a score between two images.
    """
    if "flash" in implementation:  # transformers' test for its flash implementations, kernels from the Hub included
        return "flash"
    if (
        implementation in ("sdpa", "flex_attention")
        and varlen_attn is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and dropout == 0.0
        and head_dim % 8 == 0
        and head_dim <= 256
        and _flash_capable(device.index)
    ):
        return "varlen"
    if runs and implementation in ("sdpa", "flex_attention"):
        return "runs"
    return "images"


def segment_attention_forward(
    implementation: str,
    function: Callable,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: AttentionSegments,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of `(B, heads, N, d_h)` inputs restricted to `segments`, by `segment_attention_path`; output
    `(B, N, heads, d_h)` and the probabilities where the implementation gives them."""
    batch, heads, tokens, head_dim = query.shape
    blocks = segments.blocks_shape
    if (batch, tokens) != blocks:
        raise ValueError(
            f"The attention segments describe {blocks[0]} rows of {blocks[1]} tokens, but the queries are {batch} "
            f"rows of {tokens}."
        )
    # the runs' lengths are read in eager mode only: a graph would guard on their count (one graph per count)
    runs = not torch.compiler.is_compiling() and segments.run_lengths is not None
    path = segment_attention_path(implementation, query.device, query.dtype, dropout, head_dim, runs)
    if not torch.compiler.is_compiling():  # the logs are printed before compiling, at the first call
        if implementation == "flex_attention":
            logger.warning_once(
                "flex_attention builds a block mask per batch; batches with padding or packed images run through "
                f"the SDPA path instead ({path})."
            )
        logger.info_once(f"Attention restricted to each image: {implementation} runs it as {path!r}.")
    cu_seqlens, longest = segments.cu_seqlens.to(query.device), segments.max_seqlen
    if path == "flash":
        return function(
            module, query, key, value, None, scaling=scaling, dropout=dropout, cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest, **kwargs,
        )  # fmt: skip
    if path == "varlen":
        # (B, heads, N, d_h) -> (B * N, heads, d_h): the tokens flattened, a view of the qkv projection's output.
        # The longest run is bounded by a shape: the kernels take a larger bound, and the runs stay data.
        flat = [tensor.transpose(1, 2).reshape(batch * tokens, heads, head_dim) for tensor in (query, key, value)]
        output = varlen_attn(*flat, cu_seqlens, cu_seqlens, longest, longest, scale=scaling)
        return output.view(batch, tokens, heads, head_dim), None
    if implementation == "flex_attention":  # handed to SDPA: a block mask would be built for every batch
        function = sdpa_or_matmul_attention_forward
    if path == "runs":
        sizes = segments.run_lengths
        runs = zip(*(tensor.split(sizes, dim=2) for tensor in (query, key, value)))
        outputs = [function(module, *run, None, scaling=scaling, dropout=dropout)[0] for run in runs]
        return torch.cat(outputs, dim=1).view(batch, tokens, heads, head_dim), None
    # each image's tokens in a row of their own (a view where the rows are the images), the rest masked as keys
    per_image = [
        segments.to_images(tensor.transpose(1, 2), masked=True).transpose(1, 2) for tensor in (query, key, value)
    ]
    mask = _key_mask(segments.token_mask.to(query.device), query.dtype)
    output, probs = function(module, *per_image, mask, scaling=scaling, dropout=dropout, **kwargs)
    return segments.to_blocks(output, blocks), probs  # zero on a packed batch's padding, which feeds nothing


def _key_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive `(B, 1, N, N)` mask (a broadcast view) that hides the keys `valid` `(B, N)` does not mark."""
    rows, tokens = valid.shape
    mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, torch.finfo(dtype).min)
    return mask[:, None, None, :].expand(rows, 1, tokens, tokens)


class _SegmentAwareAttentionInterface(AttentionInterface):
    """transformers' `AttentionInterface` whose functions also take `AttentionSegments` in place of a mask."""

    # One wrapper per (implementation, function), in a plain dict: torch.compile traces a dict lookup, where it warns
    # at every compilation about an lru_cache it cannot see through.
    _segment_aware: dict[tuple[str, Callable], Callable] = {}

    def get_interface(self, attn_implementation: str, default: Callable) -> Callable:
        function = super().get_interface(attn_implementation, default)
        implementation = attn_implementation or "eager"
        cached = (implementation, function)
        if cached in self._segment_aware:
            return self._segment_aware[cached]

        @functools.wraps(function)
        def forward(module, query, key, value, attention_mask, *args, scaling=None, dropout=0.0, **kwargs):
            if isinstance(attention_mask, AttentionSegments):
                return segment_attention_forward(
                    implementation, function, module, query, key, value, attention_mask, scaling, dropout, **kwargs
                )
            return function(
                module, query, key, value, attention_mask, *args, scaling=scaling, dropout=dropout, **kwargs
            )

        self._segment_aware[cached] = forward
        return forward


ALL_ATTENTION_FUNCTIONS = _SegmentAwareAttentionInterface()
ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_or_matmul_attention_forward
