"""The attention functions the model can run, chosen in one place: transformers' own (`ALL_ATTENTION_FUNCTIONS`),
with `"sdpa"` overridden locally, as transformers' `AttentionInterface` is meant to be, by a function that takes two
batched matmuls where they beat torch's SDPA kernels (CPU training in half precision).

Every function it returns also takes, in place of a mask, `AttentionSegments`: runs of consecutive tokens that attend
only among themselves (the images of a padded or packed batch, each row's padding its own run), as cumulative sequence
lengths over the flattened tokens. Each implementation runs them its own way (`segment_attention_path`): flash
attention through transformers' variable-length path (`cu_seq_lens_q/k`), SDPA on a CUDA GPU in half precision through
torch's `varlen_attn`, SDPA on CPU one call per run length, SDPA on a GPU in fp32 or with dropout and the eager
implementation (the one that returns probabilities) with a block-diagonal mask; flex attention hands such batches to
the SDPA path. Under torch.compile `varlen_attn` stays (the runs are data, the longest bounded by the row's length),
and the per-length CPU calls become the block-diagonal mask: one graph for every batch of one shape.

Saved next to checkpoints as remote code with the model, so it imports only torch and transformers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface
from transformers.utils import logging
from transformers.vision_utils import get_vision_cu_seqlens

try:  # torch >= 2.10: flash attention over cumulative sequence lengths, CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

logger = logging.get_logger(__name__)

__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "MATMUL_ATTENTION_MAX_TOKENS",
    "AttentionSegments",
    "attention_segments",
    "SEGMENTS_MIN_PADDING_SHARE",
    "eager_attention_forward",
    "matmul_attention_forward",
    "padded_batch_segments",
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


@dataclass(frozen=True, eq=False)
class AttentionSegments:
    """Runs of consecutive tokens of a `(batch, tokens)` batch that attend only among themselves, as the kernels of
    variable-length attention take them: `cu_seqlens` `(runs + 1,)` int32, the runs' boundaries in the batch's tokens
    flattened row after row, on the tokens' device; `max_seqlen`, the longest run, and `lengths`, every run's, as
    Python ints (known on the host, so no kernel waits for the device to tell them); `padding`, which runs are a
    row's padding; `token_runs`, the run of each token."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    lengths: tuple[int, ...]
    batch_size: int
    row_length: int
    padding: tuple[bool, ...]  # which runs are a row's padding
    token_runs: torch.Tensor  # (batch, tokens) int32: the run of each token

    def block_diagonal_mask(self) -> torch.Tensor:
        """`(batch, 1, tokens, tokens)` bool: True where query and key are in one run. Built from `token_runs`, whose
        shape is the batch's, so a compiled model takes every batch of one shape in one graph."""
        runs = self.token_runs
        return (runs[:, :, None] == runs[:, None, :])[:, None]


@torch.compiler.disable  # host bookkeeping: compiled, it would guard on every run length and recompile per batch
def attention_segments(
    rows: Sequence[Sequence[int]], row_length: int, device: torch.device | str | None = None
) -> AttentionSegments | None:
    """The runs of a batch whose row `i` holds runs of `rows[i]` tokens (an image's tokens each, in order) and then
    padding up to `row_length`; each row's padding is a run of its own, so no image attends to it and it attends to
    no image. None when every row is one run that fills it: such a batch needs no mask at all."""
    if isinstance(row_length, bool) or not isinstance(row_length, int) or row_length < 1:
        raise ValueError(f"`row_length` must be a positive int, got {row_length!r}.")
    lengths, padding_runs = [], []
    for index, row in enumerate(rows):
        row = [int(length) for length in row]
        if any(length < 1 for length in row) or sum(row) > row_length:
            raise ValueError(
                f"Row {index} of `rows` holds runs of {row} tokens: each must be at least 1 token and together at "
                f"most `row_length` = {row_length}."
            )
        padding = row_length - sum(row)
        lengths.extend(row + [padding] if padding else row)
        padding_runs.extend([False] * len(row) + ([True] if padding else []))
    if not lengths:
        raise ValueError("`rows` is empty: a batch has at least one row.")
    if len(lengths) == len(rows):
        return None
    # transformers' cumulative lengths of per-image grids, each run a 1 x length x 1 grid
    grids = torch.tensor([(1, length, 1) for length in lengths])
    # host to device without waiting for the device's queue (a pageable copy is staged at once)
    cu_seqlens = get_vision_cu_seqlens(grids).to(device, non_blocking=True)
    token_runs = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    return AttentionSegments(
        cu_seqlens, max(lengths), tuple(lengths), len(rows), row_length, tuple(padding_runs),
        token_runs.view(len(rows), row_length).to(device, non_blocking=True),
    )  # fmt: skip


