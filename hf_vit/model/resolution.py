"""Resolution changes (the paper's section 3.2): the learned position embeddings resampled to a new patch grid (the
prefix tokens' kept, the patch positions resampled as a 2D image of D channels); and patch size changes (FlexiViT):
the patch embedding resampled to a new patch size. Image sizes and patch grids are read here only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

MODES = ("bicubic", "bilinear")
# The largest position table accepted: a 256x256 grid of patches (e.g. 4096x4096 pixels at patch 16). Beyond it the
# position embeddings alone take gigabytes (100000x100000 at patch 16 would need 120 GB) and attention is infeasible.
MAX_PATCH_POSITIONS = 65536


def height_width(value: int | tuple[int, int] | list[int], name: str = "image_size") -> tuple[int, int]:
    """A size given as N (square) or (height, width), as `(height, width)`; a `ValueError` naming `name` else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return (int(value[0]), int(value[1]))
    raise ValueError(f"`{name}` must be an int or a (height, width) pair of ints, got {value!r}.")


def image_size_field(image_size: int | tuple[int, int] | list[int]) -> int | list[int]:
    """`image_size` as the config stores it: an int for a square size, else `[height, width]`."""
    height, width = height_width(image_size)
    return height if height == width else [height, width]


def grid_for(image_size: int | Sequence[int], patch_size: int) -> tuple[int, int]:
    """The `(rows, cols)` patch grid of `image_size` (N or (H, W)), with an error saying what to pass instead when
    the size cannot be tiled by `patch_size` or is beyond `MAX_PATCH_POSITIONS`."""
    height, width = height_width(image_size)
    patch = patch_size
    if height < patch or width < patch:
        raise ValueError(f"image_size {height}x{width} is smaller than one {patch}x{patch} patch.")
    if height % patch or width % patch:
        raise ValueError(
            f"image_size {height}x{width} is not divisible by the patch size {patch}; "
            f"the nearest sizes are {height // patch * patch}x{width // patch * patch} "
            f"and {-(-height // patch) * patch}x{-(-width // patch) * patch}."
        )
    rows, cols = height // patch, width // patch
    if rows * cols > MAX_PATCH_POSITIONS:
        raise ValueError(
            f"image_size {height}x{width} gives a {rows}x{cols} grid of {patch}x{patch} patches ({rows * cols} "
            f"positions); hf-vit accepts at most {MAX_PATCH_POSITIONS} patch positions (a 256x256 grid, e.g. "
            f"{256 * patch}x{256 * patch} at this patch size). Choose a smaller image_size."
        )
    return rows, cols


def resample_position_embeddings(
    position_embedding: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = False,
) -> torch.Tensor:
    """Resample `(1, prefix + old_h * old_w, D)` position embeddings to `new_grid`, keeping the prefix tokens'.

    `mode` and `antialias` are those of `F.interpolate` (the config's `interpolation_mode` and
    `interpolation_antialias`, as each checkpoint's own code resamples), computed in float32 so that bf16/fp16 models
    resample as accurately as fp32 ones. A native-aspect batch's patches take theirs from `position_embeddings_at`.
    """
    _check_table(position_embedding, old_grid, num_prefix_tokens, mode)
    # The same grid needs no resampling; an exported graph resamples always (a bicubic or bilinear resize to the same
    # size is the identity), since the shortcut would freeze the grid it was traced at into the graph.
    if not torch.compiler.is_exporting() and tuple(old_grid) == tuple(new_grid):
        return position_embedding
    prefix, patches = position_embedding[:, :num_prefix_tokens], position_embedding[:, num_prefix_tokens:]
    dim = patches.shape[-1]
    grid = patches.reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=tuple(new_grid), mode=mode, align_corners=False, antialias=antialias)
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(position_embedding.dtype)
    return torch.cat([prefix, patches], dim=1)


def _check_table(position_embedding: torch.Tensor, old_grid: tuple[int, int], num_prefix_tokens: int, mode: str):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    expected = num_prefix_tokens + old_grid[0] * old_grid[1]
    if position_embedding.ndim != 3 or position_embedding.shape[1] != expected:
        raise ValueError(
            f"Position embeddings of shape {tuple(position_embedding.shape)} do not match a {old_grid[0]}x"
            f"{old_grid[1]} grid with {num_prefix_tokens} prefix token(s) (expected (1, {expected}, D)); the "
            "checkpoint's config does not describe its weights."
        )


