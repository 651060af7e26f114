"""Torch-only transforms from a data set's images to model inputs, for training `hf_vit` models with
`transformers.Trainer`.

Transforms: `make_train_transform` (random resized crop, optional horizontal flip, RandAugment, random erasing) and
`make_eval_transform` (the image processor alone) map a batch `{"image": [...], "label": [...]}` to `{"pixel_values":
float32 [N, 3, H, W], "labels": int64 [N]}`. Both take their pixels from the image processor's own path (`load_images`
for decoding, EXIF orientation, RGB conversion with transparency on white and 16-bit scaling; `resize_images`;
`normalize_batch`), so training sees exactly the pixels inference sees; the training transform only adds its
augmentations. Use them through `apply_transforms(ds, train_transform, eval_transform)` and `collate_fn` as the
Trainer's `data_collator` (with `remove_unused_columns=False`, since the transforms read the `image` and `label`
columns).

Corrupt images fail loudly: an image that cannot be decoded raises `CorruptImageError` naming its file (or its size
in bytes) and its position in the batch, chaining PIL's error. Nothing is dropped silently, because that would
change the data set. `apply_transforms` turns off datasets' own decoding so the transforms decode and report it;
with decoding left on (plain `set_transform`), datasets raises PIL's error before the transform runs.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import PIL.Image
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from torch.nn import functional as F

from ..model.image_geometry import output_size as fixed_output_size
from ..model.image_geometry import resize_target
from ..model.image_processing_vit import (
    VisionTransformerImageProcessor,
    center_crop_images,
    exif_transpose,
    grid_for_max_patches,
    load_images,
    native_patch_batch,
    open_image,
    pack_patches,
    resize_images,
    to_resampling,
)
from .augment.rand_augment import RandAugment
from .augment.random_erasing import RandomErasing, check_random_erasing

_IMAGE_DECODER = datasets.Image()
_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
DRAFT_SCALES = (8, 4, 2)
"""The JPEG reductions the training transform decodes at (libjpeg's scaled IDCT), largest first."""
PACKED_ROW = "packed_row"
"""An example's row in its packed batch, where a sampler planned it (`packed_batches.PackedBatchSampler`)."""

Transform = Callable[[Mapping[str, Sequence[Any]]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Augmentation:
    """How a run augments its training images: the values of the augmentation flags (`--random_resized_crop`,
    `--crop_scale_min`, `--hflip` resolved to on or off, `--rand_augment`, `--reprob`, `--remode`, `--recount`,
    `--token_drop_rate`)."""

    random_resized_crop: bool = True
    crop_scale_min: float = 0.08
    hflip: bool = True
    rand_augment: str | None = None
    reprob: float = 0.0
    remode: str = "pixel"
    recount: int = 1
    token_drop_rate: float = 0.0


@dataclass(frozen=True)
class BatchSizes:
    """The sizes of a run's training batches, as their flags give them: `--max_num_patches` (native aspect ratio),
    `--packed_sequence_length` (those images packed into rows of that many patch slots), `--seq_lens` with
    `--max_tokens_per_batch` (a sequence length drawn per step), `--patch_sizes` with `--patch_size_probs` (a patch
    size drawn per step)."""

    max_num_patches: int | None = None
    packed_sequence_length: int | None = None
    seq_lens: str | None = None
    max_tokens_per_batch: int | None = None
    patch_sizes: str | None = None
    patch_size_probs: str | None = None


class CorruptImageError(ValueError):
    """An image could not be decoded (unreadable, truncated or not an image file)."""


# ---------------------------------------------------------------------------------------------------------------------
# Data sets


def decode_image(image: Any, index: int | None = None) -> PIL.Image.Image | np.ndarray | torch.Tensor:
    """Decode a data set image (`{"path", "bytes"}` dict, path or bytes) with the image processor's `open_image`.

    PIL images, numpy arrays and tensors are returned as they are: the processor's `load_images` converts them.
    Raises `CorruptImageError` naming the file (and `index`, its position in the batch), chaining PIL's error.
    """
    where = "" if index is None else f" (image {index} of the batch)"
    if isinstance(image, (PIL.Image.Image, np.ndarray, torch.Tensor)):
        return _checked_pixels(image, f"{type(image).__name__}{where}")
    if isinstance(image, (str, os.PathLike)):
        image = {"path": os.fspath(image), "bytes": None}
    elif isinstance(image, (bytes, bytearray, memoryview)):
        image = {"path": None, "bytes": bytes(image)}
    if not isinstance(image, Mapping):
        raise TypeError(f"Unsupported image type {type(image).__name__}: expected a PIL image, a path or bytes.")
    path, data = image.get("path"), image.get("bytes")
    source = path or f"{len(data or b'')} bytes of image data"
    try:
        if data is None and path is not None and "://" in path:
            decoded = _IMAGE_DECODER.decode_example(image)  # remote files (hf://, s3://) are read by datasets
        else:
            decoded = open_image(data if data is not None else path)
    except (ValueError, OSError) as err:
        cause = err.__cause__ if isinstance(err.__cause__, Exception) else err  # PIL's own error, not our wrapper
        raise CorruptImageError(f"Cannot decode image {source}{where}: {cause}") from cause
    return _checked_pixels(decoded, f"{source}{where}")


def _checked_pixels(image: Any, source: str) -> Any:
    """`image`, refused by name (`source`: its file) when it has no pixels or holds NaN or infinite values: the
    processor would refuse it later without saying which file it was."""
    if isinstance(image, PIL.Image.Image):
        empty, values = image.width == 0 or image.height == 0, image.mode in ("F", "I;16F")
    else:
        empty, values = 0 in tuple(image.shape), np.issubdtype(np.asarray(image).dtype, np.floating)
    if empty:
        size = f"{image.width}x{image.height}" if isinstance(image, PIL.Image.Image) else f"shape {tuple(image.shape)}"
        raise CorruptImageError(f"Image {source} has no pixels ({size}): remove it from the data set.")
    if values and not np.isfinite(np.asarray(image, dtype=np.float32)).all():
        raise CorruptImageError(
            f"Image {source} contains NaN or infinite values: fix or remove it (e.g. numpy.nan_to_num) first."
        )
    return image


def decode_rgb(image: Any, index: int | None = None) -> PIL.Image.Image:
    """Return `image` (PIL image, `{"path", "bytes"}` dict, path, bytes or array) as an RGB PIL image.

    The pixels are those the image processor uses (EXIF orientation, transparency on white, 16-bit scaling).
    Raises `CorruptImageError` naming the file (and `index`, its position in the batch) when it cannot be decoded.
    """
    (pixels,) = load_images(decode_image(image, index))
    if pixels.is_floating_point():
        pixels = pixels.round().clamp(0, 255).to(torch.uint8)
    return PIL.Image.fromarray(pixels.expand(3, -1, -1).permute(1, 2, 0).numpy())


def _load_batch(batch: Mapping[str, Sequence[Any]], do_convert_rgb: bool) -> list[torch.Tensor]:
    """The batch's images as `[C, H, W]` tensors (uint8 unless given as floats) through the processor's path."""
    return load_images([decode_image(image, i) for i, image in enumerate(batch["image"])], do_convert_rgb)


def make_eval_transform(processor: VisionTransformerImageProcessor) -> Transform:
    """Batch transform for evaluation: decode the images, then `processor` does everything else (as at inference);
    one example per image, also for a processor that packs (`packed_sequence_length`): a batch's rows are made where
    the batch is, by `collate_fn` or `pack_native_batch`."""
    if getattr(processor, "packed_sequence_length", None) is not None:
        processor = copy.copy(processor)
        processor.packed_sequence_length = None

    def transform(batch: Mapping[str, Sequence[Any]]) -> dict[str, torch.Tensor]:
        images = [decode_image(image, i) for i, image in enumerate(batch["image"])]
        processed = processor(images, return_tensors="pt")
        # native-aspect batches (the processor's max_num_patches) carry their padding mask and grids along
        return {**processed, **_with_labels(processed["pixel_values"], batch)}

    return transform


def make_train_transform(
    processor: VisionTransformerImageProcessor,
    *,
    random_resized_crop: bool = True,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: bool = True,
    seed: int | None = None,
    rand_augment: str | None = None,
    reprob: float = 0.0,
    remode: str = "pixel",
    recount: int = 1,
    token_drop_rate: float = 0.0,
) -> Transform:
    """Batch transform for training: random resized crop, random horizontal flip, then the processor's normalisation.

    Images are decoded and converted exactly as by `processor` (its `load_images`: EXIF orientation, transparency on
    white, 16-bit scaling). The crop covers a random fraction `scale` of the image area with an aspect ratio
    log-uniform in `ratio` (Inception-style; a central crop after 10 failed draws); it is cut from the uint8 image and
    resized with the processor's `resize_images` and `resample` to the processor's output size (`crop_size` when it
    centre-crops, else `size`; a shorter-side `size` needs the crop, which gives the one output size). Without
    `random_resized_crop`, the image goes through the processor's own resize and centre crop, so with `hflip=False`
    the output equals `processor(images)`. The flip (probability 1/2, when `hflip`; keep it off for digits and text)
    comes next, then RandAugment when `rand_augment` gives its policy in timm's
    notation (`rand_augment.RandAugment`: on the uint8 image, areas it uncovers filled with the processor's mean
    colour), and the processor's `normalize_batch`, once per batch; last, with `reprob` > 0, random erasing
    (`random_erasing.RandomErasing` with `remode` and `recount`) of each normalised image in turn, a native-aspect
    image within its own size before it is cut into patches. With `token_drop_rate` (native-aspect batches, to be
    packed: `collate_fn`), NaViT's token dropping: each image keeps a random `1 - token_drop_rate` of its patches (at
    least one), first in its row of `pixel_values`, their places in its grid in `patch_positions` (-1 after). With
    `seed`, the transform draws from its own generator (reproducible); otherwise, and always inside DataLoader workers
    (so they don't repeat each other), from torch's global generator, which the DataLoader seeds per worker and epoch.

    Encoded RGB and grey JPEGs (bytes, paths, `{"path", "bytes"}` dicts) take a faster road to the same crop: the
    crop is drawn from the header's size, and when it is at least 2, 4 or 8 times the output size in both directions
    the JPEG is decoded at that reduction in the DCT domain (`decode_jpeg_crop`), and PIL resizes the crop's exact
    (fractional) box of the reduced image. The crop box and the random draws are the same as on the full image; the
    pixels differ from resizing the full-size crop by the DCT-domain downscaling only (see `decode_jpeg_crop`). When
    no reduction applies, the pixels are exactly the processor's full-size crop, resized by `resize_images`.
    """
    if not (0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1]):
        raise ValueError(f"Need 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], got {scale}, {ratio}.")
    if not hasattr(processor, "normalize_batch"):
        raise TypeError(
            f"make_train_transform needs a VisionTransformerImageProcessor (it reuses its pixel path), got "
            f"{type(processor).__name__}."
        )
    crop_size = (int(processor.crop_size["height"]), int(processor.crop_size["width"]))
    output_size = fixed_output_size(processor.size, processor.crop_size, processor.do_center_crop)
    native, patch = processor.max_num_patches, processor.patch_size
    if output_size is None and native is None:
        raise ValueError(
            f"The processor's size={processor.size} without do_center_crop keeps each image's aspect ratio, so "
            "training crops have no one size to be resized to: set do_center_crop with crop_size, or size to a "
            "height and width."
        )
    augment_more = None
    if rand_augment:
        fill = tuple(round(255 * float(m)) for m in processor.image_mean)
        augment_more = RandAugment(rand_augment, fill=fill, resample=processor.resample)
    check_random_erasing(reprob, remode, recount)
    if token_drop_rate and (native is None or not 0 <= token_drop_rate < 1):
        raise ValueError(
            f"token_drop_rate {token_drop_rate} drops patches of native-aspect images (a processor with "
            "max_num_patches), a share in [0, 1)."
        )
    erasing = RandomErasing(reprob, remode, recount) if reprob else None
    if erasing is not None and not processor.do_normalize:
        raise ValueError(
            "--reprob fills the erased rectangles with the noise of normalised pixels (mean 0, std 1), but the "
            "processor does not normalise (do_normalize=False): normalise, or drop --reprob."
        )

    def size_for(height: int, width: int, budget: int) -> tuple[int, int]:
        """The size a crop (or image) of `height` x `width` is resized to: the processor's, or with `max_num_patches`
        the largest grid of at most `budget` patches at the crop's own aspect ratio."""
        if native is None:
            return output_size
        rows, cols = grid_for_max_patches(height, width, patch, budget)
        return rows * patch, cols * patch

    own_generator = None if seed is None else torch.Generator().manual_seed(seed)
    # Only RGB output has a fast road: without conversion the processor keeps modes the JPEG decoder would change.
    fast_jpegs = random_resized_crop and processor.do_convert_rgb

    def draw_box(height: int, width: int, generator: torch.Generator | None) -> tuple[int, int, int, int]:
        return random_resized_crop_box(height, width, scale, ratio, generator)

    def crop_and_resize(
        pixels: torch.Tensor, box: tuple[int, int, int, int] | None, generator, budget: int
    ) -> torch.Tensor:
        if random_resized_crop:
            # Cropping the uint8 image first means only the crop is resized.
            top, left, height, width = box or draw_box(*pixels.shape[1:], generator)
            size = size_for(height, width, budget)
            return resize_images(pixels[None, :, top : top + height, left : left + width], size, processor.resample)[0]
        if processor.do_resize:
            height, width = pixels.shape[1:]
            target = (
                resize_target(height, width, processor.size) if native is None else size_for(height, width, budget)
            )
            pixels = resize_images(pixels[None], target, processor.resample)[0]
        if processor.do_center_crop:
            pixels = center_crop_images(pixels, crop_size)
        return pixels

    def augment(image: Any, index: int, generator: torch.Generator | None, budget: int) -> torch.Tensor:
        box, pixels = None, None
        jpeg = _open_jpeg(image) if fast_jpegs else None
        if jpeg is not None:
            box = draw_box(*_upright_size(jpeg), generator)
            pixels = decode_jpeg_crop(jpeg, box, size_for(box[2], box[3], budget), processor.resample)
        if pixels is None:  # not a JPEG, or one the fast road cannot decode: the processor's own path reports it
            (pixels,) = load_images(decode_image(image, index), processor.do_convert_rgb)
            pixels = crop_and_resize(pixels, box, generator, budget)
        if hflip and torch.rand((), generator=generator) < 0.5:
            # Flipped as [H, W, C], so that the copy stays channels-last like the resized image.
            pixels = pixels.permute(1, 2, 0).flip(1).permute(2, 0, 1)
        if augment_more is not None:
            pixels = augment_more(pixels, generator)
        return pixels.expand(3, -1, -1) if processor.do_convert_rgb and pixels.shape[0] == 1 else pixels

    def transform(batch: Mapping[str, Sequence[Any]], max_num_patches: int | None = None) -> dict[str, torch.Tensor]:
        # `max_num_patches`: this batch's own number of patches per image (drawn per step with --seq_lens), in place
        # of the processor's.
        budget = max_num_patches or native
        generator = own_generator if torch.utils.data.get_worker_info() is None else None
        images = [augment(image, i, generator, budget) for i, image in enumerate(batch["image"])]
        if len({image.dtype for image in images}) > 1:  # float images among uint8 ones: stack them all as floats
            images = [image.float() for image in images]
        if native is not None:  # images of their own sizes: normalised one by one, as the processor's patches
            normalised = [processor.normalize_batch(image[None])[0] for image in images]
            if erasing is not None:
                normalised = [erasing(image, generator) for image in normalised]
            patches = native_patch_batch(normalised, patch, budget)
            if token_drop_rate:
                patches = drop_tokens(patches, token_drop_rate, generator)
            return {**patches, **_with_labels(patches["pixel_values"], batch)}
        # Stacked channels-last (the layout PIL and the uint8 resize give), so that normalising converts to float and
        # to channels-first in one pass over the batch.
        stacked = torch.stack([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)
        normalised = processor.normalize_batch(stacked)
        if erasing is not None:
            for image in normalised:
                erasing(image, generator)
        return _with_labels(normalised, batch)

    return transform


def kept_patch_count(count: int, rate: float) -> int:
    """How many of an image's `count` patches token dropping at `rate` keeps: `count - floor(rate * count)`, at least
    one. Only which patches is drawn; the number is fixed, and never larger for a smaller `count`."""
    return count - math.floor(rate * count)


def drop_tokens(
    patches: Mapping[str, torch.Tensor], rate: float, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """A native-aspect batch (`native_patch_batch`'s) with NaViT's token dropping: each image keeps
    `n - floor(rate * n)` of its `n` patches, drawn at random, in the order of its grid, first in its row (zeros
    after); `patch_positions` (N, K) gives their places in the grid, -1 after; `pixel_attention_mask` marks them."""
    pixel_values = torch.zeros_like(patches["pixel_values"])
    positions = torch.full(pixel_values.shape[:2], -1, dtype=torch.long)
    for index, (rows, cols) in enumerate(patches["spatial_shapes"].tolist()):
        count = rows * cols
        kept = torch.randperm(count, generator=generator)[: kept_patch_count(count, rate)].sort().values
        pixel_values[index, : len(kept)] = patches["pixel_values"][index, kept]
        positions[index, : len(kept)] = kept
    mask = (positions >= 0).int()
    return {**patches, "pixel_values": pixel_values, "pixel_attention_mask": mask, "patch_positions": positions}


def _open_jpeg(image: Any) -> PIL.Image.Image | None:
    """`image` opened lazily (header read, pixels not decoded) when it is an encoded RGB or grey JPEG, else None."""
    if isinstance(image, (str, os.PathLike)):
        path, data = os.fspath(image), None
    elif isinstance(image, (bytes, bytearray, memoryview)):
        path, data = None, bytes(image)
    elif isinstance(image, Mapping):
        path, data = image.get("path"), image.get("bytes")
    else:
        return None
    if data is None and (path is None or "://" in path):
        return None
    try:
        opened = PIL.Image.open(io.BytesIO(data) if data is not None else path)
    except (OSError, ValueError):
        return None  # decode_image names the file and the error
    if opened.format != "JPEG" or opened.mode not in ("RGB", "L") or 0 in opened.size:  # no pixels: decode_image says
        opened.close()
        return None
    return opened


def _upright_size(image: PIL.Image.Image) -> tuple[int, int]:
    """(height, width) of `image` once turned upright by its EXIF orientation."""
    width, height = image.size
    if image.getexif().get(_EXIF_ORIENTATION, 1) in _TRANSPOSING_ORIENTATIONS:
        return width, height
    return height, width


def draft_scale(crop_height: int, crop_width: int, output_size: tuple[int, int]) -> int:
    """The largest JPEG reduction (8, 4, 2, else 1) that keeps a crop at or above `output_size` in both directions.

    Decoding at 1/`scale` then never makes the crop smaller than the output, so the resize still only shrinks.
    """
    for factor in DRAFT_SCALES:
        if crop_height >= factor * output_size[0] and crop_width >= factor * output_size[1]:
            return factor
    return 1


def decode_jpeg_crop(
    jpeg: PIL.Image.Image,
    box: tuple[int, int, int, int],
    output_size: tuple[int, int],
    resample: Any = "bilinear",
) -> torch.Tensor | None:
    """Decode a lazily opened RGB or grey JPEG and return its upright crop `box` resized to `output_size`.

    `box` is `(top, left, height, width)` in the upright full-size image. Returns a uint8 `[C, H, W]` tensor (C = 3,
    or 1 for grey), or None when the JPEG cannot be decoded (the caller's full decode then raises the real error).

    With a reduction `draft_scale(...) > 1`, libjpeg decodes at that scale (each pixel is the scaled IDCT of its
    block, the average of the block's full-size pixels up to JPEG's rounding) and PIL resizes the box divided by the
    scale (fractional, so the crop's geometry is kept) with its antialiased filter: within a few grey levels of
    resizing the full-size crop (tests/test_data.py states the bound). Without one, the pixels are exactly the
    processor's: its uint8 `resize_images` of the full-size crop.
    """
    top, left, height, width = box
    factor = draft_scale(height, width, output_size)
    full_height, full_width = _upright_size(jpeg)
    orientation = jpeg.getexif().get(_EXIF_ORIENTATION, 1)
    try:
        if factor > 1:
            stored_width = jpeg.size[0]
            drafted = jpeg.draft(jpeg.mode, (stored_width // factor, jpeg.size[1] // factor))
            factor = 1 if drafted is None else round(stored_width / drafted[1][2])  # the scale PIL chose
        jpeg.load()
    except (OSError, ValueError):  # truncated or corrupt: the processor's path raises with the file's name
        return None
    upright = exif_transpose(jpeg)
    if upright.size == (full_width, full_height):  # decoded at full size: the processor's crop and resize
        pixels = _to_chw(upright.crop((left, top, left + width, top + height)))
        return resize_images(pixels[None], output_size, resample)[0]
    if orientation == 1:  # reduced pixel i covers the full-size pixels [i * factor, (i + 1) * factor)
        x_scale = y_scale = 1 / factor
    else:  # turned upright after decoding: the image's far edge may hold the partial block
        x_scale, y_scale = upright.size[0] / full_width, upright.size[1] / full_height
    x0, y0, x1, y1 = left * x_scale, top * y_scale, (left + width) * x_scale, (top + height) * y_scale
    # Cut first, so that the filter sees no pixels outside the crop (as when resizing the full-size crop), then
    # resize the exact fractional box inside the whole reduced pixels that cover it.
    outer = (math.floor(x0), math.floor(y0), min(math.ceil(x1), upright.size[0]), min(math.ceil(y1), upright.size[1]))
    resized = upright.crop(outer).resize(
        (output_size[1], output_size[0]),
        PIL.Image.Resampling(int(to_resampling(resample))),
        box=(x0 - outer[0], y0 - outer[1], x1 - outer[0], y1 - outer[1]),
    )
    return _to_chw(resized)


def _to_chw(image: PIL.Image.Image) -> torch.Tensor:
    """A uint8 `[C, H, W]` view of a writable copy of an RGB or grey PIL image's pixels (channels-last in memory)."""
    array = np.array(image)
    return torch.from_numpy(array[..., None] if array.ndim == 2 else array).permute(2, 0, 1)


def random_resized_crop_box(
    height: int,
    width: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> tuple[int, int, int, int]:
    """Inception-style crop `(top, left, crop_height, crop_width)` of a `height` x `width` image (as torchvision's)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * torch.empty(()).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = math.exp(torch.empty(()).uniform_(log_ratio[0], log_ratio[1], generator=generator).item())
        crop_width = round(math.sqrt(target_area * aspect))
        crop_height = round(math.sqrt(target_area / aspect))
        if 0 < crop_width <= width and 0 < crop_height <= height:
            top = int(torch.randint(0, height - crop_height + 1, (), generator=generator))
            left = int(torch.randint(0, width - crop_width + 1, (), generator=generator))
            return top, left, crop_height, crop_width
    # Fallback: the largest central crop whose aspect ratio is within `ratio`.
    if width / height < ratio[0]:
        crop_width, crop_height = width, round(width / ratio[0])
    elif width / height > ratio[1]:
        crop_width, crop_height = round(height * ratio[1]), height
    else:
        crop_width, crop_height = width, height
    return (height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width


def _with_labels(pixel_values: torch.Tensor, batch: Mapping[str, Sequence[Any]]) -> dict[str, torch.Tensor]:
    output = {"pixel_values": pixel_values.to(torch.float32)}
    if "label" in batch:
        labels = np.asarray(batch["label"])
        # class ids, or multi-hot float vectors for multi-label classification
        output["labels"] = torch.as_tensor(labels, dtype=torch.float32 if labels.ndim == 2 else torch.long)
    return output


@contextlib.contextmanager
def unhashable_transform_allowed() -> Iterator[None]:
    """Quiets datasets' "couldn't be hashed properly" warning: a lazy `with_transform` caches nothing, so the random
    fingerprint it warns about changes nothing for the user, who saw it in every run."""
    fingerprint = logging.getLogger("datasets.fingerprint")
    level = fingerprint.level
    fingerprint.setLevel(logging.ERROR)
    try:
        yield
    finally:
        fingerprint.setLevel(level)


def apply_transforms(
    ds: DatasetDict | IterableDatasetDict,
    train_transform: Transform,
    eval_transform: Transform,
    *,
    train_split: str = "train",
    stream_batch_size: int = 32,
) -> DatasetDict | IterableDatasetDict:
    """Return `ds` with `train_transform` on `train_split` and `eval_transform` on the other splits.

    In-memory splits get the transform lazily with `with_transform`; streamed splits with
    `map(batched=True, batch_size=stream_batch_size)`. Images reach the transforms undecoded, so a corrupt image
    raises `CorruptImageError` with its file name.
    """
    transformed = {}
    for split, data in ds.items():
        transform = train_transform if split == train_split else eval_transform
        if isinstance(data, IterableDataset):
            columns = data.column_names or ["image", "label"]
            data = data.decode(False)
            data = data.map(transform, batched=True, batch_size=stream_batch_size, remove_columns=columns)
        else:
            with unhashable_transform_allowed():
                data = data.cast_column("image", datasets.Image(decode=False)).with_transform(transform)
        transformed[split] = data
    return type(ds)(transformed)


def rows_and_transform(data: Dataset) -> tuple[Dataset, Transform]:
    """An in-memory split of `apply_transforms` as its raw rows (images undecoded) and its transform, for a caller
    that applies the transform itself (to give it arguments of its own, e.g. a batch's number of patches)."""
    return data.with_format(None), data.format["format_kwargs"]["transform"]


def collate_fn(
    examples: Sequence[Mapping[str, Any]],
    packed_sequence_length: int | None = None,
    packed_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """Stack transformed examples into a batch: `pixel_values` [N, 3, H, W] and, when present, `labels` [N] (class
    ids) or [N, C] (multi-hot). Native-aspect examples (with `spatial_shapes`) are flattened patches [K_i, P*P*C]:
    they are padded to the longest with zeros, and `pixel_attention_mask` [N, K] marks each one's own patches; with
    `packed_sequence_length`, they are packed whole into rows of that many patch slots instead (the image processor's
    `pack_patches`: `pixel_values` [rows, L, P*P*C], `patch_image_index` [rows, L]), the labels still one per image.

    Examples that carry their row (`PACKED_ROW`, from a planned batch: `packed_batches.PackedBatchSampler`) go into
    that row, and with `packed_rows` the batch is padded with empty rows (all padding, `patch_image_index` -1) to
    exactly that many: every such batch is `[packed_rows, L]`. Others are packed largest first
    (`first_fit_decreasing`), into as many rows as they need."""
    if "spatial_shapes" in examples[0]:
        native = [{key: torch.as_tensor(value) for key, value in example.items()} for example in examples]
        if packed_sequence_length is None:
            batch = _pad_native(native)
        else:
            batch = _pack_native(native, packed_sequence_length, packed_rows)
    else:
        if packed_sequence_length is not None:
            raise ValueError("`packed_sequence_length` packs native-aspect examples (with `spatial_shapes`).")
        batch = {"pixel_values": torch.stack([torch.as_tensor(example["pixel_values"]) for example in examples])}
    if "labels" in examples[0]:
        labels = [torch.as_tensor(example["labels"]) for example in examples]
        batch["labels"] = torch.stack(labels) if labels[0].ndim else torch.stack(labels).long()
    return batch


def _pack_native(
    examples: Sequence[Mapping[str, torch.Tensor]], packed_sequence_length: int, packed_rows: int | None = None
) -> dict:
    """Native-aspect examples (patches, grid; the places kept after token dropping) packed by the image processor's
    `pack_patches`: into the rows they carry (`PACKED_ROW`), padded to `packed_rows`, or largest first."""
    grids = [tuple(example["spatial_shapes"].tolist()) for example in examples]
    positions = None
    if "patch_positions" in examples[0]:  # token dropping: only the kept patches, with their places
        positions = [example["patch_positions"][example["patch_positions"] >= 0] for example in examples]
        counts = [len(kept) for kept in positions]
    else:
        counts = [rows * cols for rows, cols in grids]
    patches = [example["pixel_values"][:count].float() for example, count in zip(examples, counts)]
    rows = None
    if PACKED_ROW in examples[0]:
        planned = [int(example[PACKED_ROW]) for example in examples]
        total = max(planned) + 1 if packed_rows is None else packed_rows
        if max(planned) >= total:
            raise ValueError(f"Examples planned in rows up to {max(planned)}, but the batch has {total} rows.")
        rows = [[index for index, row in enumerate(planned) if row == number] for number in range(total)]
    packed = pack_patches(patches, grids, packed_sequence_length, positions, rows)
    # `spatial_shapes` first: Trainer counts a batch's examples by its first tensor, which is one row per image.
    return {"spatial_shapes": packed.pop("spatial_shapes"), **packed}


def pack_native_batch(batch: Mapping[str, torch.Tensor], packed_sequence_length: int) -> dict[str, torch.Tensor]:
    """A padded native-aspect batch (`pixel_values` [N, K, P*P*C], `spatial_shapes`; what `collate_fn` or the
    evaluation transform gives) packed into rows of `packed_sequence_length` slots, as `collate_fn` packs; any
    other entries (`labels`) kept."""
    examples = [
        {"pixel_values": values, "spatial_shapes": grid}
        for values, grid in zip(batch["pixel_values"], batch["spatial_shapes"])
    ]
    others = {key: value for key, value in batch.items() if key not in ("pixel_values", "pixel_attention_mask")}
    return {**others, **_pack_native(examples, packed_sequence_length)}


def _pad_native(examples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Native-aspect examples padded to the longest: each one's patches (its grid's rows * cols) first, then zeros."""
    if "patch_positions" in examples[0]:
        raise ValueError(
            "Examples with dropped patches (`patch_positions`) are packed: give `packed_sequence_length`."
        )
    length = max(len(example["pixel_values"]) for example in examples)
    pixel_values, masks = [], []
    for example in examples:
        patches, (rows, cols) = example["pixel_values"], example["spatial_shapes"].tolist()
        pixel_values.append(F.pad(patches[: rows * cols].float(), (0, 0, 0, length - rows * cols)))
        masks.append((torch.arange(length) < rows * cols).int())
    return {
        "pixel_values": torch.stack(pixel_values),
        "pixel_attention_mask": torch.stack(masks),
        "spatial_shapes": torch.stack([example["spatial_shapes"].long() for example in examples]),
    }


def check_image_channels(raw, processor: VisionTransformerImageProcessor, num_channels: int, source: str) -> None:
    """Refuse, before training, a model whose channels (`num_channels`, from `source`: "--num_channels" or the
    checkpoint's name) are not those of the data's images as the processor reads them (a 3-channel model converts
    every image to RGB; others take the images' own channels). One image is decoded: the first of the validation
    split (a stream's is not shuffled)."""
    if processor.do_convert_rgb:
        return
    split = raw.get("validation") or raw["train"]
    first = next(iter(split), None)
    if first is None:
        return
    (pixels,) = load_images(decode_image(first["image"]), do_convert_rgb=False)
    found = pixels.shape[0]
    if found != num_channels:
        names = {1: "grey (1 channel)", 2: "grey with alpha (2 channels)", 3: "RGB (3 channels)", 4: "4 channels"}
        fix = (
            f"Pass --num_channels {found}" + ("." if found == 3 else " (or 3, which converts every image to RGB).")
            if source == "--num_channels"
            else f"Start from a checkpoint of {found} channels (or 3), or convert the images."
        )
        raise ValueError(
            f"{source} {num_channels}: the model takes {num_channels} channel(s), but the data set's images are "
            f"{names.get(found, f'{found} channels')}. {fix}"
        )