# Below this share of padding, SDPA on CPU keeps the padding mask for a padded batch: one fused call over the batch
# then beats one call per image length (measured with benchmarks/packing_speed.py at width 768: attention 0.95x at 5%
# padding, 1.3x faster at 25%).
SEGMENTS_MIN_PADDING_SHARE = 0.1


@torch.compiler.disable  # reads the row lengths on the host: compiled, it would recompile for each batch's lengths
def padded_batch_segments(
    token_mask: torch.Tensor, implementation: str, dtype: torch.dtype, dropout: float, head_dim: int
) -> AttentionSegments | None:
    """The runs of a padded batch (`token_mask` `(B, N)`: each row's tokens first, its padding after them) where
    attention restricted to each row's tokens is the faster way for `implementation` to leave the padding out: always
    through `varlen_attn`, and for flex attention (whose block mask would be built per batch); on CPU from
    `SEGMENTS_MIN_PADDING_SHARE` of padding up. None elsewhere: the caller masks the padding (flash attention unpads
    such a mask itself), or passes no mask where the batch has no padding. Reads the row lengths on the host."""
    if torch.compiler.is_exporting():  # a graph takes any batch: the mask is computed from data, the runs are not
        return None
    lengths = token_mask.sum(dim=1).tolist()
    batch, tokens = token_mask.shape
    padding_share = 1 - sum(lengths) / (batch * tokens)
    if padding_share == 0:
        return None
    path = segment_attention_path(implementation, token_mask.device, dtype, dropout, head_dim)
    worth_it = (
        path == "varlen"
        or implementation == "flex_attention"
        or (path == "segments" and padding_share >= SEGMENTS_MIN_PADDING_SHARE)
    )
    return attention_segments([[length] for length in lengths], tokens, token_mask.device) if worth_it else None


@functools.lru_cache(maxsize=8)
def _device_capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@torch.compiler.assume_constant_result  # a compiled block (fullgraph) asks it too: a constant, not traced
def _flash_capable(device_index: int | None) -> bool:
    """Whether the GPU runs torch's flash attention kernels (Ampere or newer)."""
    return _device_capability(device_index) >= (8, 0)