def position_embeddings_at(
    position_embedding: torch.Tensor,
    old_grid: tuple[int, int],
    grids: torch.Tensor,
    places: torch.Tensor,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = False,
) -> torch.Tensor:
    """The patch position embeddings `(..., D)` of patches at `places` `(...)` (row-major) of their grids `grids`
    `(..., 2)` (broadcast together: each patch of a native-aspect batch on its image's grid), as
    `resample_position_embeddings` to each grid gives them; zero where a place is outside its grid (-1: padding).
    Each is the weighted sum of the stored grid's embeddings at a few taps (`position_taps`), one `embedding_bag`,
    computed from the grids as data: no value is read back from the device, and a graph takes any grids. In float32,
    as a resize computes it (no autocast context entered where none is on)."""
    _check_table(position_embedding, old_grid, num_prefix_tokens, mode)
    table = position_embedding[0, num_prefix_tokens:].float()  # (in_rows * in_cols, D)
    index, weight = position_taps(grids.to(table.device), places.to(table.device), old_grid, mode, antialias)
    device = table.device.type
    autocast = torch.is_autocast_enabled(device)
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        taps = index.shape[-1]
        patches = F.embedding_bag(
            index.reshape(-1, taps), table, per_sample_weights=weight.reshape(-1, taps), mode="sum"
        ).view(*index.shape[:-1], -1)
    return patches.to(position_embedding.dtype)


