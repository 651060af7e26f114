"""Native-aspect batches: every image at its own aspect ratio, as a grid of at most K patches, padded to K.

The image processor (`max_num_patches=K`; its `grid_for_max_patches` and `native_patch_batch`) resizes each image
to the largest patch grid of at most K patches that keeps its aspect ratio and returns, in the layout of
transformers' SigLIP 2 processor:

    pixel_values          (B, K, P * P * C)   each patch flattened in (patch row, patch column, channel) order
    pixel_attention_mask  (B, K)              1 for an image's patches, 0 for the padding after them
    spatial_shapes        (B, 2)              each image's grid (rows, columns)

The model's embeddings (equation 1, `VisionTransformerEmbeddings`) apply to the flattened patches the same linear map
E as the convolution of the ordinary path and resample the position embeddings to each image's grid
(`resolution.resample_position_embeddings`, once per distinct grid; while a graph is exported, where the grids are
data and not shapes, as weights computed from them, so the graph takes any number of patches and any grids). This
module checks such a batch, keeps the padded patches out of attention (each image's tokens a run of their own,
`AttentionSegments`, where variable-length attention is the faster way; else masked as keys; nothing without padding)
and out of the pooling: each image's outputs are those it has alone at its own size (`interpolate_pos_encoding`).

Saved next to checkpoints as remote code with the model, so it imports only torch and its siblings.
"""

from __future__ import annotations

import torch

from .attention import AttentionSegments, padded_batch_segments

__all__ = [
    "attention_mask_for",
    "check_native_batch",
    "masked_mean",
    "native_masks",
    "patch_grid_maps",
]


def check_native_batch(
    pixel_values: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None,
    spatial_shapes: torch.Tensor,
    config,
) -> torch.Tensor:
    """Refuse a native-aspect batch the model cannot embed, with the fix; return its patch mask `(B, K)` (bool).

    The mask may be left out: each image's `rows * cols` patches come first, the padding after them, which is what
    the mask must say when given."""
    if config.resnet_layers is not None:
        raise ValueError(
            "A hybrid model (ResNet stem) takes whole images, not flattened patches: process the images without "
            "`max_num_patches` and call the model without `spatial_shapes`."
        )
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 3 or not pixel_values.is_floating_point():
        raise ValueError(
            "With `spatial_shapes`, `pixel_values` must be a float tensor of flattened patches (batch, "
            f"max_num_patches, patch_size * patch_size * channels), got {_describe(pixel_values)}."
        )
    batch, count, width = pixel_values.shape
    patch, channels = config.patch_size, config.num_channels
    if width != patch * patch * channels:
        raise ValueError(
            f"`pixel_values` holds patches of {width} values, but the model's are {patch}x{patch}x{channels} = "
            f"{patch * patch * channels}: build the image processor with `patch_size={patch}`."
        )
    if not isinstance(spatial_shapes, torch.Tensor) or tuple(spatial_shapes.shape) != (batch, 2):
        raise ValueError(
            f"`spatial_shapes` must be a (batch, 2) tensor of each image's patch grid (rows, columns); got "
            f"{_describe(spatial_shapes)} for a batch of {batch}."
        )
    sizes = spatial_shapes[:, 0] * spatial_shapes[:, 1]
    patch_mask = torch.arange(count, device=pixel_values.device) < sizes.to(pixel_values.device)[:, None]
    if torch.compiler.is_exporting():  # the grids are the graph's data: their values are not known while tracing
        return patch_mask
    _check_grids(spatial_shapes, sizes, pixel_attention_mask, patch_mask)
    return patch_mask


@torch.compiler.disable  # reads values on the host: outside compiled graphs, where it would break one with a warning
def _check_grids(
    spatial_shapes: torch.Tensor,
    sizes: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None,
    patch_mask: torch.Tensor,
) -> None:
    batch, count = patch_mask.shape
    if bool((spatial_shapes < 1).any()) or bool((sizes > count).any()):
        raise ValueError(
            f"`spatial_shapes` {spatial_shapes.tolist()} must be grids of at least 1x1 and at most {count} patches "
            "(the patches per image in `pixel_values`)."
        )
    if pixel_attention_mask is not None:
        if tuple(pixel_attention_mask.shape) != (batch, count) or not torch.equal(
            pixel_attention_mask.to(patch_mask.device).bool(), patch_mask
        ):
            raise ValueError(
                f"`pixel_attention_mask` (shape {tuple(pixel_attention_mask.shape)}) must mark the first rows * cols "
                f"of each image's {count} patches (its grid in `spatial_shapes`) and nothing else, as the image "
                "processor returns it."
            )


