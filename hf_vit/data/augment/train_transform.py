"""The training transform: the eval pixel path (`hf_vit.data.transforms`) with the training augmentation on top —
random resized crop (a JPEG decoded at a reduced scale where the crop allows), horizontal flip, RandAugment, random
erasing and NaViT's token dropping. Only training imports it: serving never loads the augmentations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import PIL.Image
import torch

from ...model.image_geometry import output_size as fixed_output_size
from ...model.image_geometry import resize_target
from ...model.image_processing_vit import (
    VisionTransformerImageProcessor,
    center_crop_images,
    exif_transpose,
    grid_for_max_patches,
    load_images,
    native_patch_batch,
    resize_images,
    to_resampling,
)
from ..transforms import Transform, decode_image, local_encoded, with_labels
from .rand_augment import RandAugment
from .random_erasing import RandomErasing, check_random_erasing

_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
DRAFT_SCALES = (8, 4, 2)
"""The JPEG reductions the training transform decodes at (libjpeg's scaled IDCT), largest first."""


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
    """Batch transform for training, per image in this order: an Inception-style random resized crop (a random
    fraction `scale` of the area at an aspect ratio log-uniform in `ratio`; a central crop after 10 failed draws) of
    the image as `processor` loads it, resized by the processor's `resize_images` to its output size (encoded RGB and
    grey JPEGs: `decode_jpeg_crop`); without `random_resized_crop`, the processor's own resize and centre crop (so with
    `hflip=False` the output equals `processor(images)`); the flip (probability 1/2); RandAugment (`rand_augment`, on
    the uint8 image); the processor's `normalize_batch`; random erasing (`reprob`, `remode`, `recount`), within a
    native-aspect image's own size; NaViT's token dropping (`token_drop_rate`: `drop_tokens`). With `seed`, it draws
    from its own generator; otherwise, and always in DataLoader workers, from torch's global one (seeded per worker
    and epoch)."""
    if not (0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1]):
        raise ValueError(f"Need 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], got {scale}, {ratio}.")
    if not hasattr(processor, "normalize_batch"):
        raise TypeError(
            f"make_train_transform needs a VisionTransformerImageProcessor (it reuses its pixel path), got "
            f"{type(processor).__name__}."
        )
    output_size = fixed_output_size(processor.size, processor.crop_size, processor.do_center_crop)
    if output_size is None and processor.max_num_patches is None:
        raise ValueError(
            f"The processor's size={processor.size} without do_center_crop keeps each image's aspect ratio, so "
            "training crops have no one size to be resized to: set do_center_crop with crop_size, or size to a "
            "height and width."
        )
    augment_more = None
    if rand_augment:  # the areas it uncovers filled with the processor's mean colour
        fill = tuple(round(255 * float(m)) for m in processor.image_mean)
        augment_more = RandAugment(rand_augment, fill=fill, resample=processor.resample)
    check_random_erasing(reprob, remode, recount)
    if token_drop_rate and (processor.max_num_patches is None or not 0 <= token_drop_rate < 1):
        raise ValueError(
            f"token_drop_rate {token_drop_rate} drops patches of native-aspect images (a processor with "
            "max_num_patches), a share in [0, 1)."
        )
    if reprob and not processor.do_normalize:
        raise ValueError(
            "--reprob fills the erased rectangles with the noise of normalised pixels (mean 0, std 1), but the "
            "processor does not normalise (do_normalize=False): normalise, or drop --reprob."
        )
    erasing = RandomErasing(reprob, remode, recount) if reprob else None
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    steps = (random_resized_crop, hflip, augment_more, erasing, token_drop_rate, generator)
    return _TrainTransform(processor, output_size, scale, ratio, *steps)


