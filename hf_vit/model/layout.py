"""A variable-shape batch's layout: which image and grid place each patch slot holds, and what the model derives from
it on the device (the runs attention is restricted to, each slot's position, the one gather to one image per row),
reading nothing back.

Two kinds of batch carry their images as flattened patches (`P * P * C` values each, in patch-row, patch-column,
channel order), each image at its own aspect ratio, a grid of at most K patches (the image processor's
`max_num_patches`, in the layout of transformers' SigLIP 2 processor):

    padded (one image per row):
        pixel_values          (B, K, P * P * C)   each image's `rows * cols` patches first, zeros after them
        pixel_attention_mask  (B, K)              optional: 1 on the image's patches
        spatial_shapes        (B, 2)              each image's grid (rows, columns)
    packed (NaViT's "Patch n' Pack": several whole images in each row of L patch slots, `packed_sequence_length`):
        pixel_values          (R, L, P * P * C)   each image's patches in one run of consecutive slots of its row, the
                                                  row's padding after its images
        spatial_shapes        (N, 2)              each image's grid, in the order the images were given
        image_slot_index      (N, K)              the slot (row * L + slot) holding each image's patch k (row-major
                                                  place k of its grid), -1 where it has none (beyond its grid; a
                                                  patch NaViT's token dropping left out)

`image_slot_index` is the packing itself, written on the CPU from its plan by the one packer
(`image_processing_vit.pack_patches`, for the processor and the training collator); the slots no image holds are
padding. Its shape carries K (the most patches of one image), so nothing in the forward reads a value back from the
device to know it.

`BatchLayout.of` turns a batch into the layout the model runs, with tensor operations only: no `.item()`, `.tolist()`,
`nonzero` or branch on a value, so a forward on a GPU never waits for the device, and a compiled model takes every
batch of one shape in one graph; the values are checked on the device (`_check_on_device`). On CPU in eager mode
(`values_on_host`), where a value costs no wait, a packed batch's layout reads its images' lengths once: its stream
leaves the padding out, and attention takes each image's run alone. Moving tokens is exact,
and the blocks act on each token alone except in attention (within each image: `AttentionSegments`), so each image's
outputs are those it has alone at its own size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = [
    "BATCH_FIELDS",
    "AttentionSegments",
    "BatchLayout",
    "batch_fields",
    "check_native_batch",
    "take_rows",
    "patch_grid_maps",
    "slot_image_index",
]

# A native-aspect batch's fields beside `pixel_values`, as the image processor returns them: the parameters of
# `BatchLayout.of`, handed over by every forward in its `**kwargs` (`batch_fields`).
BATCH_FIELDS = ("spatial_shapes", "pixel_attention_mask", "image_slot_index")
# The fields that described a packed batch before `image_slot_index` alone did.
_RETIRED_FIELDS = ("patch_image_index", "row_image_index", "patch_positions")


def batch_fields(kwargs: dict) -> dict[str, torch.Tensor]:
    """The batch's layout fields given in a forward's `kwargs` (not None), taken out of them."""
    for name in _RETIRED_FIELDS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"`{name}` no longer describes a packed batch: `image_slot_index` (the slot of each image's patches) "
                "and `spatial_shapes` do, as the image processor's `packed_sequence_length` and `pack_patches` return "
                "them."
            )
    fields = {name: kwargs.pop(name) for name in BATCH_FIELDS if name in kwargs}
    return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True, eq=False)
class AttentionSegments:
    """The blocks' tokens `(rows, tokens)` in runs that attend only among themselves (each image's tokens, each
    row's padding), in the forms the attention kernels take them:

    - `cu_seqlens` `(runs + 1,)` int32: the runs' boundaries in the tokens flattened row after row, as variable-length
      attention takes them (some runs may be empty: a row without padding);
    - `max_seqlen`: a bound on the longest run that needs no read from the device (a shape);
    - `token_mask` `(N, prefix + K)` bool: each image's tokens in a row of its own (the kept ones), for attention
      within each image's row with the rest masked as keys;
    - for a packed batch, the gather from the blocks' `stream` tokens (one row) to one image per row: `image_tokens`
      `(N * (prefix + K),)` the blocks' token of each image token, -1 for none; without it the blocks' rows are the
      images;
    - `run_lengths`: the runs' lengths as numbers, where they were read from host memory (`values_on_host`)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    token_mask: torch.Tensor
    image_tokens: torch.Tensor | None = None
    stream: int | None = None
    run_lengths: tuple[int, ...] | None = None

    @property
    def blocks_shape(self) -> tuple[int, int]:
        """`(rows, tokens)` of the blocks' tokens."""
        if self.image_tokens is None:
            return tuple(self.token_mask.shape)
        return 1, self.stream

    def to_images(self, values: torch.Tensor, masked: bool = False) -> torch.Tensor:
        """The blocks' `(rows, tokens, ...)` -> `(N, prefix + K, ...)` one image per row, zero beyond its tokens;
        `masked` (attention's inputs, whose places beyond each image's tokens are masked): anything finite there, in
        one gather."""
        if self.image_tokens is None:
            return values
        shape, flat = tuple(self.token_mask.shape), values.flatten(0, 1)
        if masked:
            return flat.index_select(0, self.image_tokens.clamp(min=0)).unflatten(0, shape)
        return take_rows(flat, self.image_tokens).unflatten(0, shape)

    def to_blocks(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """`(N, prefix + K, ...)` -> the blocks' `shape` `(rows, tokens, ...)`, zero on their padding."""
        if self.image_tokens is None:
            return values
        total, flat = shape[0] * shape[1], values.reshape(-1, *values.shape[2:])
        places = torch.where(self.image_tokens >= 0, self.image_tokens, total)  # the spare row takes the rest
        return flat.new_zeros(total + 1, *flat.shape[1:]).index_copy(0, places, flat)[:total].unflatten(0, shape)

    def token_images(self) -> torch.Tensor | None:
        """`(tokens,)`: the image of each of a packed batch's blocks' tokens, N (one past the last) on the padding."""
        if self.image_tokens is None:
            return None
        images, width = self.token_mask.shape
        owner = torch.arange(images, device=self.image_tokens.device).repeat_interleave(width)
        places = torch.where(self.image_tokens >= 0, self.image_tokens, self.stream)  # the spare token takes the rest
        return owner.new_full((self.stream + 1,), images).scatter(0, places, owner)[: self.stream]


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """The layout of a native-aspect batch, padded or packed, for a model with `prefix` prefix tokens per image.

    The images one per row (the pooling, the heads) are `(N, prefix + K)` tokens. The blocks run a padded batch's
    rows `(B, prefix + K)`, a packed one's stream `(1, R * L + N * prefix)`: each image's prefix tokens, then its
    patches, consecutive (on CPU in eager mode without the padding: `(1, N * prefix + the images' patches)`). Per
    slot (`slot_grids`, `slot_places`), each patch's grid and place in it, for its position embedding."""

    grids: torch.Tensor  # (N, 2): each image's grid
    prefix: int  # the prefix tokens of each image
    segments: AttentionSegments  # the runs of the blocks' tokens, and the gathers to one image per row
    slot_grids: torch.Tensor  # (..., 2) broadcast over the slots: the grid of the image each slot holds
    slot_places: torch.Tensor  # (...) broadcast over the slots: the slot's place in its grid (-1: padding)
    image_slot_index: torch.Tensor | None = None  # (N, K): packed only
    slots: tuple[int, int] | None = None  # (R, L): packed only, the rows of patch slots
    block_source: torch.Tensor | None = None  # (R * L + N * prefix,) packed: each block token's prefix token or slot

    @property
    def packed(self) -> bool:
        return self.image_slot_index is not None

    @property
    def token_mask(self) -> torch.Tensor:
        """`(N, prefix + K)` bool: each image's tokens (the kept ones, with token dropping)."""
        return self.segments.token_mask

    @property
    def patch_mask(self) -> torch.Tensor:
        """`(N, K)` bool: each image's patches (those it keeps, with token dropping)."""
        return self.token_mask[:, self.prefix :]

    @classmethod
    def of(
        cls,
        pixel_values: torch.Tensor,
        spatial_shapes: torch.Tensor,
        prefix: int,
        pixel_attention_mask: torch.Tensor | None = None,
        image_slot_index: torch.Tensor | None = None,
    ) -> BatchLayout:
        """The layout of a padded batch, or of a packed one (`image_slot_index` given)."""
        if image_slot_index is None:
            return _padded(pixel_values, spatial_shapes, prefix, pixel_attention_mask)
        return _packed(pixel_values, spatial_shapes, prefix, image_slot_index, pixel_attention_mask)

    def unpack_patches(self, values: torch.Tensor) -> torch.Tensor:
        """`(R, L, ...)` per patch slot (pixels, labels, a corruption) -> `(N, K, ...)`, one image per row."""
        if not self.packed:
            return values
        if not isinstance(values, torch.Tensor) or tuple(values.shape[:2]) != self.slots:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(
                f"A packed batch's `pixel_values` (and any labels or masks per patch) are ({self.slots[0]}, "
                f"{self.slots[1]}, ...) per patch slot; got {shape}."
            )
        images = self.image_slot_index.shape[0]
        return take_rows(values.flatten(0, 1), self.image_slot_index.flatten()).unflatten(0, (images, -1))

    def to_slots(self, values: torch.Tensor, fill: int | bool, patch_index: bool = False) -> torch.Tensor:
        """`(N, K)` per image patch -> `(R, L)` per slot, `fill` on the padding. `patch_index`: the values are indices
        of the batch's image patches (`image * K + k`, -1 for none), given as the indices of their slots."""
        if not self.packed:
            return values
        slots = self.image_slot_index.flatten()
        if tuple(values.shape) != tuple(self.image_slot_index.shape):
            raise ValueError(
                f"Masks of a packed batch's patches are one per image patch {tuple(self.image_slot_index.shape)}, as "
                f"the outputs; got {tuple(values.shape)}."
            )
        if patch_index:
            values = torch.where(values >= 0, slots[values.clamp(min=0)], -1)
        total = self.slots[0] * self.slots[1]
        spare = values.new_full((total + 1,), fill)  # the slot beyond the last collects the places without one
        spare = spare.scatter(0, torch.where(slots >= 0, slots, total), values.flatten())
        return spare[:total].view(self.slots)

    def blocks_input(self, prefix_tokens: torch.Tensor, patch_tokens: torch.Tensor) -> torch.Tensor:
        """The blocks' tokens from the prefix tokens `(1, prefix, D)` and the embedded slots `(R, L, D)`: each
        image's prefix tokens, then its patches."""
        if not self.packed:
            return torch.cat([prefix_tokens.expand(patch_tokens.shape[0], -1, -1), patch_tokens], dim=1)
        images = self.grids.shape[0]
        every = torch.cat([prefix_tokens.expand(images, -1, -1).flatten(0, 1), patch_tokens.flatten(0, 1)])
        return every.index_select(0, self.block_source)[None]

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """The blocks' tokens -> `(N, prefix + K, D)`, zero beyond each image's tokens."""
        return self.segments.to_images(tokens)


def values_on_host(device: torch.device) -> bool:
    """Whether reading a value of the batch costs no wait: on CPU in eager mode (not in a compiled graph or an export,
    whose shapes must not depend on values). There a packed batch's stream leaves its padding out (its length is a
    value) and its attention takes each image's run alone (their lengths)."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


def take_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`values[index]` along the first dimension, zeros where `index` is -1 (an appended zero row)."""
    padded = torch.cat([values, values.new_zeros(1, *values.shape[1:])])
    return padded.index_select(0, torch.where(index < 0, values.shape[0], index).to(values.device))


def check_native_batch(
    pixel_values: torch.Tensor, spatial_shapes: torch.Tensor, config, images: int, image_slot_index=None
) -> None:
    """Refuse, by their shapes and types, inputs the model cannot embed as a native-aspect batch of `images` images
    (packed with an `image_slot_index`), with the fix (the values are checked on the device: `_check_on_device`)."""
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
    patch, channels, width = config.patch_size, config.num_channels, pixel_values.shape[-1]
    if width != patch * patch * channels:
        raise ValueError(
            f"`pixel_values` holds patches of {width} values, but the model's are {patch}x{patch}x{channels} = "
            f"{patch * patch * channels}: build the image processor with `patch_size={patch}`."
        )
    if not isinstance(spatial_shapes, torch.Tensor) or tuple(spatial_shapes.shape) != (images, 2):
        raise ValueError(
            f"`spatial_shapes` must be an ({images}, 2) tensor of each image's patch grid (rows, columns); got "
            f"{_describe(spatial_shapes)}."
        )
    slots = image_slot_index
    if slots is not None and (
        not isinstance(slots, torch.Tensor) or slots.ndim != 2 or slots.is_floating_point() or slots.is_complex()
        or slots.dtype == torch.bool or slots.shape[0] != images
    ):  # fmt: skip
        raise ValueError(
            f"`image_slot_index` must be an ({images}, K) integer tensor (the slot of each image's patch k, -1 for "
            f"none), one row per image of `spatial_shapes`, as the image processor returns it; got {_describe(slots)}."
        )


def _padded(
    pixel_values: torch.Tensor, spatial_shapes: torch.Tensor, prefix: int, pixel_attention_mask: torch.Tensor | None
) -> BatchLayout:
    batch, patches = pixel_values.shape[:2]
    device = pixel_values.device
    _check_mask_shape(pixel_attention_mask, (batch, patches), "images of", "patches")
    grids = spatial_shapes.to(device)
    sizes = grids[:, 0] * grids[:, 1]
    places = torch.arange(patches, device=device)
    patch_mask = places < sizes[:, None]
    _check_on_device(
        (grids >= 1).all() & (sizes <= patches).all(),
        f"`spatial_shapes` must be grids of at least 1x1 and at most {patches} patches (the patches per image in "
        "`pixel_values`).",
    )
    if pixel_attention_mask is not None:
        _check_on_device(
            (pixel_attention_mask.to(device).bool() == patch_mask).all(),
            "`pixel_attention_mask` must mark the first rows * cols of each image's patches (its grid in "
            "`spatial_shapes`) and nothing else, as the image processor returns it.",
        )
    token_mask = F.pad(patch_mask, (prefix, 0), value=True)
    # each row: its image's tokens, then its padding (an empty run where it has none); the runs' boundaries
    bounds = F.pad(torch.stack([prefix + sizes, patches - sizes], 1).flatten().cumsum(0), (1, 0)).to(torch.int32)
    segments = AttentionSegments(bounds, prefix + patches, token_mask)
    return BatchLayout(grids, prefix, segments, slot_grids=grids[:, None], slot_places=places[None])


def _packed(
    pixel_values: torch.Tensor,
    spatial_shapes: torch.Tensor,
    prefix: int,
    image_slot_index: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None,
) -> BatchLayout:
    rows, length = pixel_values.shape[:2]
    images, patches = image_slot_index.shape
    total, device = rows * length, pixel_values.device
    _check_mask_shape(pixel_attention_mask, (rows, length), "rows of", "patch slots")
    index, grids = image_slot_index.to(device), spatial_shapes.to(device)
    present = index >= 0  # (N, K)
    kept = present.sum(dim=1)  # (N,): each image's patches
    held = torch.where(present, index, total)  # (N, K): each patch's slot, `total` (a spare slot) for none
    first = held.amin(dim=1).clamp(max=total - 1)  # (N,): each image's first slot
    starts = torch.zeros(total, dtype=torch.long, device=device).index_add(0, first, torch.ones_like(first))
    _check_packed(index, grids, held, kept, first, (rows, length), pixel_attention_mask)
    # The blocks' stream: the slots in order, each image's prefix tokens before its first slot.
    slot_tokens = torch.arange(total, device=device) + prefix * starts.cumsum(0)  # (R * L,)
    image_first = slot_tokens[first] - prefix  # (N,): where each image's run starts
    prefix_at = image_first[:, None] + torch.arange(prefix, device=device)
    image_tokens = torch.cat([prefix_at, torch.where(present, slot_tokens[index.clamp(min=0)], -1)], dim=1)
    stream = total + images * prefix
    block_source = torch.zeros(stream, dtype=torch.long, device=device).scatter(
        0, torch.cat([prefix_at.flatten(), slot_tokens]), torch.arange(stream, device=device)
    )  # (prefix tokens, then slots) -> the stream
    slot_patches = _slot_patches(held, total)
    slot_images, slot_places = slot_patches.div(patches, rounding_mode="floor"), slot_patches % patches
    run_lengths = None
    if values_on_host(device):  # the stream without its padding: each image's tokens back to back
        valid = torch.cat([block_source.new_ones(images * prefix, dtype=torch.bool), slot_patches >= 0])[block_source]
        place = valid.cumsum(0) - 1  # each stream token's place without the padding
        bounds = F.pad((prefix + kept)[image_first.argsort()].cumsum(0), (1, 0))
        *_, stream = read = bounds.tolist()  # the one read: the runs' lengths
        run_lengths = tuple(end - start for start, end in zip(read, read[1:]))
        image_tokens = torch.where(image_tokens >= 0, place[image_tokens.clamp(min=0)], -1)
        spare = block_source.new_zeros(stream + 1)  # the place beyond the last takes the padding
        block_source = spare.scatter(0, torch.where(valid, place, stream), block_source)[:stream]
    else:  # the runs: each image's, and each row's padding after its images (empty runs where boundaries meet)
        row_slot = torch.arange(rows, device=device) * length
        row_first = slot_tokens[row_slot] - prefix * starts[row_slot]
        bounds = torch.cat([image_first, image_first + prefix + kept, row_first, row_first.new_full((1,), stream)])
        bounds = bounds.sort().values
    segments = AttentionSegments(
        bounds.to(torch.int32), length + prefix, F.pad(present, (prefix, 0), value=True),
        image_tokens=image_tokens.flatten(), stream=stream, run_lengths=run_lengths,
    )  # fmt: skip
    return BatchLayout(
        grids, prefix, segments, slot_grids=grids[slot_images.clamp(min=0)],
        slot_places=torch.where(slot_patches >= 0, slot_places, -1), image_slot_index=index, slots=(rows, length),
        block_source=block_source,
    )  # fmt: skip


def _slot_patches(held: torch.Tensor, total: int) -> torch.Tensor:
    """`(total,)`: the patch `image * K + k` each slot holds, -1 on the padding, from each patch's slot `held`
    `(N, K)` (`total` for none)."""
    spare = torch.full((total + 1,), -1, dtype=torch.long, device=held.device)  # the spare slot takes the rest
    return spare.scatter(0, held.flatten(), torch.arange(held.numel(), device=held.device))[:total]


def slot_image_index(image_slot_index: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """`(rows, length)`: the image each slot of a packed batch holds a patch of, -1 on the padding (the inverse of
    `image_slot_index`, e.g. to give labels per slot)."""
    total = rows * length
    held = torch.where(image_slot_index >= 0, image_slot_index, total)
    slot_patches = _slot_patches(held, total)
    images = torch.where(slot_patches >= 0, slot_patches.div(image_slot_index.shape[1], rounding_mode="floor"), -1)
    return images.view(rows, length)


def _check_mask_shape(mask: torch.Tensor | None, shape: tuple[int, int], rows: str, slots: str) -> None:
    """(The message is formatted only where it is raised: a compiled size stays symbolic.)"""
    if mask is not None and tuple(mask.shape) != shape:
        raise ValueError(
            f"`pixel_attention_mask` has shape {tuple(mask.shape)}, but `pixel_values` holds {shape[0]} {rows} "
            f"{shape[1]} {slots}: {shape}, as the image processor returns it."
        )


def _check_packed(
    index: torch.Tensor,
    grids: torch.Tensor,
    held: torch.Tensor,
    kept: torch.Tensor,
    first: torch.Tensor,
    slots: tuple[int, int],
    pixel_attention_mask: torch.Tensor | None,
) -> None:
    """Refuse, on the device (`_check_on_device`), a packed batch of `slots` (R rows of L patch slots) whose fields
    disagree with each other or with the pixels. The messages name no size (a compiled model would take it as a
    constant)."""
    rows, length = slots
    total = rows * length
    _check_on_device(
        ((index >= -1) & (index < total)).all(),
        "`image_slot_index` must hold -1 or a patch slot of `pixel_values` (row * length + slot).",
    )
    sizes = grids[:, 0] * grids[:, 1]
    inside = torch.arange(index.shape[1], device=index.device) < sizes[:, None]
    _check_on_device(
        (grids >= 1).all() & ((held == total) | inside).all() & (kept >= 1).all(),
        "`spatial_shapes` must give each image's grid (rows, columns): `image_slot_index` gives slots to places of "
        "its grid only, at least one.",
    )
    flat = held.flatten()
    taken = torch.zeros(total + 1, dtype=torch.long, device=index.device).index_add(0, flat, torch.ones_like(flat))
    last = torch.where(held < total, held, -1).amax(dim=1)
    taken = taken[:total].view(rows, length)
    _check_on_device(
        (taken <= 1).all() & (last - first + 1 == kept).all() & (first // length == last // length).all()
        & (taken[:, 1:] <= taken[:, :-1]).all(),
        "`image_slot_index` must give each image one run of consecutive slots in one row, no slot to two patches, "
        "each row's padding after its images (as the image processor packs them).",
    )  # fmt: skip
    if pixel_attention_mask is not None:
        _check_on_device(
            (pixel_attention_mask.to(index.device).bool() == taken.bool()).all(),
            "`pixel_attention_mask` must mark exactly the patch slots `image_slot_index` gives an image.",
        )


def _check_on_device(condition: torch.Tensor, message: str) -> None:
    """Refuse the batch with `message` where `condition` (a one-value bool tensor) is False, checked on its device
    without a read waiting for it. torch has no public asynchronous assert: where its `_assert_async` is missing (a
    later torch), the processor's checks are the only ones."""
    assert_async = getattr(torch, "_assert_async", None)
    if assert_async is not None:
        assert_async(condition, message)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def patch_grid_maps(tokens: torch.Tensor, spatial_shapes: torch.Tensor) -> torch.Tensor:
    """Patch tokens `(B, K, D)` as `(B, D, rows, cols)` maps on the batch's largest grid: each image's own
    `rows * cols` tokens (row-major) at the top left, zero beyond them. The maps' size is the largest grid, a value:
    dense prediction's one read of the grids (one copy of the `(B, 2)` grids to the host)."""
    grids = spatial_shapes.detach().cpu()
    rows, cols = (int(value) for value in grids.amax(dim=0).tolist())
    batch, count, dim = tokens.shape
    device = tokens.device
    row = torch.arange(rows, device=device)[:, None]
    col = torch.arange(cols, device=device)[None, :]
    heights, widths = (value.to(device)[:, None, None] for value in spatial_shapes.unbind(1))
    inside = (row < heights) & (col < widths)  # (B, rows, cols)
    index = torch.where(inside, row * widths + col, count)  # `count`: an appended zero token
    padded = torch.cat([tokens, tokens.new_zeros(batch, 1, dim)], dim=1)
    maps = torch.gather(padded, 1, index.flatten(1)[..., None].expand(-1, -1, dim))
    return maps.view(batch, rows, cols, dim).permute(0, 3, 1, 2).contiguous()