@torch.compiler.disable  # as `_check_grids`
def _no_padding(token_mask: torch.Tensor) -> bool:
    return bool(token_mask.all())


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def native_masks(
    config,
    pixel_values: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None,
    spatial_shapes: torch.Tensor,
    output_attentions: bool,
    dtype: torch.dtype,
    training: bool = False,
    attention: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | AttentionSegments | None]:
    """The valid tokens `(B, prefix + K)` of a native-aspect batch (checked first: see `check_native_batch`) and what
    keeps the others out of attention: each image's tokens as a run of their own where that is faster
    (`padded_batch_segments`: variable-length attention on a GPU, and CPU batches with enough padding), else the
    attention mask hiding them from every query, in the form the model's attention takes (`attention_mask_for`;
    eager's when the probabilities are asked for) in the dtype of its weights; None for a batch without padding, and
    where `attention` is False (a packed batch's blocks take its layout's runs)."""
    patch_mask = check_native_batch(pixel_values, pixel_attention_mask, spatial_shapes, config)
    prefix = patch_mask.new_ones(patch_mask.shape[0], config.num_prefix_tokens)
    token_mask = torch.cat([prefix, patch_mask], dim=1)
    if not attention:
        return token_mask, None
    implementation = "eager" if output_attentions else config._attn_implementation
    if torch.compiler.is_exporting():  # the graph's mask is computed from its data
        return token_mask, attention_mask_for(token_mask, implementation, dtype)
    if _no_padding(token_mask):
        return token_mask, None
    dropout = config.attention_probs_dropout_prob if training else 0.0
    head_dim = config.hidden_size // config.num_attention_heads
    segments = padded_batch_segments(token_mask, implementation, _query_dtype(token_mask, dtype), dropout, head_dim)
    return token_mask, segments if segments is not None else attention_mask_for(token_mask, implementation, dtype)


def _query_dtype(token_mask: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype the attention's queries have: the weights' `dtype`, or autocast's."""
    device = token_mask.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else dtype


def attention_mask_for(token_mask: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask that keeps padded tokens out of every token's keys, in the form `implementation` takes:
    the `(B, N)` padding mask for flash attention, a `BlockMask` for flex attention (whose kernels skip the padded
    blocks), else an additive `(B, 1, N, N)` mask (a broadcast view: eager and SDPA read it per query and key) in the
    dtype the queries have: the model's `dtype`, or autocast's."""
    if "flash" in implementation:
        return token_mask.int()
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def valid_key(batch, head, query, key):
            return token_mask[batch, key]

        batch, tokens = token_mask.shape
        return create_block_mask(valid_key, batch, None, tokens, tokens, device=token_mask.device)
    dtype = _query_dtype(token_mask, dtype)
    batch, tokens = token_mask.shape
    additive = torch.zeros(token_mask.shape, dtype=dtype, device=token_mask.device)
    additive = additive.masked_fill(~token_mask, torch.finfo(dtype).min)
    return additive[:, None, None, :].expand(batch, 1, tokens, tokens)


def masked_mean(hidden_states: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """The average of `(B, N, D)` tokens over those `token_mask` `(B, N)` marks."""
    weights = token_mask.to(hidden_states.dtype)[..., None]
    return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1)


def patch_grid_maps(tokens: torch.Tensor, spatial_shapes: torch.Tensor) -> torch.Tensor:
    """Patch tokens `(B, K, D)` as `(B, D, rows, cols)` maps on the batch's largest grid: each image's own
    `rows * cols` tokens (row-major) at the top left, zero beyond them."""
    grids = [tuple(grid) for grid in spatial_shapes.tolist()]
    batch, count, dim = tokens.shape
    if len(set(grids)) == 1 and grids[0][0] * grids[0][1] == count:  # one grid and no padding: a view
        return tokens.reshape(batch, *grids[0], dim).permute(0, 3, 1, 2).contiguous()
    rows, cols = max(grid[0] for grid in grids), max(grid[1] for grid in grids)
    maps = tokens.new_zeros(batch, rows, cols, dim)
    for index, (height, width) in enumerate(grids):
        maps[index, :height, :width] = tokens[index, : height * width].reshape(height, width, dim)
    return maps.permute(0, 3, 1, 2).contiguous()