def segment_attention_path(
    implementation: str, device: torch.device, dtype: torch.dtype, dropout: float, head_dim: int
) -> str:
    """How attention restricted to runs (`AttentionSegments`) runs for `implementation` on `device` and `dtype`:

    - "flash": transformers' flash attention over the runs (`cu_seq_lens_q/k`, `max_length_q/k`);
    - "varlen": torch's `varlen_attn` (SDPA or flex attention asked for; CUDA, half precision, no dropout, a head
      size flash kernels take);
    - "segments": one SDPA call per distinct run length, on the gathered runs (SDPA or flex attention on CPU: no work
      spent on tokens of other images or on the padding);
    - "mask": the implementation itself with a block-diagonal mask (eager, which returns the probabilities, and
      attention functions registered by others), SDPA with it on a GPU where `varlen_attn` does not apply (fp32,
      dropout): there one fused kernel beats a kernel launch per run length.
    """
    if "flash" in implementation:  # transformers' test for its flash implementations, kernels from the Hub included
        return "flash"
    if implementation not in ("sdpa", "flex_attention"):
        return "mask"
    if (
        varlen_attn is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and dropout == 0.0
        and head_dim % 8 == 0
        and head_dim <= 256
        and _flash_capable(device.index)
    ):
        return "varlen"
    return "segments" if device.type == "cpu" else "mask"


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
    if (batch, tokens) != (segments.batch_size, segments.row_length):
        raise ValueError(
            f"The attention segments describe {segments.batch_size} rows of {segments.row_length} tokens, but the "
            f"queries are {batch} rows of {tokens}."
        )
    path = segment_attention_path(implementation, query.device, query.dtype, dropout, head_dim)
    compiling = torch.compiler.is_compiling()
    if compiling:
        if path == "segments":
            path = "mask"  # one graph for every batch of these shapes: a mask is data, the run lengths are not
    else:  # the logs are printed before compiling, at the first call
        if implementation == "flex_attention":
            logger.warning_once(
                "flex_attention builds a block mask per batch; batches with padding or packed images run through "
                f"the SDPA path instead ({path})."
            )
        logger.info_once(f"Attention restricted to each image: {implementation} runs it as {path!r}.")
    if path == "flash":
        cu_seqlens, longest = segments.cu_seqlens, segments.max_seqlen
        return function(
            module, query, key, value, None, scaling=scaling, dropout=dropout, cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest, **kwargs,
        )  # fmt: skip
    if path == "mask":
        same_run, dtype = segments.block_diagonal_mask(), query.dtype
        mask = torch.zeros(same_run.shape, dtype=dtype, device=query.device)
        mask = mask.masked_fill(~same_run.to(query.device), torch.finfo(dtype).min)  # additive: every function adds it
        if implementation == "flex_attention":  # handed to SDPA: a block mask would be built for every batch
            function = sdpa_or_matmul_attention_forward
        return function(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    # (B, heads, N, d_h) -> (B * N, heads, d_h): the tokens flattened, a view of the qkv projection's output
    flat = [tensor.transpose(1, 2).reshape(batch * tokens, heads, head_dim) for tensor in (query, key, value)]
    if path == "varlen":
        # Compiled, the longest run is bounded by the row's length, a shape: the graph holds for any runs of these
        # rows (varlen_attn is a custom op that takes the runs as data; its kernels take a larger bound).
        longest = segments.row_length if compiling else segments.max_seqlen
        cu_seqlens = segments.cu_seqlens.to(query.device)
        output = varlen_attn(*flat, cu_seqlens, cu_seqlens, longest, longest, scale=scaling)
        return output.view(batch, tokens, heads, head_dim), None
    output = _per_run_length(module, flat, segments.lengths, scaling, dropout, segments.padding)
    return output.view(batch, tokens, heads, head_dim), None


def _per_run_length(
    module: nn.Module,
    flat: list[torch.Tensor],
    lengths: Sequence[int],
    scaling: float,
    dropout: float,
    padding: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Attention within runs of the flattened `(T, heads, d_h)` tokens, one SDPA (or matmul) call per distinct run
    length, the runs of that length stacked into its batch; runs marked `padding` are not computed (their outputs are
    zero: nothing reads them). Returns `(T, heads, d_h)`.

    The runs are `split` views and the outputs one `cat`, whose backwards are one `cat` and views: gathering with an
    index instead made every group's backward fill a zero tensor of all T tokens (a training step 2x slower than the
    masked batch on CPU)."""
    padding = padding or (False,) * len(lengths)
    runs = [tensor.split(list(lengths)) for tensor in flat]
    outputs: list[torch.Tensor | None] = [None] * len(lengths)
    runs_of: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        if padding[index]:
            outputs[index] = flat[0].new_zeros(length, *flat[0].shape[1:])
        else:
            runs_of.setdefault(length, []).append(index)
    for indices in runs_of.values():
        # (runs, heads, length, d_h): a view where the length has one run, else one stacked copy
        query, key, value = (
            (part[indices[0]][None] if len(indices) == 1 else torch.stack([part[i] for i in indices])).transpose(1, 2)
            for part in runs
        )
        for index, run in zip(indices, _attend(module, query, key, value, scaling, dropout).unbind(0)):
            outputs[index] = run  # (length, heads, d_h)
    return torch.cat(outputs)


def _attend(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, dropout: float
) -> torch.Tensor:
    """`sdpa_or_matmul_attention_forward` without a mask, `(B, N, heads, d_h)`, left a transposed view: the caller's
    `cat` is the one copy (transformers' SDPA function would copy it first)."""
    if prefers_matmul_attention(query, module.training):
        return matmul_attention_forward(module, query, key, value, None, scaling, dropout)[0]
    dropout = dropout if module.training else 0.0
    return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling).transpose(1, 2)


class _SegmentAwareAttentionInterface(AttentionInterface):
    """transformers' `AttentionInterface` whose functions also take `AttentionSegments` in place of a mask."""

    def get_interface(self, attn_implementation: str, default: Callable) -> Callable:
        function = super().get_interface(attn_implementation, default)
        return _taking_segments(attn_implementation or "eager", function)


# One wrapper per (implementation, function), in a plain dict: torch.compile traces a dict lookup, where it warns at
# every compilation about an lru_cache it cannot see through.
_SEGMENT_AWARE: dict[tuple[str, Callable], Callable] = {}


def _taking_segments(implementation: str, function: Callable) -> Callable:
    key = (implementation, function)
    if key not in _SEGMENT_AWARE:
        _SEGMENT_AWARE[key] = _segment_aware(implementation, function)
    return _SEGMENT_AWARE[key]


def _segment_aware(implementation: str, function: Callable) -> Callable:
    @functools.wraps(function)
    def forward(module, query, key, value, attention_mask, *args, scaling=None, dropout=0.0, **kwargs):
        if isinstance(attention_mask, AttentionSegments):
            return segment_attention_forward(
                implementation, function, module, query, key, value, attention_mask, scaling, dropout, **kwargs
            )
        return function(module, query, key, value, attention_mask, *args, scaling=scaling, dropout=dropout, **kwargs)

    return forward


# transformers' attention functions, with "sdpa" overridden for this model only.
ALL_ATTENTION_FUNCTIONS = _SegmentAwareAttentionInterface()
ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_or_matmul_attention_forward
