"""The geometry of the one pixel path: the size an image is resized to (once, straight to its output size), the
resize itself (antialiased like PIL) and the centre crop.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.image_utils import PILImageResampling, SizeDict

_RESAMPLE_TO_MODE = {
    PILImageResampling.NEAREST: "nearest-exact",  # PIL samples the nearest pixel centre, like "nearest-exact"
    PILImageResampling.BILINEAR: "bilinear",
    PILImageResampling.BICUBIC: "bicubic",
}
_RESAMPLE_NAMES = {name: PILImageResampling[name.upper()] for name in ("nearest", "bilinear", "bicubic")}


def to_resampling(resample: PILImageResampling | int | str) -> PILImageResampling:
    """Return the `PILImageResampling` for `resample` given as a PIL constant, its int value or its lowercase name."""
    value = _RESAMPLE_NAMES.get(resample.lower()) if isinstance(resample, str) else resample
    if value in _RESAMPLE_TO_MODE:
        return PILImageResampling(value)
    raise ValueError(f"Unsupported resample {resample!r}: use one of 'nearest', 'bilinear' or 'bicubic' (0, 2, 3).")


def resize_images(
    images: torch.Tensor, size: tuple[int, int], resample: PILImageResampling | int | str = "bilinear"
) -> torch.Tensor:
    """Resize a `[N, C, H, W]` batch to `size=(height, width)` like `PIL.Image.resize` (bilinear and bicubic
    antialiased, with PIL's kernels), keeping its dtype: uint8 batches are rounded like PIL's output."""
    if images.ndim != 4:
        raise ValueError(f"resize_images expects a [N, C, H, W] batch, got shape {tuple(images.shape)}.")
    if images.dtype != torch.uint8 and not images.is_floating_point():
        raise TypeError(f"resize_images expects a uint8 or floating point batch, got {images.dtype}.")
    size = (int(size[0]), int(size[1]))
    if tuple(images.shape[-2:]) == size:
        return images
    mode = _RESAMPLE_TO_MODE[to_resampling(resample)]
    # PIL's bilinear and bicubic filters widen when downscaling, which is what torch calls antialiasing.
    options = {} if mode == "nearest-exact" else {"antialias": True, "align_corners": False}
    if images.dtype == torch.uint8 and _has_uint8_kernel(images.device):
        images = images.contiguous(memory_format=torch.channels_last)
        return F.interpolate(images, size=size, mode=mode, **options)
    if images.dtype == torch.uint8:
        resized = F.interpolate(images.float(), size=size, mode=mode, **options)
        # Rounding to integers like PIL halves the mean difference to it; clamping catches bicubic overshoot.
        return resized.round_().clamp_(0, 255).to(torch.uint8)
    return F.interpolate(images, size=size, mode=mode, **options)


def _has_uint8_kernel(device: torch.device) -> bool:
    # torch's uint8 antialiased kernels exist only on CPU; they port Pillow-SIMD, so they are much faster than
    # resizing in float and round exactly like PIL.
    return device.type == "cpu"


def center_crop_images(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Crop the centre `size=(height, width)` of `[..., H, W]` images, zero-padding images smaller than `size`, with
    the offsets and padding of transformers' `image_transforms.center_crop`."""
    crop_height, crop_width = int(size[0]), int(size[1])
    pad_height = max(crop_height - images.shape[-2], 0)
    pad_width = max(crop_width - images.shape[-1], 0)
    if pad_height or pad_width:
        padding = ((pad_width + 1) // 2, pad_width // 2, (pad_height + 1) // 2, pad_height // 2)
        images = F.pad(images, padding)
    top = (images.shape[-2] - crop_height) // 2
    left = (images.shape[-1] - crop_width) // 2
    return images[..., top : top + crop_height, left : left + crop_width]


def size_dict(
    size: int | Sequence[int] | Mapping[str, int] | SizeDict, name: str, shortest_edge: bool = False
) -> dict[str, int]:
    """Return `size` given as an int (square), `(height, width)` or `{"height", "width"}` as a plain dict; with
    `shortest_edge`, also `{"shortest_edge": N}` (the shorter side resized to N, the aspect ratio kept)."""
    if isinstance(size, SizeDict):
        size = {key: value for key, value in dict(size).items() if value is not None}
    if isinstance(size, int) and not isinstance(size, bool):
        result = {"height": size, "width": size}
    elif isinstance(size, Mapping) and set(size) == {"height", "width"}:
        result = {"height": int(size["height"]), "width": int(size["width"])}
    elif isinstance(size, Mapping) and shortest_edge and set(size) == {"shortest_edge"}:
        result = {"shortest_edge": int(size["shortest_edge"])}
    elif isinstance(size, Sequence) and not isinstance(size, str) and len(size) == 2:
        result = {"height": int(size[0]), "width": int(size[1])}
    else:
        forms = "an int, a (height, width) pair or a dict with 'height' and 'width'"
        if shortest_edge:
            forms += ", or {'shortest_edge': N} (the shorter side, keeping the aspect ratio)"
        raise ValueError(f"`{name}` must be {forms}, got {size!r}.")
    if min(result.values()) <= 0:
        raise ValueError(f"`{name}` must be positive sizes in pixels, got {size!r}.")
    return result


def resize_target(height: int, width: int, size: Mapping[str, int]) -> tuple[int, int]:
    """The `(height, width)` a `height` x `width` image is resized to: `size`'s height and width, or its shorter side
    made `size["shortest_edge"]` and its longer side scaled by the same factor, rounded down (as transformers'
    `get_resize_output_image_size(..., default_to_square=False)` and torchvision's `Resize(int)`)."""
    if "shortest_edge" not in size:
        return int(size["height"]), int(size["width"])
    short, long = (width, height) if width <= height else (height, width)
    new_short = int(size["shortest_edge"])
    new_long = int(new_short * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def output_size(size: Mapping[str, int], crop_size: Mapping[str, int], do_center_crop: bool) -> tuple[int, int] | None:
    """The fixed `(height, width)` of every processed image: the crop's, else the resize's; None when the images
    keep their own aspect ratio (a shorter-side resize without a crop)."""
    if do_center_crop:
        return int(crop_size["height"]), int(crop_size["width"])
    if "shortest_edge" in size:
        return None
    return int(size["height"]), int(size["width"])


def scaled_geometry(
    size: Mapping[str, int], crop_size: Mapping[str, int], do_center_crop: bool, target: tuple[int, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """`(size, crop_size)` that make `target` `(height, width)` images with the same geometry: the crop becomes
    `target` and the resize before it keeps its ratio to the crop (DINOv2's 256 -> 224 crop at 448 becomes 512 ->
    448, as timm's `crop_pct` does); without a crop the resize becomes `target`. A shorter-side resize then a crop
    scales its shorter side by the crop's larger side, so that a square image covers the crop."""
    height, width = int(target[0]), int(target[1])
    if not do_center_crop:
        if "shortest_edge" in size:
            raise ValueError(
                f"size={dict(size)} without do_center_crop keeps each image's aspect ratio, so the images have no "
                f"one size to make {height}x{width}: set do_center_crop with crop_size, or size to a height and width."
            )
        return {"height": height, "width": width}, dict(crop_size)
    crop_height, crop_width = int(crop_size["height"]), int(crop_size["width"])
    if "shortest_edge" in size:
        side = max(height, width) * int(size["shortest_edge"]) / max(crop_height, crop_width)
        return {"shortest_edge": round(side)}, {"height": height, "width": width}
    resized = {
        "height": round(height * int(size["height"]) / crop_height),
        "width": round(width * int(size["width"]) / crop_width),
    }
    return resized, {"height": height, "width": width}


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def grid_for_max_patches(height: int, width: int, patch_size: int, max_num_patches: int) -> tuple[int, int]:
    """The `(rows, cols)` grid a `height` x `width` image is resized to: the largest grid of at most
    `max_num_patches` patches among those of the image scaled by one factor (each side rounded up to whole patches,
    at least one patch a side), as transformers' SigLIP 2 processor chooses it.

    The grid only changes where a side crosses a whole number of patches, so the largest one is at such a point:
    `rows = k` (and `cols = ceil(k * width / height)`) or `cols = k`; both families grow with `k` and are searched in
    exact integer arithmetic."""
    for name, value in dict(
        height=height, width=width, patch_size=patch_size, max_num_patches=max_num_patches
    ).items():
        check_positive_int(name, value)
    best = (1, 1)  # the grids with k rows, then those with k columns:
    for grid_of in (lambda k: (k, max(1, -(-k * width // height))), lambda k: (max(1, -(-k * height // width)), k)):
        low, high = 1, max_num_patches  # the largest k whose grid fits: grid_of(1) may not (then none does)
        while low < high:
            middle = (low + high + 1) // 2
            rows, cols = grid_of(middle)
            low, high = (middle, high) if rows * cols <= max_num_patches else (low, middle - 1)
        rows, cols = grid_of(low)
        if rows * cols <= max_num_patches and rows * cols > best[0] * best[1]:
            best = (rows, cols)
    return best
