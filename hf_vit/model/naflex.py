"""Native-aspect batches: every image at its own aspect ratio, as a grid of at most K patches, padded to K.

The image processor (`max_num_patches=K`; its `grid_for_max_patches` and `native_patch_batch`) resizes each image
to the largest patch grid of at most K patches that keeps its aspect ratio and returns, in the layout of
transformers' SigLIP 2 processor:

    pixel_values          (B, K, P * P * C)   each patch flattened in (patch row, patch column, channel) order
    pixel_attention_mask  (B, K)              1 for an image's patches, 0 for the padding after them
    spatial_shapes        (B, 2)              each image's grid (rows, columns)

The model embeds the flattened patches with the same linear map E as the convolution of the ordinary path, resamples
the position embeddings once per distinct grid of the batch, masks the padded patches as attention keys and leaves
them out of the pooling: each image's outputs are those it has alone at its own size (`interpolate_pos_encoding`).

While a graph is exported (`torch.export`, ONNX), the grids are data, not shapes: the position embeddings of each
patch are then the same resampling written as weights over the trained grid (`resampling_weights`), so the graph
takes any number of patches and any grids.

Saved next to checkpoints as remote code with the model, so it imports only torch and its siblings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from .resolution import resample_position_embeddings

__all__ = [
    "attention_mask_for",
    "check_native_batch",
    "exported_position_embeddings",
    "embed_flat_patches",
    "embed_native",
    "masked_mean",
    "native_masks",
    "native_position_embeddings",
    "patch_grid_maps",
    "resampling_weights",
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
    return patch_mask


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def embed_flat_patches(patch_embedding: nn.Conv2d, pixel_values: torch.Tensor) -> torch.Tensor:
    """x_p^i E for flattened patches `(B, K, P * P * C)`: the convolution's kernel `(D, C, P, P)` as the linear map
    it applies to each patch, its inputs laid out in (patch row, patch column, channel) order."""
    weight = patch_embedding.weight
    return F.linear(pixel_values, weight.permute(0, 2, 3, 1).flatten(1), patch_embedding.bias)


def embed_native(
    embeddings: nn.Module,
    pixel_values: torch.Tensor,
    spatial_shapes: torch.Tensor,
    corrupt_embeddings: Callable | None = None,
) -> torch.Tensor:
    """Equation (1) of `embeddings` (the model's `VisionTransformerEmbeddings`) for flattened patches
    `(B, K, P * P * C)`: the same E, prefix tokens, E_pos and registers as its `forward`, E_pos resampled once per
    distinct grid of the batch; padded patches get no position (they are masked as keys). Before dropout."""
    config = embeddings.config
    tokens = embed_flat_patches(embeddings.patch_embedding, pixel_values)  # (B, K, D): x_p^i E
    if corrupt_embeddings is not None:
        tokens = corrupt_embeddings(tokens, embeddings.mask_token)
    batch, positioned = tokens.shape[0], config.num_position_prefix_tokens
    prefix = [token for token in (embeddings.cls_token, embeddings.distillation_token) if token is not None]
    tokens = torch.cat([*(token.expand(batch, -1, -1) for token in prefix), tokens], dim=1)  # [x_class; x_dist; ...]

    def position_embeddings_for(grid: tuple[int, int]) -> torch.Tensor:  # as `forward` resamples them
        return resample_position_embeddings(
            embeddings.position_embedding, config.grid_size, grid, positioned,
            config.interpolation_mode, config.interpolation_antialias,
        )  # fmt: skip

    count = tokens.shape[1] - positioned
    if torch.compiler.is_exporting():
        tokens = tokens + exported_position_embeddings(embeddings.position_embedding, config, spatial_shapes, count)
    else:
        tokens = tokens + native_position_embeddings(position_embeddings_for, spatial_shapes, positioned, count)
    if embeddings.register_tokens is not None:  # registers follow the prefix tokens and have no position
        registers = embeddings.register_tokens.expand(batch, -1, -1)
        tokens = torch.cat([tokens[:, :positioned], registers, tokens[:, positioned:]], dim=1)
    return tokens


def native_position_embeddings(
    position_embeddings_for: Callable[[tuple[int, int]], torch.Tensor],
    spatial_shapes: torch.Tensor,
    num_prefix_tokens: int,
    num_patches: int,
) -> torch.Tensor:
    """E_pos for each image of a native-aspect batch, `(B, prefix + K, D)`: `position_embeddings_for(grid)` (the
    model's own resampling, `(1, prefix + rows * cols, D)`) called once per distinct grid; zero on the padding."""
    grids = [tuple(grid) for grid in spatial_shapes.tolist()]
    rows_of: dict[tuple[int, int], list[int]] = {}
    for index, grid in enumerate(grids):
        rows_of.setdefault(grid, []).append(index)
    output = None
    for grid, indices in rows_of.items():
        table = position_embeddings_for(grid)
        if output is None:
            output = table.new_zeros(len(grids), num_prefix_tokens + num_patches, table.shape[-1])
        output[indices, : table.shape[1]] = table.expand(len(indices), -1, -1)
    return output


def resampling_weights(
    index: torch.Tensor, out_size: torch.Tensor, in_size: int, mode: str, antialias: bool
) -> torch.Tensor:
    """The weights `(..., in_size)` that `F.interpolate(mode=mode, antialias=antialias, align_corners=False)` gives
    the `in_size` inputs of one axis for output `index` of an axis resized to `out_size` (float tensors of one shape):
    the resize as data, for grids that are not shapes. Bicubic is Keys' cubic (a = -0.75) on 4 taps with the edges
    repeated; with antialias, PIL's filters (a = -0.5 for bicubic) widened by the scale when downsampling and
    normalised over their window, as torch computes them."""
    scale = in_size / out_size
    inputs = torch.arange(in_size, dtype=index.dtype, device=index.device)
    if antialias:
        half_width = 2.0 if mode == "bicubic" else 1.0
        down = scale >= 1
        support = torch.where(down, half_width * scale, torch.full_like(scale, half_width))
        stretch = torch.where(down, 1 / scale, torch.ones_like(scale))
        center = scale * (index + 0.5)
        first = torch.clamp(torch.trunc(center - support + 0.5), min=0)
        last = torch.clamp(torch.trunc(center + support + 0.5), max=in_size)
        distance = (inputs - center[..., None] + 0.5) * stretch[..., None]
        weights = _cubic(distance, -0.5) if mode == "bicubic" else torch.clamp(1 - distance.abs(), min=0)
        window = (inputs >= first[..., None]) & (inputs < last[..., None])
        weights = torch.where(window, weights, torch.zeros_like(weights))
        return weights / weights.sum(-1, keepdim=True)
    source = (index + 0.5) * scale - 0.5
    if mode == "bilinear":
        source = torch.clamp(source, min=0)
        low = torch.floor(source)
        high = torch.clamp(low + 1, max=in_size - 1)
        fraction = (source - low)[..., None]
        return (inputs == low[..., None]) * (1 - fraction) + (inputs == high[..., None]) * fraction
    low = torch.floor(source)
    fraction = source - low
    weights = torch.zeros_like(inputs).expand(*index.shape, in_size)
    for tap in range(-1, 3):
        position = torch.clamp(low + tap, 0, in_size - 1)
        weights = weights + (inputs == position[..., None]) * _cubic(fraction - tap, -0.75)[..., None]
    return weights


def _cubic(distance: torch.Tensor, a: float) -> torch.Tensor:
    distance = distance.abs()
    near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
    far = (((distance - 5) * distance + 8) * distance - 4) * a
    return torch.where(distance < 1, near, torch.where(distance < 2, far, torch.zeros_like(distance)))


def exported_position_embeddings(
    position_embedding: torch.Tensor, config, spatial_shapes: torch.Tensor, num_patches: int
) -> torch.Tensor:
    """`native_position_embeddings` for a graph, `(B, prefix + K, D)`: each patch's position embedding as the
    weighted sum of the trained grid's that the model's resampling (`config.interpolation_mode`, `antialias`) gives
    it on its image's grid (`resampling_weights` per axis), computed from the grids as data; zero on the padding."""
    prefix = config.num_position_prefix_tokens
    in_rows, in_cols = config.grid_size
    table = position_embedding[0, prefix:].float()  # (in_rows * in_cols, D)
    grids = spatial_shapes.to(table.device, torch.float32)
    rows, cols = grids[:, 0:1], grids[:, 1:2]  # (B, 1)
    index = torch.arange(num_patches, device=table.device, dtype=torch.float32)[None, :]  # (1, K)
    row = torch.minimum(torch.floor(index / cols), rows - 1)  # the padding's rows clamped (zeroed below)
    col = torch.remainder(index, cols)
    mode, antialias = config.interpolation_mode, config.interpolation_antialias
    row_weights = resampling_weights(row, rows.expand_as(row), in_rows, mode, antialias)  # (B, K, in_rows)
    col_weights = resampling_weights(col, cols.expand_as(col), in_cols, mode, antialias)  # (B, K, in_cols)
    weights = (row_weights[..., :, None] * col_weights[..., None, :]).flatten(-2)  # (B, K, in_rows * in_cols)
    valid = (index < rows * cols).to(table.dtype)[..., None]
    patches = (weights @ table) * valid
    prefixes = position_embedding[:, :prefix].float().expand(patches.shape[0], -1, -1)
    return torch.cat([prefixes, patches], dim=1).to(position_embedding.dtype)


def native_masks(
    config,
    pixel_values: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None,
    spatial_shapes: torch.Tensor,
    output_attentions: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid tokens `(B, prefix + K)` of a native-aspect batch (checked first: see `check_native_batch`) and the
    attention mask hiding the others from every query, in the form the model's attention takes (`attention_mask_for`;
    eager's when the probabilities are asked for), in the dtype of its weights."""
    patch_mask = check_native_batch(pixel_values, pixel_attention_mask, spatial_shapes, config)
    prefix = patch_mask.new_ones(patch_mask.shape[0], config.num_prefix_tokens)
    token_mask = torch.cat([prefix, patch_mask], dim=1)
    implementation = "eager" if output_attentions else config._attn_implementation
    return token_mask, attention_mask_for(token_mask, implementation, dtype)


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
    device = token_mask.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else dtype
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