def position_taps(
    grids: torch.Tensor, places: torch.Tensor, old_grid: tuple[int, int], mode: str, antialias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The taps of `position_embeddings_at` on the stored `old_grid`: indices `(..., T)` into its `in_rows * in_cols`
    positions and their float32 weights `(..., T)`, T the product of the taps per axis (`_axis_taps`). The weights
    are computed in float64 (float32 on MPS, which has none), so the sums are the resize up to float32's rounding."""
    in_rows, in_cols = old_grid
    grids = grids.to(torch.float32 if grids.device.type == "mps" else torch.float64)
    rows, cols = grids[..., 0], grids[..., 1]
    place = places.to(grids.dtype)
    rows, cols, place = torch.broadcast_tensors(rows, cols, place)
    row = torch.minimum(torch.floor(place.clamp(min=0) / cols), rows - 1)  # the padding clamped (weighted 0 below)
    col = torch.remainder(place.clamp(min=0), cols)
    row_index, row_weight = _axis_taps(row, rows, in_rows, mode, antialias)
    col_index, col_weight = _axis_taps(col, cols, in_cols, mode, antialias)
    index = (row_index[..., :, None] * in_cols + col_index[..., None, :]).flatten(-2)
    valid = ((place >= 0) & (place < rows * cols)).to(grids.dtype)[..., None]
    weight = (row_weight[..., :, None] * col_weight[..., None, :]).flatten(-2) * valid
    return index, weight.to(torch.float32)


def _axis_taps(
    index: torch.Tensor, out_size: torch.Tensor, in_size: int, mode: str, antialias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input indices `(..., A)` and weights `(..., A)` that one axis's interpolation gives output `index` of an
    axis resized from `in_size` to `out_size`: 2 (bilinear) or 4 (bicubic, Keys' cubic with a = -0.75) taps with the
    edges repeated; with antialias, every input, weighted 0 outside the filter's window (`_antialiased_weights`: a
    downsampled axis widens the filter by the scale)."""
    if antialias:
        weights = _antialiased_weights(index, out_size, in_size, mode)
        inputs = torch.arange(in_size, device=index.device).expand(weights.shape)
        return inputs, weights
    source = (index + 0.5) * (in_size / out_size) - 0.5
    if mode == "bilinear":
        source = torch.clamp(source, min=0)
        low = torch.floor(source)
        fraction = source - low
        high = torch.clamp(low + 1, max=in_size - 1)
        return torch.stack([low, high], -1).long(), torch.stack([1 - fraction, fraction], -1)
    low = torch.floor(source)
    fraction = source - low
    taps = torch.arange(-1, 3, device=index.device, dtype=index.dtype)
    inputs = torch.clamp(low[..., None] + taps, 0, in_size - 1).long()
    return inputs, _cubic(fraction[..., None] - taps, -0.75)


def _antialiased_weights(index: torch.Tensor, out_size: torch.Tensor, in_size: int, mode: str) -> torch.Tensor:
    """The weights `(..., in_size)` that `F.interpolate(mode=mode, antialias=True, align_corners=False)` gives the
    `in_size` inputs of one axis for output `index` of an axis resized to `out_size` (float tensors of one shape):
    PIL's filters (a = -0.5 for bicubic) widened by the scale when downsampling and normalised over their window, as
    torch computes them."""
    scale = in_size / out_size
    inputs = torch.arange(in_size, dtype=index.dtype, device=index.device)
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


def _cubic(distance: torch.Tensor, a: float) -> torch.Tensor:
    distance = distance.abs()
    near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
    far = (((distance - 5) * distance + 8) * distance - 4) * a
    return torch.where(distance < 1, near, torch.where(distance < 2, far, torch.zeros_like(distance)))


def resample_patch_embedding(
    weight: torch.Tensor,
    new_patch_size: int | tuple[int, int] | list[int],
    interpolation: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """The patch embedding kernel `(D, C, h, w)` resampled to `new_patch_size` by FlexiViT's pseudo-inverse resize
    (Beyer et al., 2023): with `R` the linear map that resizes an h x w patch to the new size (`F.interpolate` with
    `interpolation` and `antialias`, the processor's resize), each kernel `w` becomes `pinv(R^T) w`. When the patch
    grows, `<x, w> = <R x, pinv(R^T) w>` for every patch `x`: a patch resized up is embedded as it was; when it
    shrinks, the new kernel is the least-squares best. The resize and its pseudo-inverse are computed in float64 and
    applied in the weight's dtype; differentiable in `weight` (a patch size drawn per step trains one kernel).
    """
    if interpolation not in MODES:
        raise ValueError(f"interpolation must be one of {MODES}, got {interpolation!r}.")
    if weight.ndim != 4:
        raise ValueError(
            f"The patch embedding kernel must be (out, channels, height, width), got {tuple(weight.shape)}."
        )
    new_hw = height_width(new_patch_size, "patch_size")
    if min(new_hw) < 1:
        raise ValueError(f"`patch_size` must be positive, got {new_patch_size!r}.")
    old_hw = tuple(weight.shape[-2:])
    if old_hw == new_hw:
        return weight
    old_count = old_hw[0] * old_hw[1]
    # Row i of `resize` is the i-th one-pixel patch resized: the matrix R^T, (old pixels, new pixels).
    basis = torch.eye(old_count, dtype=torch.float64).reshape(old_count, 1, *old_hw)
    resize = F.interpolate(basis, size=new_hw, mode=interpolation, antialias=antialias, align_corners=False)
    inverse = torch.linalg.pinv(resize.reshape(old_count, -1))  # (new pixels, old pixels)
    kernels = weight.reshape(-1, old_count)
    return (kernels @ inverse.T.to(weight.device, weight.dtype)).reshape(*weight.shape[:2], *new_hw)


def resample_patch_embedding_layer(layer: nn.Conv2d, patch_size: int, stem_stride: int = 1) -> nn.Conv2d:
    """A new patch embedding for `patch_size` input pixels (`patch_size / stem_stride` of a hybrid's feature map): the
    kernel resampled by `resample_patch_embedding`, the bias shared. `layer` is left as it is."""
    if not isinstance(patch_size, int) or isinstance(patch_size, bool) or patch_size < 1 or patch_size % stem_stride:
        raise ValueError(
            f"`patch_size` must be a positive int (a multiple of the ResNet stem's stride {stem_stride}), got "
            f"{patch_size!r}."
        )
    side = patch_size // stem_stride
    new = nn.Conv2d(layer.in_channels, layer.out_channels, side, stride=side, device=layer.weight.device)
    new.weight = nn.Parameter(resample_patch_embedding(layer.weight, side), requires_grad=layer.weight.requires_grad)
    new.bias = layer.bias
    return new


def check_pixel_values(pixel_values: torch.Tensor, config, interpolate_pos_encoding: bool) -> None:
    """Reject inputs the model cannot embed, with a message that says how to fix them."""
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"`pixel_values` must be a torch.Tensor, got {type(pixel_values).__name__}.")
    patch_width = config.patch_size**2 * config.num_channels
    if pixel_values.ndim == 3 and pixel_values.shape[-1] == patch_width:
        one_image = " If it is one image (channels, height, width), add a batch dimension with `pixel_values[None]`."
        raise ValueError(
            f"`pixel_values` of shape {tuple(pixel_values.shape)} is a native-aspect batch of flattened patches "
            f"(batch, patches, {config.patch_size} * {config.patch_size} * {config.num_channels}), given without "
            "`spatial_shapes`: pass each image's patch grid as `spatial_shapes` (batch, 2), with "
            "`pixel_attention_mask`, as the image processor returns them with `max_num_patches`."
            + (one_image if pixel_values.shape[0] == config.num_channels else "")
        )
    if pixel_values.ndim != 4:
        raise ValueError(
            "`pixel_values` must have 4 dimensions (batch, channels, height, width), got shape "
            f"{tuple(pixel_values.shape)}. Add a batch dimension with `pixel_values[None]` for one image."
        )
    batch, channels, height, width = pixel_values.shape
    if batch == 0:
        raise ValueError("`pixel_values` is an empty batch (batch size 0); pass at least one image.")
    if not pixel_values.is_floating_point():
        raise TypeError(
            f"`pixel_values` must be a floating point tensor, got {pixel_values.dtype}. Run the image processor, "
            "or convert integer pixels with `.float() / 255` and normalise them."
        )
    if channels != config.num_channels:
        hint = " The image processor converts images to RGB by default: build it with `do_convert_rgb=False` to keep"
        hint = f"{hint} {config.num_channels} channels (e.g. RGB + infrared)." if channels == 3 else ""
        raise ValueError(
            f"`pixel_values` has {channels} channels but the model expects {config.num_channels} "
            f"(shape {tuple(pixel_values.shape)}; the layout is channels first: batch, channels, height, width).{hint}"
        )
    if height % config.patch_size or width % config.patch_size:
        raise ValueError(
            f"Image size {height}x{width} is not divisible by the patch size {config.patch_size}; "
            "resize or crop the images to a multiple of it."
        )
    if not interpolate_pos_encoding and (height, width) != config.image_hw:
        raise ValueError(
            f"Image size {height}x{width} differs from the model's {config.image_hw[0]}x{config.image_hw[1]}. Pass "
            "`interpolate_pos_encoding=True` to interpolate the position embeddings to the new size, or resize "
            "the images (the image processor does it)."
        )
