"""A variable-shape batch's layout: where each image's tokens sit, the runs attention is restricted to, and the moves
between one image per row and packed rows, made from numbers the host already has and read back by no forward.

Two kinds of batch carry their images as flattened patches (`P * P * C` values each, in patch-row, patch-column,
channel order), each image at its own aspect ratio, a grid of at most K patches (the image processor's
`max_num_patches`, in the layout of transformers' SigLIP 2 processor):

    padded (one image per row):
        pixel_values          (B, K, P * P * C)   each image's `rows * cols` patches first, zeros after them
        pixel_attention_mask  (B, K)              1 on the image's patches
        spatial_shapes        (B, 2)              each image's grid (rows, columns)
    packed (NaViT's "Patch n' Pack": several whole images in each row of L patch slots, `packed_sequence_length`):
        pixel_values          (R, L, P * P * C)   each image's patches consecutive in its row, the padding after them
        pixel_attention_mask  (R, L)              1 on the images' patches
        spatial_shapes        (N, 2)              each image's grid, in the order the images were given
        patch_image_index     (R, L)              the image each slot holds a patch of, -1 on the padding
        row_image_index       (R, M)              the images of each row in their order there, -1 after them
        image_slot_index      (N, K)              the slot (row * L + slot) holding each image's patch k (row-major
                                                  place k of its grid), -1 where it has none
        patch_positions       (R, L)              optional (NaViT's token dropping): each slot's place in its image's
                                                  grid, -1 on the padding; each image's run holds only the patches it
                                                  keeps, in any order

`row_image_index` and `image_slot_index` are the packing itself, written on the CPU from its plan by the one packer
(`image_processing_vit.pack_patches`, for the processor and the training collator); their shapes carry M (the most
images in one row) and K (the most patches of one image), so nothing in the forward reads a value back from the
device to know them.

`BatchLayout.of` turns a batch into the layout the model runs, with tensor operations only: no `.item()`, `.tolist()`,
`nonzero` or branch on a value, so a forward on a GPU never waits for the device, and a compiled model takes every
batch of one shape in one graph. It needs the number of prefix tokens (class, distillation, registers), which the
model knows and the processor does not: each image's tokens are its prefix tokens, then its patches. A packed batch
without the two index fields (built by other code) gets them from `packed_index_fields` on the host: the one slow
path, which also checks the batch. The values of every batch are checked on the device, without a synchronisation
(`_check_on_device`): a packed batch whose fields disagree with each other or with the pixels (batches concatenated
along their rows, an edited field) is refused, the message naming the field.

What the layout holds, for the embeddings (equation 1: each image on its own grid, its own prefix tokens), the blocks
(attention within each image: `AttentionSegments`), the pooling and every head (the valid tokens of each image):
moving tokens is exact, and the blocks act on each token alone except in attention, so each image's outputs are
those it has alone at its own size.

Saved next to checkpoints as remote code with the model, so it imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = [
    "BATCH_FIELDS",
    "PACKED_INDEX_FIELDS",
    "AttentionSegments",
    "BatchLayout",
    "batch_fields",
    "check_native_batch",
    "masked_mean",
    "packed_index_fields",
    "take_rows",
    "patch_grid_maps",
]

# The fields of a packed batch made by `packed_index_fields`, beside `patch_image_index`.
PACKED_INDEX_FIELDS = ("row_image_index", "image_slot_index")
# A native-aspect batch's fields beside `pixel_values`, as the image processor returns them: the parameters of
# `BatchLayout.of`, handed over by every forward in its `**kwargs` (`batch_fields`).
BATCH_FIELDS = (
    "spatial_shapes", "pixel_attention_mask", "patch_image_index", "patch_positions", *PACKED_INDEX_FIELDS
)  # fmt: skip


def batch_fields(kwargs: dict) -> dict[str, torch.Tensor]:
    """The batch's layout fields given in a forward's `kwargs` (not None), taken out of them."""
    fields = {name: kwargs.pop(name) for name in BATCH_FIELDS if name in kwargs}
    return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True, eq=False)
class AttentionSegments:
    """Runs of consecutive tokens of a `(rows, tokens)` batch that attend only among themselves (each image's tokens,
    each row's padding), in the forms the attention kernels take them:

    - `cu_seqlens` `(runs + 1,)` int32: the runs' boundaries in the tokens flattened row after row, as variable-length
      attention takes them (some runs may be empty: a row without padding, a row with fewer images than the most);
    - `max_seqlen`: a bound on the longest run that needs no read from the device (the row's length);
    - `token_runs` `(rows, tokens)`: a number per token, equal within a run and different between runs, for a
      block-diagonal mask;
    - `token_mask` `(rows, tokens)` bool, for one image per row: its valid tokens, the padding after them (a key mask
      is then enough and cheaper than the block-diagonal one);
    - for packed rows, the gathers to one image per row and back (`image_source`, `row_source`) and that layout's
      valid tokens (`image_mask` `(N, prefix + K)`): attention within each image's own row, where a kernel over
      the runs is not at hand, computes no score between two images."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    token_runs: torch.Tensor
    token_mask: torch.Tensor | None = None
    image_source: torch.Tensor | None = None  # (N * (prefix + K),) the packed token of each image token, -1 for none
    row_source: torch.Tensor | None = None  # (rows * tokens,) the image token of each packed token, -1 for none
    image_mask: torch.Tensor | None = None  # (N, prefix + K) bool

    @property
    def batch_size(self) -> int:
        return self.token_runs.shape[0]

    @property
    def row_length(self) -> int:
        return self.token_runs.shape[1]

    def block_diagonal_mask(self) -> torch.Tensor:
        """`(rows, 1, tokens, tokens)` bool: True where query and key are in one run."""
        runs = self.token_runs
        return (runs[:, :, None] == runs[:, None, :])[:, None]


def _segments(lengths: torch.Tensor, token_runs: torch.Tensor, token_mask: torch.Tensor | None = None, **gathers):
    """`AttentionSegments` of runs of `lengths` tokens (flattened, row after row)."""
    cu_seqlens = F.pad(lengths.flatten().cumsum(0), (1, 0)).to(torch.int32)
    return AttentionSegments(cu_seqlens, token_runs.shape[1], token_runs, token_mask, **gathers)


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """The layout of a native-aspect batch, padded or packed, for a model with `prefix` prefix tokens per image.

    The images one per row (the embeddings, the pooling, the heads) are `(N, prefix + K)` tokens; the blocks run the
    batch's rows: the same for a padded batch, `(R, L + prefix * M)` tokens for a packed one (each image's prefix
    tokens, then its patches, consecutive; the padding at the end of the row). Indices of -1 take zeros."""

    grids: torch.Tensor  # (N, 2): each image's grid
    prefix: int  # the prefix tokens of each image
    token_mask: torch.Tensor  # (N, prefix + K) bool: each image's tokens (the kept ones, with token dropping)
    segments: AttentionSegments  # the runs of the blocks' rows
    slots: tuple[int, int] | None = None  # (R, L): the packed batch's rows of patch slots
    patch_source: torch.Tensor | None = None  # (N * K,) the packed slot of each image's patch k

    @property
    def packed(self) -> bool:
        return self.segments.row_source is not None

    @property
    def pack_source(self) -> torch.Tensor | None:
        """`(R * (L + prefix * M),)`: the image token of each packed token (the segments' gather)."""
        return self.segments.row_source

    @property
    def unpack_source(self) -> torch.Tensor | None:
        """`(N * (prefix + K),)`: the packed token of each image token (the segments' gather)."""
        return self.segments.image_source

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
        patch_image_index: torch.Tensor | None = None,
        patch_positions: torch.Tensor | None = None,
        row_image_index: torch.Tensor | None = None,
        image_slot_index: torch.Tensor | None = None,
    ) -> BatchLayout:
        """The layout of a padded batch, or of a packed one (`patch_image_index` given); see the module's docstring."""
        if patch_image_index is None:
            for name, value in (
                ("patch_positions", patch_positions),
                ("row_image_index", row_image_index),
                ("image_slot_index", image_slot_index),
            ):
                if value is not None:
                    raise ValueError(f"`{name}` describes a packed batch: give `patch_image_index` too.")
            return _padded(pixel_values, spatial_shapes, prefix, pixel_attention_mask)
        _check_index_types(
            patch_image_index=patch_image_index, patch_positions=patch_positions, row_image_index=row_image_index,
            image_slot_index=image_slot_index, spatial_shapes=spatial_shapes,
        )  # fmt: skip
        if row_image_index is None or image_slot_index is None:  # built by other code: the host makes them
            fields = packed_index_fields(patch_image_index, spatial_shapes, pixel_attention_mask, patch_positions)
            device = patch_image_index.device
            row_image_index, image_slot_index = (fields[name].to(device, non_blocking=True) for name in fields)
            pixel_attention_mask = None  # checked on the host
        fields = (spatial_shapes, patch_image_index, row_image_index, image_slot_index, pixel_attention_mask)
        device = pixel_values.device
        _check_packed_values(
            pixel_values.shape[:2],
            *(None if value is None else value.to(device) for value in (*fields, patch_positions)),
        )
        return _packed(pixel_values, spatial_shapes, prefix, patch_image_index, row_image_index, image_slot_index)

    def unpack_patches(self, values: torch.Tensor) -> torch.Tensor:
        """`(R, L, ...)` per patch slot (pixels, labels, a corruption) -> `(N, K, ...)`, one image per row."""
        if not self.packed:
            return values
        if not isinstance(values, torch.Tensor) or tuple(values.shape[:2]) != self.slots:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(
                f"A packed batch's `pixel_values` (and any labels or masks per patch) are ({self.slots[0]}, "
                f"{self.slots[1]}, ...) per patch slot, as its `patch_image_index`; got {shape}."
            )
        images = self.grids.shape[0]
        return take_rows(values.flatten(0, 1), self.patch_source).unflatten(0, (images, -1))

    def pack(self, tokens: torch.Tensor) -> torch.Tensor:
        """`(N, prefix + K, D)` -> the blocks' rows (the same for a padded batch)."""
        if not self.packed:
            return tokens
        rows, length = self.segments.token_runs.shape
        return take_rows(tokens.flatten(0, 1), self.pack_source).unflatten(0, (rows, length))

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """The blocks' rows -> `(N, prefix + K, D)`, zero beyond each image's tokens."""
        if not self.packed:
            return tokens
        return take_rows(tokens.flatten(0, 1), self.unpack_source).unflatten(0, tuple(self.token_mask.shape))


def take_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`values[index]` along the first dimension, zeros where `index` is -1 (an appended zero row)."""
    padded = torch.cat([values, values.new_zeros(1, *values.shape[1:])])
    return padded.index_select(0, torch.where(index < 0, values.shape[0], index).to(values.device))


def check_native_batch(pixel_values: torch.Tensor, spatial_shapes: torch.Tensor, config, images: int) -> None:
    """Refuse, by their shapes and types, inputs the model cannot embed as a native-aspect batch of `images` images,
    with the fix (the values are the processor's to check: see the module's docstring)."""
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


def _padded(
    pixel_values: torch.Tensor, spatial_shapes: torch.Tensor, prefix: int, pixel_attention_mask: torch.Tensor | None
) -> BatchLayout:
    batch, patches = pixel_values.shape[:2]
    device = pixel_values.device
    if pixel_attention_mask is not None and tuple(pixel_attention_mask.shape) != (batch, patches):
        raise ValueError(
            f"`pixel_attention_mask` has shape {tuple(pixel_attention_mask.shape)}, but `pixel_values` holds "
            f"{batch} images of {patches} patches: ({batch}, {patches}), as the image processor returns it."
        )
    grids = spatial_shapes.to(device)
    sizes = grids[:, 0] * grids[:, 1]
    patch_mask = torch.arange(patches, device=device) < sizes[:, None]
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
    # each row: its image's tokens, then its padding (an empty run where it has none)
    lengths = torch.stack([prefix + sizes, patches - sizes], dim=1)
    number = torch.arange(batch, device=device)[:, None]
    runs = torch.where(token_mask, number, -1 - number)
    return BatchLayout(grids, prefix, token_mask, _segments(lengths, runs, token_mask))


def _check_on_device(condition: torch.Tensor, message: str) -> None:
    """Refuse the batch with `message` where `condition` (a one-value bool tensor) is False, checked on its device:
    a failed check stops the run where the device reports it, and no read waits for it. torch has no public
    asynchronous assert: where its `_assert_async` is missing (a later torch), the processor's checks are the only
    ones, and the forward runs on."""
    assert_async = getattr(torch, "_assert_async", None)
    if assert_async is not None:
        assert_async(condition, message)


def _check_index_types(**fields: torch.Tensor | None) -> None:
    """Refuse a packed batch's index fields that are not integer tensors (a property of the tensor: no read)."""
    for name, value in fields.items():
        if value is not None and (
            not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex()
            or value.dtype == torch.bool
        ):  # fmt: skip
            raise ValueError(
                f"`{name}` must be an integer tensor, as the image processor returns it; got {_describe(value)}."
            )


def _check_packed_shapes_and_ranges(
    slots: tuple[int, int],
    image_slot_index: torch.Tensor,
    patch_image_index: torch.Tensor,
    row_image_index: torch.Tensor,
    grids: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None,
    patch_positions: torch.Tensor | None,
) -> None:
    """Refuse a packed batch's fields of the wrong shapes (at once) or with indices out of range (on the device)."""
    rows, length = slots
    images = image_slot_index.shape[0]
    for name, value, shape in (
        ("patch_image_index", patch_image_index, slots),
        ("row_image_index", row_image_index, (rows, row_image_index.shape[-1])),
        ("spatial_shapes", grids, (images, 2)),
        ("pixel_attention_mask", pixel_attention_mask, slots),
        ("patch_positions", patch_positions, slots),
    ):
        if value is not None and (value.ndim != 2 or tuple(value.shape) != shape):
            raise ValueError(
                f"`{name}` has shape {tuple(value.shape)}, but `pixel_values` holds {rows} rows of {length} patch "
                f"slots and `image_slot_index` {images} images: {shape}, as the image processor returns it."
            )
    # the messages name no size: a compiled model would take each size as a constant
    for name, value, bound, what in (
        ("patch_image_index", patch_image_index, images, "images of `spatial_shapes`"),
        ("row_image_index", row_image_index, images, "images of `spatial_shapes`"),
        ("image_slot_index", image_slot_index, rows * length, "patch slots of `pixel_values` (row * length + slot)"),
    ):
        _check_on_device(
            ((value >= -1) & (value < bound)).all(), f"`{name}` must hold -1 or one of the batch's {what}."
        )


def _check_packed_values(
    slots: tuple[int, int],
    grids: torch.Tensor,
    patch_image_index: torch.Tensor,
    row_image_index: torch.Tensor,
    image_slot_index: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None,
    patch_positions: torch.Tensor | None,
) -> None:
    """Refuse, on the device (`_check_on_device`), a packed batch whose fields disagree with each other or with the
    pixels' rows (`slots`: R rows of L patch slots): every image of `grids` listed once in `row_image_index`, its
    patches (its grid's first rows * cols places, or those `patch_positions` keeps) in the slots `image_slot_index`
    gives, one run from where the row's images before it end, each of those slots holding it in `patch_image_index`
    and no other slot holding an image; `pixel_attention_mask` marks exactly those slots. The first failed check
    names its field. Indices out of range are clamped for the checks themselves."""
    rows, length = slots
    images, patches = image_slot_index.shape
    total, device = rows * length, image_slot_index.device
    fields = (patch_image_index, row_image_index, grids, pixel_attention_mask, patch_positions)
    _check_packed_shapes_and_ranges(slots, image_slot_index, *fields)
    listed = row_image_index >= 0
    entry_image = torch.where(listed, row_image_index, images).clamp(max=images)
    times = torch.zeros(images + 1, dtype=torch.long, device=device).scatter_add(
        0, entry_image.flatten(), torch.ones_like(entry_image.flatten())
    )
    _check_on_device(
        (times[:images] == 1).all(),
        "`row_image_index` must list each image of `spatial_shapes` once, in the row holding it "
        "(batches concatenated along their rows are not one batch: process the images together).",
    )
    present = image_slot_index >= 0
    sizes = grids[:, 0] * grids[:, 1]
    inside = torch.arange(patches, device=device) < sizes[:, None]
    fits = (present <= inside) if patch_positions is not None else (present == inside)
    _check_on_device(
        (grids >= 1).all() & (sizes <= patches).all() & fits.all(),
        "`spatial_shapes` must give each image's grid (rows, columns): its rows * cols patches are the places "
        "`image_slot_index` gives a slot.",
    )
    slot = image_slot_index.clamp(0, total - 1)
    holder = patch_image_index.flatten().clamp(-1, images - 1)[slot]
    taken = torch.zeros(total + 1, dtype=torch.long, device=device).scatter_add(
        0, torch.where(present, slot, total).flatten(), torch.ones_like(slot.flatten())
    )[:total]
    filled = (patch_image_index >= 0).flatten()
    owner = torch.arange(images, device=device)[:, None]
    _check_on_device(
        (~present | (holder == owner)).all() & (taken == filled.long()).all(),
        "`patch_image_index` must give each patch slot the image whose patch `image_slot_index` puts there, and -1 "
        "on every other slot.",
    )
    kept = F.pad(present.sum(dim=1), (0, 1))[entry_image]
    start = kept.cumsum(dim=1) - kept
    first = torch.arange(rows, device=device)[:, None] * length + start
    image_first = torch.zeros(images + 1, dtype=torch.long, device=device).scatter(
        0, entry_image.flatten(), first.flatten()
    )[:images, None]
    in_run = (image_slot_index >= image_first) & (image_slot_index < image_first + present.sum(1, keepdim=True))
    _check_on_device(
        (~present | in_run).all() & ((start + kept)[:, -1:] <= length).all(),
        "`row_image_index` must list each row's images in the order their patches lie in the row, one run each "
        "from the row's first slot (as the image processor packs them).",
    )
    if pixel_attention_mask is not None:
        _check_on_device(
            (pixel_attention_mask.bool().flatten() == filled).all(),
            "`pixel_attention_mask` must mark exactly the patch slots `patch_image_index` gives an image.",
        )
    if patch_positions is not None:
        place = patch_positions.flatten()[slot]
        _check_on_device(
            (~present | (place == torch.arange(patches, device=device))).all(),
            "`patch_positions` must give each slot the place of its image's grid `image_slot_index` gives it.",
        )


def _packed(
    pixel_values: torch.Tensor,
    spatial_shapes: torch.Tensor,
    prefix: int,
    patch_image_index: torch.Tensor,
    row_image_index: torch.Tensor,
    image_slot_index: torch.Tensor,
) -> BatchLayout:
    rows, slots = pixel_values.shape[:2]
    images, patches = image_slot_index.shape
    most = row_image_index.shape[1]  # M: the most images in one row
    device = pixel_values.device
    row_image_index, image_slot_index = row_image_index.to(device), image_slot_index.to(device)
    row_tokens, image_tokens = slots + prefix * most, prefix + patches
    present = image_slot_index >= 0  # (N, K)
    kept = present.sum(dim=1)  # (N,): each image's patches in its row
    # Per row entry (row, m): its image (N for none: a spare entry that collects what no image takes), its patches,
    # and the slot its run starts at.
    listed = row_image_index >= 0
    entry_image = torch.where(listed, row_image_index, images)
    entry_patches = torch.where(listed, F.pad(kept, (0, 1))[entry_image], 0)
    entry_start = entry_patches.cumsum(dim=1) - entry_patches

    def per_image(values: torch.Tensor) -> torch.Tensor:
        spare = values.new_zeros(images + 1)
        return spare.scatter(0, entry_image.flatten(), values.flatten())[:images]

    row = per_image(torch.arange(rows, device=device)[:, None].expand(rows, most))
    rank = per_image(torch.arange(most, device=device)[None, :].expand(rows, most))
    start = per_image(entry_start)
    # the packed token of each image token: its prefix tokens where its run starts, its patches after them (each
    # image before it in the row adds its prefix tokens)
    prefix_at = (row * row_tokens + start + prefix * rank)[:, None] + torch.arange(prefix, device=device)
    slot_row, slot = image_slot_index.div(slots, rounding_mode="floor"), image_slot_index.remainder(slots)
    patch_at = slot_row * row_tokens + slot + prefix * (rank[:, None] + 1)
    token_mask = F.pad(present, (prefix, 0), value=True)  # (N, prefix + K)
    packed_at = torch.where(token_mask, torch.cat([prefix_at, patch_at], dim=1), -1)
    image_token = torch.arange(images * image_tokens, device=device)
    spare = rows * row_tokens  # where the image tokens that have no packed token are put, then dropped
    pack_source = torch.full((spare + 1,), -1, dtype=torch.long, device=device)
    pack_source = pack_source.scatter(0, torch.where(packed_at < 0, spare, packed_at).flatten(), image_token)[:spare]
    # the blocks' runs: each row's images in order, then its padding
    image_lengths = torch.where(listed, prefix + entry_patches, 0)
    lengths = torch.cat([image_lengths, row_tokens - image_lengths.sum(1, keepdim=True)], dim=1)
    number = torch.arange(rows, device=device)[:, None]
    runs = torch.where(pack_source.view(rows, row_tokens) >= 0, pack_source.view(rows, row_tokens) // image_tokens,
                       -1 - number)  # fmt: skip
    return BatchLayout(
        grids=spatial_shapes.to(device),
        prefix=prefix,
        token_mask=token_mask,
        segments=_segments(
            lengths, runs, image_source=packed_at.flatten(), row_source=pack_source, image_mask=token_mask
        ),
        slots=(rows, slots),
        patch_source=image_slot_index.flatten(),
    )


def packed_index_fields(
    patch_image_index: torch.Tensor,
    spatial_shapes: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None = None,
    patch_positions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """`row_image_index` `(R, M)` and `image_slot_index` `(N, K)` of a packed batch (see the module's docstring), on
    the CPU, with the batch checked: every image of `spatial_shapes` in exactly one row, its `rows * cols` patches
    consecutive (with `patch_positions`, the patches it keeps, each place of its grid at most once);
    `pixel_attention_mask`, when given, marks exactly the images' slots. Vectorised: no work per image but integer
    bookkeeping."""
    if not isinstance(patch_image_index, torch.Tensor) or patch_image_index.ndim != 2:
        raise ValueError(
            "`patch_image_index` must be a (rows, packed_sequence_length) tensor of the image each patch slot holds "
            f"(-1 on the padding), as the image processor returns it; got {_describe(patch_image_index)}."
        )
    if not isinstance(spatial_shapes, torch.Tensor) or spatial_shapes.ndim != 2 or spatial_shapes.shape[1] != 2:
        raise ValueError(
            f"`spatial_shapes` must be an (images, 2) tensor of each image's grid; got {_describe(spatial_shapes)}."
        )
    index = patch_image_index.detach().cpu().long()
    grids = [tuple(grid) for grid in spatial_shapes.detach().cpu().tolist()]
    rows, slots = index.shape
    sizes = [height * width for height, width in grids]
    if any(height < 1 or width < 1 for height, width in grids):
        raise ValueError(f"`spatial_shapes` {grids} must be grids of at least 1x1.")
    if pixel_attention_mask is not None and (
        tuple(pixel_attention_mask.shape) != (rows, slots)
        or not torch.equal(pixel_attention_mask.detach().cpu().bool(), index >= 0)
    ):
        raise ValueError(
            "`pixel_attention_mask` must mark exactly the slots `patch_image_index` gives an image (>= 0), as the "
            "image processor returns it."
        )
    if patch_positions is not None and (
        not isinstance(patch_positions, torch.Tensor) or tuple(patch_positions.shape) != (rows, slots)
    ):
        raise ValueError(
            f"`patch_positions` must be a ({rows}, {slots}) tensor, as `patch_image_index`; got "
            f"{_describe(patch_positions)}."
        )
    where = None if patch_positions is None else patch_positions.detach().cpu().long()
    # The runs of one value in each row (one per image, and the padding's).
    flat = index.flatten()
    starts = torch.ones(len(flat), dtype=torch.bool)
    starts[1:] = (flat[1:] != flat[:-1]) | (torch.arange(1, len(flat)) % slots == 0)
    first = starts.nonzero().squeeze(1)
    length = torch.diff(first, append=torch.tensor([len(flat)]))
    image_runs = flat[first] >= 0
    images, first, length = flat[first][image_runs], first[image_runs], length[image_runs]
    size_of = torch.tensor(sizes)
    places_ok = where is None or _places_are_distinct_and_inside(flat, where.flatten(), size_of)
    _check_runs(images.tolist(), first.tolist(), length.tolist(), slots, grids, sizes, where is not None,
                None if places_ok else where)  # fmt: skip
    count = len(grids)
    row = first // slots
    # each image's place among its row's images (the runs come in the rows' order)
    new_row = torch.ones(len(row), dtype=torch.bool)
    new_row[1:] = row[1:] != row[:-1]
    row_first = torch.cummax(torch.where(new_row, torch.arange(len(row)), 0), 0).values
    rank = torch.arange(len(row)) - row_first
    most = int(rank.max()) + 1 if len(rank) else 1
    row_image_index = torch.full((rows, most), -1, dtype=torch.long)
    row_image_index[row, rank] = images
    # every filled slot: its image and its place in the image's grid (its offset in the run, or `patch_positions`)
    image_first = torch.empty(count, dtype=torch.long)
    image_first[images] = first
    filled = (flat >= 0).nonzero().squeeze(1)
    image = flat[filled]
    place = filled - image_first[image] if where is None else where.flatten()[filled]
    image_slot_index = torch.full((count, max(sizes)), -1, dtype=torch.long)
    image_slot_index[image, place] = filled
    return {"row_image_index": row_image_index, "image_slot_index": image_slot_index}


def _places_are_distinct_and_inside(flat: torch.Tensor, places: torch.Tensor, sizes: torch.Tensor) -> bool:
    """Whether every image slot's place (`patch_positions`) is inside its image's grid and no place is taken twice."""
    filled = flat >= 0
    image, place = flat[filled], places[filled]
    size = sizes[image.clamp(max=len(sizes) - 1)]
    if not bool(((place >= 0) & (place < size)).all()):
        return False
    return len(torch.unique(image * int(sizes.max()) + place)) == len(place)


def _check_runs(
    images: list[int],
    firsts: list[int],
    lengths: list[int],
    slots: int,
    grids: list[tuple[int, int]],
    sizes: list[int],
    dropping: bool,
    wrong_places: torch.Tensor | None,
) -> None:
    """Refuse runs that do not place every image of `grids` whole (`dropping`: the places it keeps) in one run, once;
    `wrong_places` (`patch_positions`) is given only where some places are wrong, to name them."""
    placed = [False] * len(grids)
    for image, first, count in zip(images, firsts, lengths):
        row, slot = divmod(first, slots)
        if image >= len(grids) or placed[image]:
            raise ValueError(
                f"`patch_image_index` row {row} names image {image} at slot {slot}: each of the {len(grids)} images "
                "of `spatial_shapes` must fill one run of consecutive slots, once."
            )
        placed[image] = True
        if wrong_places is not None:
            positions = wrong_places.flatten()[first : first + count]
            if bool((positions < 0).any() or (positions >= sizes[image]).any()) or len(positions.unique()) != count:
                raise ValueError(
                    f"`patch_positions` of image {image} (row {row}) must be distinct places of its grid "
                    f"{grids[image]}, from 0 to {sizes[image] - 1}; got {positions.tolist()}."
                )
        if not dropping and count != sizes[image]:
            raise ValueError(
                f"`patch_image_index` row {row} holds image {image} from slot {slot}, but not as one run of its "
                f"{sizes[image]} patches (its grid {grids[image]} in `spatial_shapes`)."
            )
    missing = [image for image, done in enumerate(placed) if not done]
    if missing:
        raise ValueError(f"Images {missing} of `spatial_shapes` have no patches in `patch_image_index`.")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def masked_mean(hidden_states: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """The average of `(B, N, D)` tokens over those `token_mask` `(B, N)` marks."""
    weights = token_mask.to(hidden_states.dtype)[..., None]
    return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1)


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
