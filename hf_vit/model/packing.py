"""Packed batches (NaViT's "Patch n' Pack"): several whole images in each row of a fixed number of patch slots.

The image processor (`packed_sequence_length=L`; its `packed_patch_batch`) returns

    pixel_values          (R, L, P * P * C)   every image's patches, consecutive in its row, the padding after them
    pixel_attention_mask  (R, L)              1 on the images' patches
    spatial_shapes        (N, 2)              each image's grid (rows, columns), in the order the images were given
    patch_image_index     (R, L)              the image each slot holds a patch of, -1 on the padding

and, for NaViT's token dropping in training, `patch_positions` (R, L): the place of each slot's patch in its image's
grid (row-major, -1 on the padding), each image's run then holding only the patches it keeps, in any order. The
embedding (1) is that of the whole grid; the dropped patches' tokens take no part in the blocks or the pooling.

and the model runs it as the native-aspect batch of the same images (`naflex.py`) with the tokens moved: equation (1)
embeds each image on its own grid, with its own class and register tokens, as that batch does; the encoder's blocks
run on packed rows, each image's tokens (prefix tokens, then patches) consecutive, attention restricted to each image
(`AttentionSegments`); the final tokens go back to one image per row for the pooling and the heads. Moving tokens is
exact, and the blocks act on each token alone except in attention, so each image's outputs are those it has alone.

Saved next to checkpoints as remote code with the model, so it imports only torch and its siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionSegments, attention_segments

__all__ = ["PackedLayout", "packed_layout"]


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where each image's tokens sit in a packed batch, and the moves between the two layouts.

    The native layout is one image per row, `image_tokens` = prefix tokens + the most patches of an image; the packed
    layout is `rows` rows of `row_tokens` = L patch slots + the prefix tokens of the row with the most images. Indices
    of -1 take zeros."""

    rows: int
    slots: int
    row_tokens: int
    image_tokens: int
    patch_mask: torch.Tensor  # (N, image_tokens - prefix) bool: each image's patches in the native layout
    segments: AttentionSegments | None  # each image's tokens in the packed rows
    patch_source: torch.Tensor  # (N * patches,) the packed slot of each native patch
    pack_source: torch.Tensor  # (rows * row_tokens,) the native token of each packed token
    unpack_source: torch.Tensor  # (N * image_tokens,) the packed token of each native token
    kept: torch.Tensor | None = None  # (N, image_tokens) bool: the tokens not dropped (None: none dropped)

    def unpack_patches(self, values: torch.Tensor) -> torch.Tensor:
        """`(R, L, ...)` per patch slot (pixels, a mask) -> `(N, patches, ...)`, one image per row."""
        if not isinstance(values, torch.Tensor) or tuple(values.shape[:2]) != (self.rows, self.slots):
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(
                f"A packed batch's `pixel_values` (and any labels or masks per patch) are ({self.rows}, "
                f"{self.slots}, ...) per patch slot, as its `patch_image_index`; got {shape}."
            )
        patches = self.patch_mask.shape[1]
        return _take(values.flatten(0, 1), self.patch_source).unflatten(0, (-1, patches))

    def pack(self, tokens: torch.Tensor) -> torch.Tensor:
        """`(N, image_tokens, D)` -> `(rows, row_tokens, D)`."""
        return _take(tokens.flatten(0, 1), self.pack_source).unflatten(0, (self.rows, self.row_tokens))

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """`(rows, row_tokens, D)` -> `(N, image_tokens, D)`, zero beyond each image's tokens."""
        return _take(tokens.flatten(0, 1), self.unpack_source).unflatten(0, (-1, self.image_tokens))


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`values[index]` along the first dimension, zeros where `index` is -1 (the appended zero row)."""
    padded = torch.cat([values, values.new_zeros(1, *values.shape[1:])])
    return padded.index_select(0, torch.where(index < 0, len(values), index).to(values.device))


@torch.compiler.disable  # host bookkeeping, per batch: compiled, it would guard on every image's place
def packed_layout(
    patch_image_index: torch.Tensor,
    spatial_shapes: torch.Tensor,
    num_prefix_tokens: int,
    pixel_attention_mask: torch.Tensor | None = None,
    patch_positions: torch.Tensor | None = None,
) -> PackedLayout:
    """The layout of a packed batch, checked: every image of `spatial_shapes` in exactly one row, its `rows * cols`
    patches consecutive (with `patch_positions`, the patches it keeps, each place of its grid at most once);
    `pixel_attention_mask`, when given, marks exactly the images' slots. Read on the host (one copy from the device
    per batch)."""
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
    # The runs of one value in each row (one per image, and the padding's), as tensors: no work per image below but
    # integer bookkeeping (a batch of 173 images took 11 ms of host time with tensor operations per image).
    flat = index.flatten()
    starts = torch.ones(len(flat), dtype=torch.bool)
    starts[1:] = (flat[1:] != flat[:-1]) | (torch.arange(1, len(flat)) % slots == 0)
    first = starts.nonzero().squeeze(1)
    length = torch.diff(first, append=torch.tensor([len(flat)]))
    image_runs = flat[first] >= 0
    images, first, length = flat[first][image_runs], first[image_runs], length[image_runs]
    size_of = torch.tensor(sizes)  # each image's patches
    places_ok = where is None or _places_are_distinct_and_inside(flat, where.flatten(), size_of)
    found = images.tolist(), first.tolist(), length.tolist()
    _check_runs(*found, slots, grids, sizes, where is not None, None if places_ok else where)
    count = len(grids)
    row, slot = first // slots, first % slots  # of each image's run, in the rows' order
    prefix = num_prefix_tokens
    tokens = prefix + length  # each image's tokens in its row: its prefix, then the patches it keeps
    # where each image's tokens start in its row: the tokens of the images before it in that row
    before = torch.cumsum(tokens, 0) - tokens
    new_row = torch.ones(len(row), dtype=torch.bool)
    new_row[1:] = row[1:] != row[:-1]
    row_first = torch.cummax(torch.where(new_row, torch.arange(len(row)), 0), 0).values
    start = before - before[row_first]
    per_row = torch.bincount(row, minlength=rows)
    patches = max(sizes)
    image_tokens, row_tokens = prefix + patches, slots + prefix * int(per_row.max())
    # per image, by its number
    image_row, image_slot, image_start = (torch.empty(count, dtype=torch.long) for _ in range(3))
    image_row[images], image_slot[images], image_start[images] = row, slot, start
    # every patch slot of an image: its image, its place in the run, its place in the image's grid
    filled = (flat >= 0).nonzero().squeeze(1)
    image = flat[filled]
    offset = filled - (image_row[image] * slots + image_slot[image])
    place = offset if where is None else where.flatten()[filled]
    packed_at = image_row[image] * row_tokens + image_start[image] + prefix + offset
    native_at = image * image_tokens + prefix + place
    patch_source = torch.full((count * patches,), -1, dtype=torch.long)
    pack_source = torch.full((rows * row_tokens,), -1, dtype=torch.long)
    unpack_source = torch.full((count * image_tokens,), -1, dtype=torch.long)
    patch_source[image * patches + place] = filled
    pack_source[packed_at], unpack_source[native_at] = native_at, packed_at
    numbers = torch.arange(count)
    for token in range(prefix):  # the prefix tokens (class, distillation, registers) of each image
        packed_at, native_at = image_row * row_tokens + image_start + token, numbers * image_tokens + token
        pack_source[packed_at], unpack_source[native_at] = native_at, packed_at
    runs: list[list[int]] = [[] for _ in range(rows)]
    for at, kept_tokens in zip(row.tolist(), tokens.tolist()):
        runs[at].append(kept_tokens)
    device = patch_image_index.device
    dropped = bool((length < size_of[images]).any())
    return PackedLayout(
        rows=rows,
        slots=slots,
        row_tokens=row_tokens,
        image_tokens=image_tokens,
        patch_mask=(torch.arange(patches) < size_of[:, None]).to(device, non_blocking=True),
        segments=attention_segments(runs, row_tokens, device),
        patch_source=patch_source.to(device, non_blocking=True),
        pack_source=pack_source.to(device, non_blocking=True),
        unpack_source=unpack_source.to(device, non_blocking=True),
        kept=(unpack_source >= 0).view(count, image_tokens).to(device, non_blocking=True) if dropped else None,
    )


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