@dataclasses.dataclass
class _TrainTransform:
    """`make_train_transform`'s transform: its settings, checked, and the steps it takes per image and per batch."""

    processor: VisionTransformerImageProcessor
    output_size: tuple[int, int] | None
    scale: tuple[float, float]
    ratio: tuple[float, float]
    random_resized_crop: bool
    hflip: bool
    rand_augment: RandAugment | None
    erasing: RandomErasing | None
    token_drop_rate: float
    generator: torch.Generator | None

    def size_for(self, height: int, width: int, budget: int) -> tuple[int, int]:
        """The size a crop (or image) of `height` x `width` is resized to: the processor's, or with `max_num_patches`
        the largest grid of at most `budget` patches at the crop's own aspect ratio."""
        if self.processor.max_num_patches is None:
            return self.output_size
        patch = self.processor.patch_size
        rows, cols = grid_for_max_patches(height, width, patch, budget)
        return rows * patch, cols * patch

    def crop_and_resize(self, pixels: torch.Tensor, box: tuple[int, int, int, int] | None, generator, budget: int):
        processor = self.processor
        if self.random_resized_crop:
            # Cropping the uint8 image first means only the crop is resized.
            top, left, height, width = box or random_resized_crop_box(
                *pixels.shape[1:], self.scale, self.ratio, generator
            )
            size = self.size_for(height, width, budget)
            return resize_images(pixels[None, :, top : top + height, left : left + width], size, processor.resample)[0]
        if processor.do_resize:
            height, width = pixels.shape[1:]
            if processor.max_num_patches is None:
                target = resize_target(height, width, processor.size)
            else:
                target = self.size_for(height, width, budget)
            pixels = resize_images(pixels[None], target, processor.resample)[0]
        if processor.do_center_crop:
            crop_size = (int(processor.crop_size["height"]), int(processor.crop_size["width"]))
            pixels = center_crop_images(pixels, crop_size)
        return pixels

    def augment(self, image: Any, index: int, generator: torch.Generator | None, budget: int) -> torch.Tensor:
        box, pixels, rgb = None, None, self.processor.do_convert_rgb
        # Only RGB output has a fast road: without conversion the processor keeps modes the JPEG decoder would change.
        jpeg = _open_jpeg(image) if self.random_resized_crop and rgb else None
        if jpeg is not None:
            box = random_resized_crop_box(*_upright_size(jpeg), self.scale, self.ratio, generator)
            pixels = decode_jpeg_crop(jpeg, box, self.size_for(box[2], box[3], budget), self.processor.resample)
        if pixels is None:  # not a JPEG, or one the fast road cannot decode: the processor's own path reports it
            (pixels,) = load_images(decode_image(image, index), rgb)
            pixels = self.crop_and_resize(pixels, box, generator, budget)
        if self.hflip and torch.rand((), generator=generator) < 0.5:
            # Flipped as [H, W, C], so that the copy stays channels-last like the resized image.
            pixels = pixels.permute(1, 2, 0).flip(1).permute(2, 0, 1)
        if self.rand_augment is not None:
            pixels = self.rand_augment(pixels, generator)
        return pixels.expand(3, -1, -1) if rgb and pixels.shape[0] == 1 else pixels

    def __call__(self, batch: Mapping[str, Sequence[Any]], max_num_patches: int | None = None) -> dict:
        # `max_num_patches`: this batch's own number of patches per image (drawn per step with --seq_lens), in place
        # of the processor's.
        processor, erasing = self.processor, self.erasing
        budget = max_num_patches or processor.max_num_patches
        generator = self.generator if torch.utils.data.get_worker_info() is None else None
        images = [self.augment(image, i, generator, budget) for i, image in enumerate(batch["image"])]
        if len({image.dtype for image in images}) > 1:  # float images among uint8 ones: stack them all as floats
            images = [image.float() for image in images]
        if processor.max_num_patches is not None:  # images of their own sizes: normalised one by one, as patches
            normalised = [processor.normalize_batch(image[None])[0] for image in images]
            if erasing is not None:
                normalised = [erasing(image, generator) for image in normalised]
            patches = native_patch_batch(normalised, processor.patch_size, budget)
            if self.token_drop_rate:
                patches = drop_tokens(patches, self.token_drop_rate, generator)
            return {**patches, **with_labels(patches["pixel_values"], batch)}
        # Stacked channels-last (the layout PIL and the uint8 resize give), so that normalising converts to float and
        # to channels-first in one pass over the batch.
        stacked = torch.stack([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)
        normalised = processor.normalize_batch(stacked)
        if erasing is not None:
            for image in normalised:
                erasing(image, generator)
        return with_labels(normalised, batch)


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
    found = local_encoded(image)
    if found is None:
        return None
    try:
        opened = PIL.Image.open(found[0])
    except (OSError, ValueError):
        return None  # decode_image names the file and the error
    if opened.format != "JPEG" or opened.mode not in ("RGB", "L") or 0 in opened.size:  # no pixels: decode_image says
        opened.close()
        return None
    return opened


def _upright_size(image: PIL.Image.Image) -> tuple[int, int]:
    """(height, width) of `image` once turned upright by its EXIF orientation."""
    width, height = image.size
    turned = image.getexif().get(_EXIF_ORIENTATION, 1) in _TRANSPOSING_ORIENTATIONS
    return (width, height) if turned else (height, width)


def draft_scale(crop_height: int, crop_width: int, output_size: tuple[int, int]) -> int:
    """The largest JPEG reduction (8, 4, 2, else 1) that keeps a crop at or above `output_size` in both directions
    (so the resize after decoding at that scale still only shrinks)."""
    fits = (f for f in DRAFT_SCALES if crop_height >= f * output_size[0] and crop_width >= f * output_size[1])
    return next(fits, 1)


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
