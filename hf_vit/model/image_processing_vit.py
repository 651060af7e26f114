"""Image processor for the Vision Transformer: turns images into normalised `pixel_values` batches with torch.

The geometry (sizes, resizing, the centre crop, native-aspect grids) is its sibling `image_geometry.py`.
"""

import bisect
import copy
import io
import math
import numbers
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_utils import ChannelDimension, PILImageResampling
from transformers.processing_utils import ImagesKwargs
from transformers.utils import TensorType, logging

from .image_geometry import (
    center_crop_images,
    check_positive_int,
    grid_for_max_patches,
    resize_images,
    resize_target,
    size_dict,
    to_resampling,
)

logger = logging.get_logger(__name__)

_ENCODED_TYPES = (bytes, bytearray, memoryview, str, os.PathLike)
_NUM_CHANNELS = (1, 3, 4)
_EXIF_ORIENTATION = 0x0112


def rescale_and_normalize(
    images: torch.Tensor,
    rescale_factor: float | None = None,
    mean: float | Sequence[float] | None = None,
    std: float | Sequence[float] | None = None,
) -> torch.Tensor:
    """Return `(images * rescale_factor - mean) / std` as a new contiguous float32 `[..., C, H, W]` tensor, as one
    fused multiply-add; a `rescale_factor` of None skips rescaling, a `mean` and `std` of None normalising."""
    images = images.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    num_channels = images.shape[-3]
    scale = torch.full((num_channels,), 1.0 if rescale_factor is None else float(rescale_factor), dtype=torch.float64)
    shift = torch.zeros(num_channels, dtype=torch.float64)
    if (mean is None) != (std is None):
        raise ValueError("Give both `mean` and `std` to normalise, or neither.")
    if mean is not None:
        mean_t, std_t = _mean_std(mean, std, ("mean", "std"), num_channels)
        scale, shift = scale / std_t, -mean_t / std_t
    if rescale_factor is None and mean is None:
        return images
    # The constants are folded in float64, so the only float32 rounding is in the multiply-add itself.
    scale, shift = (value.float().view(num_channels, 1, 1).to(images.device) for value in (scale, shift))
    return torch.addcmul(shift, images, scale, out=images)


def _mean_std(
    mean: float | Sequence[float], std: float | Sequence[float], names: tuple[str, str], channels: int | None = None
) -> list[torch.Tensor]:
    """`mean` and `std` checked (finite, `std` positive) as float64 tensors, with `channels` one value per channel."""
    tensors = []
    for name, value in zip(names, (mean, std)):
        values = torch.as_tensor(value, dtype=torch.float64).flatten()
        if values.numel() == 0 or not bool(torch.isfinite(values).all()):
            raise ValueError(f"`{name}` must be one finite number or one per channel, got {value!r}.")
        if channels is not None and values.numel() not in (1, channels):
            raise ValueError(f"Image {name} has {values.numel()} values but the images have {channels} channels.")
        tensors.append(values if channels is None else values.expand(channels))
    if bool((tensors[1] <= 0).any()):
        raise ValueError(f"`{names[1]}` must be positive (it divides the pixel values), got {std!r}.")
    return tensors


def _checked_options(o: dict[str, Any]) -> dict[str, Any]:
    """The processor's options `o` checked and normalised: sizes as dicts, `resample` as a filter, floats."""
    checked = {"size": size_dict(o["size"], "size", shortest_edge=True), "resample": to_resampling(o["resample"])}
    checked["crop_size"] = size_dict(o["crop_size"], "crop_size")
    rescale_factor = o["rescale_factor"]
    if isinstance(rescale_factor, bool) or not isinstance(rescale_factor, numbers.Real):
        raise ValueError(f"`rescale_factor` must be a number, got {rescale_factor!r}.")
    if not (math.isfinite(rescale_factor) and rescale_factor > 0):
        raise ValueError(f"`rescale_factor` must be a positive finite number, got {rescale_factor!r}.")
    _mean_std(o["image_mean"], o["image_std"], ("image_mean", "image_std"))
    native, packed = o["max_num_patches"], o["packed_sequence_length"]
    if native is not None:
        check_positive_int("max_num_patches", native)
        check_positive_int("patch_size", o["patch_size"])
        if o["do_center_crop"]:
            raise ValueError(
                "`max_num_patches` keeps each image whole at its own aspect ratio, which a centre crop to `crop_size` "
                "would undo: pass do_center_crop=False with it."
            )
    if packed is not None:
        check_positive_int("packed_sequence_length", packed)
        if native is None:
            raise ValueError(
                "`packed_sequence_length` packs images on their native-aspect grids: give `max_num_patches` (the "
                "most patches of one image) with it."
            )
        if packed < native:
            raise ValueError(
                f"`packed_sequence_length` ({packed}) must be at least `max_num_patches` ({native}): a row must hold "
                "the largest image."
            )
    for name in ("image_mean", "image_std"):
        checked[name] = float(o[name]) if isinstance(o[name], numbers.Real) else [float(v) for v in o[name]]
    return {**o, **checked, "rescale_factor": float(o["rescale_factor"])}


def open_image(source: bytes | bytearray | memoryview | str | os.PathLike) -> PIL.Image.Image:
    """Decode an encoded image given as bytes or as a path to a file, applying its EXIF orientation."""
    if isinstance(source, bytes | bytearray | memoryview):
        data, what = bytes(source), f"The given bytes ({len(source)} bytes) are"
    elif str(source).startswith(("http://", "https://")):
        raise ValueError(f"URLs are not supported ({source}): download the image and pass its bytes or its path.")
    else:
        with open(source, "rb") as file:  # missing/unreadable files raise their usual OSError here
            data, what = file.read(), f"The file {os.fspath(source)!r} is"
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()  # decode now, so truncated data fails here with a clear message
    except (PIL.UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{what} not a valid image file that PIL can decode: {err}") from err
    return exif_transpose(image)


def exif_transpose(image: PIL.Image.Image) -> PIL.Image.Image:
    """Return `image` turned upright by its EXIF orientation tag (the image itself when it has none), as every viewer
    shows it; transposing removes the tag, so applying it twice is harmless."""
    if image.getexif().get(_EXIF_ORIENTATION, 1) == 1:
        return image  # PIL's exif_transpose would copy the pixels even then
    return PIL.ImageOps.exif_transpose(image)


def sixteen_to_eight_bit(values: np.ndarray) -> np.ndarray:
    """Map 16-bit values 0..65535 to uint8 0..255 by rounding `value / 257`: an 8-bit image stored as 16 bits
    (`value * 257`) maps back to itself, and 16-bit files get the brightness of their 8-bit versions."""
    return ((values.astype(np.uint32) + 128) // 257).astype(np.uint8)  # integer round(value / 257), never a tie


def _pil_to_array(image: PIL.Image.Image, do_convert_rgb: bool, index: int) -> np.ndarray:
    """The pixels of a PIL image as an `[H, W, C]` array; RGB (or 1-channel grey) if `do_convert_rgb` (16-bit and
    float grey images either way)."""
    if image.mode == "I" or image.mode.startswith("I;16"):
        # 16-bit data, which PIL's own conversion clips at 255 (turning nearly every pixel white); mode "I" (32-bit
        # integers) is what PIL gives 16-bit grey files (older PNG readers, TIFF) and `convert("I")` of them.
        values = np.asarray(image)
        if values.size and (values.min() < 0 or values.max() > 65535):
            raise ValueError(
                f"Image {index} is a PIL image in mode 'I' with values in [{values.min()}, {values.max()}]: 32-bit "
                "integer images are read as 16-bit data (0..65535, scaled by 1/257). Rescale it to 0..65535, or "
                "convert it to 'L' or 'RGB' yourself."
            )
        return sixteen_to_eight_bit(values)[..., None]
    if image.mode == "F":
        return np.asarray(image, dtype=np.float32)[..., None]  # float values are kept (checked finite) like arrays
    if not do_convert_rgb:
        return np.array(image)
    if image.mode == "L":
        return np.array(image)[..., None]  # grey is expanded to RGB after resizing, which is 3x cheaper
    if any(band in ("A", "a") for band in image.getbands()) or image.info.get("transparency") is not None:
        # Composite transparency onto white, like transformers' `convert_to_rgb`: hidden pixels often hold garbage.
        background = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
        return np.array(PIL.Image.alpha_composite(background, image.convert("RGBA")).convert("RGB"))
    return np.array(image if image.mode == "RGB" else image.convert("RGB"))


def _to_tensor(array: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Wrap an array as a tensor without copying when possible; 16-bit (uint16) data is scaled to uint8."""
    dtype = array.dtype
    if dtype in (bool, torch.bool) or not isinstance(dtype, torch.dtype) and not np.issubdtype(dtype, np.number):
        raise TypeError(f"Unsupported image dtype {dtype}: use uint8 (0-255) or float pixel values.")
    if isinstance(array, np.ndarray):
        if dtype == np.uint16:
            array = sixteen_to_eight_bit(array)
        if not (array.flags.writeable and array.dtype.isnative and all(s >= 0 for s in array.strides)):
            array = np.array(array, dtype=array.dtype.newbyteorder("="))  # layouts torch.from_numpy rejects
        tensor = torch.from_numpy(array)
    else:
        tensor = array.detach()
        if tensor.dtype == torch.uint16:
            tensor = torch.from_numpy(sixteen_to_eight_bit(tensor.cpu().to(torch.int32).numpy())).to(tensor.device)
    if tensor.is_complex():
        raise TypeError(f"Unsupported image dtype {dtype}: use uint8 (0-255) or float pixel values.")
    return tensor


def _check_values(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """Return one `[C, H, W]` image as uint8 or float32, refusing values that would silently give wrong pixels."""
    if 0 in tensor.shape:
        height, width = tensor.shape[-2:]
        raise ValueError(f"Image {index} is empty ({width}x{height} pixels, {tensor.shape[0]} channels): remove it.")
    if tensor.dtype == torch.uint8:
        return tensor
    if not tensor.is_floating_point() and tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high > 255:
            raise ValueError(
                f"Image {index} is a {tensor.dtype} array with values in [{low}, {high}]: integer images must hold "
                "0..255 (or be uint16, which is read as 16-bit data and scaled by 1/257). Cast 16-bit data to "
                "uint16, or pass floats (with do_rescale=False if they are already in [0, 1])."
            )
        return tensor.to(torch.uint8)
    tensor = tensor.to(torch.float32)
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(
            f"Image {index} contains NaN or infinite values: replace them (e.g. with numpy.nan_to_num) before "
            "processing."
        )
    return tensor


def load_images(
    images: Any, do_convert_rgb: bool = True, input_data_format: str | ChannelDimension | None = None
) -> list[torch.Tensor]:
    """Decode and convert `images` into a flat list of `[C, H, W]` uint8 or float32 tensors: the first step of the
    one pixel path, for training transforms too. With `do_convert_rgb`, images come back with 3 channels, or 1 for
    grey (expand it after resizing, which is cheaper). Error messages number the images in the flattened order."""
    tensors = []
    pending = [images]
    while pending:
        image = pending.pop()
        if isinstance(image, list | tuple):
            pending.extend(reversed(image))
            continue
        if isinstance(image, _ENCODED_TYPES):
            image = open_image(image)
        layout = input_data_format
        if isinstance(image, PIL.Image.Image):  # as an [H, W, C] array, RGB already with `do_convert_rgb`
            image, layout = _pil_to_array(exif_transpose(image), do_convert_rgb, len(tensors)), "channels_last"
        if not isinstance(image, np.ndarray | torch.Tensor):
            raise TypeError(
                f"Unsupported image type {type(image).__name__}: expected a PIL image, a numpy array, a torch "
                "tensor, the bytes of an image file, a path to an image file, or a list of these."
            )
        tensor = _channels_first(_to_tensor(image), layout)
        for one in tensor.unbind(0) if tensor.ndim == 4 else [tensor]:
            one = _check_values(one, len(tensors))
            tensors.append(_composite_on_white(one) if do_convert_rgb and one.shape[0] == 4 else one)
    if not tensors:
        raise ValueError("No images to process: got an empty list or batch. Pass at least one image.")
    return tensors


def _channels_first(tensor: torch.Tensor, input_data_format: str | ChannelDimension | None) -> torch.Tensor:
    """Return a `[C, H, W]` or `[N, C, H, W]` view of a 2-D, 3-D or 4-D image tensor."""
    shape = tuple(tensor.shape)
    if tensor.ndim == 2:
        return tensor[None]
    if tensor.ndim not in (3, 4):
        raise ValueError(
            f"Expected an image with 2 (H, W), 3 (C, H, W or H, W, C) or 4 (N, C, H, W or N, H, W, C) dimensions, "
            f"got an array of shape {shape}."
        )
    first, last = shape[-3], shape[-1]
    if input_data_format is not None:
        channels_last = ChannelDimension(input_data_format) == ChannelDimension.LAST
    elif first in _NUM_CHANNELS:
        channels_last = False
        if last in _NUM_CHANNELS:
            logger.warning_once(f"Ambiguous channel dimension in image shape {shape}: assuming channels first.")
    else:
        channels_last = last in _NUM_CHANNELS
    tensor = tensor.movedim(-1, -3) if channels_last else tensor
    if tensor.shape[-3] not in _NUM_CHANNELS:
        raise ValueError(
            f"Images must have 1, 3 or 4 channels in their first or last dimension, got shape {shape}. "
            "Pass input_data_format='channels_first' or 'channels_last' if the layout is ambiguous."
        )
    return tensor


def _stack_channels_last(images: list[torch.Tensor]) -> torch.Tensor:
    """Same-shape `[C, H, W]` images as an `[N, C, H, W]` batch stored channels-last (what PIL gives)."""
    hwc = [image.movedim(0, -1) for image in images]
    if hwc[0].device.type == "cpu":
        # numpy backs large buffers with huge pages while torch takes a page fault per 4 KiB: on 32 photos
        # torch.stack measured 2-20x slower than np.stack.
        return torch.from_numpy(np.stack([image.numpy() for image in hwc])).movedim(-1, 1)
    return torch.stack(hwc).movedim(-1, 1)


def _composite_on_white(images: torch.Tensor) -> torch.Tensor:
    """Blend `[..., 4, H, W]` RGBA images onto a white background, as transformers' `convert_to_rgb` does."""
    white = 255.0 if images.dtype == torch.uint8 else 1.0
    rgba = images.to(torch.float32)
    if white == 1.0 and (rgba.min() < 0 or rgba.max() > 1):
        raise ValueError("Float RGBA images must hold values in [0, 1] to be composited onto white.")
    alpha = rgba[..., 3:, :, :] / white
    rgb = rgba[..., :3, :, :] * alpha + white * (1 - alpha)
    return rgb.round_().to(torch.uint8) if images.dtype == torch.uint8 else rgb


class VisionTransformerImagesKwargs(ImagesKwargs, total=False):
    """The options of this processor beyond transformers' own, declared so that `from_pretrained(...,
    max_num_patches=...)` builds the processor with them (and checks them) like any other option."""

    max_num_patches: int | None
    patch_size: int
    packed_sequence_length: int | None


# The options of a `preprocess` call that default to the processor's own (None: its value).
_CALL_OPTIONS = (
    "do_convert_rgb", "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor",
    "do_normalize", "image_mean", "image_std", "max_num_patches", "patch_size", "packed_sequence_length",
)  # fmt: skip


class VisionTransformerImageProcessor(BaseImageProcessor):
    r"""Image processor for the Vision Transformer, processing batches with torch (CPU or GPU).

    Images go through: decode and convert to RGB (`load_images`, which training transforms call too) -> resize
    (antialiased like PIL; images of one size in one call) -> optional centre crop -> rescale and normalise (one fused
    multiply-add), and come out as float32 `pixel_values` of shape `[N, 3, H, W]`.

    Accepted images: PIL images of any mode, numpy arrays and torch tensors (`[H, W]`, `[C, H, W]`, `[H, W, C]`, or
    batches `[N, C, H, W]`/`[N, H, W, C]`; uint8 0-255 or floats), bytes of an encoded image file, paths to image
    files, or a (nested) list of these, of any mix of sizes.

    Args:
        do_convert_rgb (`bool`, defaults to `True`): convert images to 3-channel RGB, transparency composited onto
            white, as transformers does.
        do_resize, size (`bool`, defaults to `True`; `int`, `(height, width)` or `dict`, defaults to 224x224): resize
            images to a height and width, or with `{"shortest_edge": N}` their shorter side to N and the longer one
            by the same factor (rounded down), as transformers' DINOv2 (`BitImageProcessor`) and CLIP processors do.
        resample (`PILImageResampling`, `int` or `str`, defaults to bilinear): nearest, bilinear or bicubic.
        do_center_crop, crop_size (`bool`, defaults to `False`; as `size`, defaults to 224x224): centre-crop images
            to `crop_size` after resizing.
        do_rescale, rescale_factor (`bool`, defaults to `True`; `float`, defaults to `1/255`): multiply pixel values
            by `rescale_factor` (pass `do_rescale=False` for float images already in [0, 1]).
        do_normalize, image_mean, image_std (`bool`, defaults to `True`; `float` or one per channel, defaults to 0.5
            each, as in the ViT paper): normalise with `(x - image_mean) / image_std`.
        max_num_patches (`int`, optional): native aspect ratio (as transformers' SigLIP 2 processor): resize each
            image to the largest grid of at most this many `patch_size` patches that keeps its aspect ratio (instead
            of `size`), and return its patches flattened and padded to this number: `pixel_values`
            `(N, max_num_patches, patch_size**2 * C)` (each patch in patch-row, patch-column, channel order),
            `pixel_attention_mask` `(N, max_num_patches)` (1 for the image's patches, which come first) and
            `spatial_shapes` `(N, 2)` (rows, columns). `None` (the default): whole images of `size`.
        patch_size (`int`, defaults to 16): the model's patch size, which the patches of `max_num_patches` are cut
            with.
        packed_sequence_length (`int`, optional): with `max_num_patches`, pack whole images into rows of this many
            patch slots (NaViT's "Patch n' Pack", `best_fit_decreasing`) instead of one image per row; at least
            `max_num_patches`. Returns `pixel_values` `(rows, packed_sequence_length, patch_size**2 * C)`,
            `spatial_shapes` `(N, 2)` (each image's grid, in the order given) and `image_slot_index` `(N, K)` (the
            slot, row * packed_sequence_length + slot, of each image's patch k, -1 beyond its grid). Each image's
            patches are consecutive in its row, row-major; the padding is at the end of each row. One image alone
            comes back as the native-aspect batch of one, so that the outputs of such calls concatenate into a valid
            batch, as transformers' pipelines batch them.

    Every option can also be overridden per call, e.g. `processor(images, size=384, return_tensors="pt")`.
    """

    model_input_names = ["pixel_values"]
    valid_kwargs = VisionTransformerImagesKwargs

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`, also for the checkpoints hf-vit's models convert on load (transformers'
        and timm's ViT, the authors' `.npz`): their preprocessing (size, mean/std, resampling) comes along."""
        try:  # the hook the converters fill (`loading.py`); this file also works alone, for hf-vit folders only
            from .loading import open_foreign
        except ImportError:
            foreign = None
        else:
            foreign = open_foreign(pretrained_model_name_or_path, kwargs)
        if foreign is not None:  # the caller's settings (e.g. size=384) apply as for a saved processor
            processor = foreign.processor()
            return cls.from_dict(processor.to_dict(), **{k: v for k, v in kwargs.items() if hasattr(processor, k)})
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def __init__(
        self,
        do_convert_rgb: bool = True,
        do_resize: bool = True,
        size: int | Sequence[int] | dict[str, int] | None = None,
        resample: PILImageResampling | int | str = PILImageResampling.BILINEAR,
        do_center_crop: bool = False,
        crop_size: int | Sequence[int] | dict[str, int] | None = None,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: float | Sequence[float] | None = None,
        image_std: float | Sequence[float] | None = None,
        max_num_patches: int | None = None,
        patch_size: int = 16,
        packed_sequence_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        given = {name: value for name, value in locals().items() if name in _CALL_OPTIONS}
        given["size"], given["crop_size"] = (224 if value is None else value for value in (size, crop_size))
        for name in ("image_mean", "image_std"):
            given[name] = [0.5, 0.5, 0.5] if given[name] is None else given[name]
        vars(self).update(_checked_options(given))

    def with_options(self, **options: Any) -> "VisionTransformerImageProcessor":
        """A copy of this processor with `options` (its constructor's) changed and checked, e.g.
        `with_options(max_num_patches=None, packed_sequence_length=None)` for whole images at its size."""
        unknown = sorted(set(options) - set(_CALL_OPTIONS))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no option(s) {unknown}.")
        changed = copy.deepcopy(self)
        vars(changed).update(_checked_options({**{name: getattr(self, name) for name in _CALL_OPTIONS}, **options}))
        return changed

    def preprocess(
        self,
        images: Any,
        return_tensors: str | TensorType | None = None,
        input_data_format: str | ChannelDimension | None = None,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        """Preprocess an image or a batch of images (see the class docstring) into `pixel_values`; `kwargs` are this
        processor's options, those left out or None taking its values.

        Args:
            return_tensors (`"pt"`, `"np"` or None): return a `[N, C, H, W]` torch tensor, a numpy array, or (None)
                a list of `[C, H, W]` numpy arrays.
            input_data_format (`"channels_first"`, `"channels_last"` or None): layout of array/tensor inputs,
                inferred from where the 1, 3 or 4 channels are when None.
            device: process (and return "pt" tensors) on this device, e.g. "cuda".
        """
        unsupported = sorted(key for key, value in kwargs.items() if value is not None and key not in _CALL_OPTIONS)
        if unsupported:
            raise TypeError(f"{type(self).__name__} got unsupported argument(s) {unsupported}.")
        return_tensors = None if return_tensors is None else TensorType(return_tensors)
        if return_tensors not in (None, TensorType.PYTORCH, TensorType.NUMPY):
            raise ValueError(f"return_tensors must be 'pt', 'np' or None, got {return_tensors!r}.")
        o = _checked_options(
            {name: getattr(self, name) if kwargs.get(name) is None else kwargs[name] for name in _CALL_OPTIONS}
        )
        tensors = load_images(images, o["do_convert_rgb"], input_data_format)
        groups: dict[tuple, list[int]] = {}  # the images of one size, type and device: one batch (resize) each
        for index, tensor in enumerate(tensors):
            groups.setdefault((tuple(tensor.shape), tensor.dtype, tensor.device), []).append(index)
        processed = [None] * len(tensors)
        for indices in groups.values():
            batch = _stack_channels_last([tensors[i] for i in indices])
            if device is not None:
                batch = batch.to(device)
            if o["do_rescale"] and batch.is_floating_point() and batch.min() >= 0 and batch.max() <= 1:
                logger.warning_once(
                    "It looks like you are trying to rescale already rescaled images. If the input images have pixel "
                    "values between 0 and 1, set `do_rescale=False` to avoid rescaling them again."
                )
            if o["do_resize"]:
                target = resize_target(*batch.shape[-2:], o["size"])
                if o["max_num_patches"] is not None:  # the image's own aspect ratio, on the largest grid that fits
                    rows, cols = grid_for_max_patches(*batch.shape[-2:], o["patch_size"], o["max_num_patches"])
                    target = (rows * o["patch_size"], cols * o["patch_size"])
                batch = resize_images(batch, target, o["resample"])
            if o["do_center_crop"]:
                batch = center_crop_images(batch, (o["crop_size"]["height"], o["crop_size"]["width"]))
            if o["do_convert_rgb"] and batch.shape[1] == 1:
                batch = batch.expand(-1, 3, -1, -1)
            batch = _rescale_and_normalize_as(o, batch)
            if len(groups) == 1:
                processed = batch
            else:
                for position, index in enumerate(indices):
                    processed[index] = batch[position]

        if o["max_num_patches"] is None:
            return _batch_feature({"pixel_values": processed}, return_tensors)
        grids, patches = _native_patches(processed, o["patch_size"], o["max_num_patches"])
        if o["packed_sequence_length"] is not None and len(processed) > 1:  # one image alone is the padded batch
            return _batch_feature(pack_patches(patches, grids, o["packed_sequence_length"]), return_tensors)
        return _batch_feature(pad_patches(patches, grids, o["max_num_patches"]), return_tensors)

    def normalize_batch(self, images: torch.Tensor) -> torch.Tensor:
        """Rescale and normalise a `[N, C, H, W]` batch with this processor's settings: the last step of `preprocess`,
        for pipelines that resize and augment batches themselves."""
        return _rescale_and_normalize_as(vars(self), images)


def _rescale_and_normalize_as(o: dict[str, Any], images: torch.Tensor) -> torch.Tensor:
    """`rescale_and_normalize` as the options `o` (`do_rescale`, `rescale_factor`, `do_normalize`, ...) say."""
    normalize = o["do_normalize"]
    rescale_factor = o["rescale_factor"] if o["do_rescale"] else None
    return rescale_and_normalize(
        images, rescale_factor, *(o[name] if normalize else None for name in ("image_mean", "image_std"))
    )


def _native_patches(
    images: Sequence[torch.Tensor], patch_size: int, max_num_patches: int
) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """Each image's patch grid and its patches `(rows * cols, P * P * C)`, in (patch row, patch column, channel)
    order, refusing an image that is not a grid of at most `max_num_patches` patches."""
    grids, patches = [], []
    for index, image in enumerate(images):
        height, width = image.shape[-2:]
        rows, cols = height // patch_size, width // patch_size
        if height % patch_size or width % patch_size or rows * cols > max_num_patches:
            raise ValueError(
                f"Image {index} is {height}x{width} pixels, which is not a grid of at most {max_num_patches} "
                f"{patch_size}x{patch_size} patches: leave do_resize on with max_num_patches (it chooses the grid)."
            )
        grids.append((rows, cols))
        grid = image.view(image.shape[0], rows, patch_size, cols, patch_size).permute(1, 3, 2, 4, 0)
        patches.append(grid.reshape(rows * cols, -1).float())  # one strided copy
    return grids, patches


def _batch_feature(
    data: dict[str, torch.Tensor | list[torch.Tensor]], return_tensors: str | TensorType | None
) -> BatchFeature:
    """`data` as `return_tensors` asks: torch or numpy batches (a list of whole images stacked), or (None) lists of
    numpy arrays, one per image."""
    return_tensors = None if return_tensors is None else TensorType(return_tensors)
    if return_tensors is None:
        return BatchFeature({name: [one.cpu().numpy() for one in value] for name, value in data.items()})
    if isinstance(data["pixel_values"], list):
        shapes = {tuple(image.shape) for image in data["pixel_values"]}
        if len(shapes) > 1:
            raise ValueError(
                f"Cannot batch images of different shapes {sorted(shapes)}: enable do_center_crop (or do_resize to "
                "a height and width) so all images get the same size, or pass return_tensors=None to get a list."
            )
        data = {"pixel_values": torch.stack(data["pixel_values"])}
    if return_tensors == TensorType.NUMPY:
        data = {name: value.cpu().numpy() for name, value in data.items()}
    return BatchFeature(data, tensor_type=return_tensors)


def native_patch_batch(
    images: torch.Tensor | list[torch.Tensor],
    patch_size: int,
    max_num_patches: int,
    return_tensors: str | TensorType | None = "pt",
) -> BatchFeature:
    """Normalised `[C, H, W]` images, each a whole number of patches, as the processor's padded native-aspect batch
    (see `max_num_patches` in the class docstring), for training transforms that resize images themselves."""
    grids, patches = _native_patches(images, patch_size, max_num_patches)
    return _batch_feature(pad_patches(patches, grids, max_num_patches), return_tensors)


def pad_patches(
    patches: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]], length: int | None = None
) -> dict[str, torch.Tensor]:
    """Each image's flattened patches (`(rows * cols, D)`, its grid's in `grids`) padded with zeros to `length` (by
    default the longest) as a native-aspect batch; the processor's and the training collator's padder."""
    sizes = [len(values) for values in patches]
    if sizes != [rows * cols for rows, cols in grids]:
        raise ValueError(f"Each image's patches must be its grid's rows * cols: {sizes} patches for grids {grids}.")
    length = max(sizes) if length is None else length
    device = patches[0].device
    pixel_values = torch.zeros(len(sizes), length, patches[0].shape[-1], device=device)
    for row, values in enumerate(patches):
        pixel_values[row, : len(values)] = values
    shapes = torch.tensor([list(grid) for grid in grids], dtype=torch.long, device=device)
    return {
        "pixel_values": pixel_values,
        "pixel_attention_mask": (torch.arange(length, device=device) < shapes.prod(1)[:, None]).int(),
        "spatial_shapes": shapes,
    }


def best_fit_decreasing(sizes: Sequence[int], capacity: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Bins of at most `capacity` for the items `order` lists (indices into `sizes`; by default all), as lists of item
    indices: the items taken largest first (ties in `order`'s order), each put in the open bin it leaves the least
    room in (the newest of those), a new bin when none has room; the bins' fullness depends on `sizes` only. One binary
    search among the distinct rooms left per item. The packer of the processor and of training's planned batches."""
    check_positive_int("capacity", capacity)
    rooms: list[int] = []  # the distinct rooms left in open bins, ascending
    bins_with_room: dict[int, list[int]] = {}  # room -> the bins with that room left
    bins: list[list[int]] = []
    order = range(len(sizes)) if order is None else order
    for index in sorted(order, key=sizes.__getitem__, reverse=True):  # stable: ties stay in `order`'s order
        size = sizes[index]
        if not 1 <= size <= capacity:
            raise ValueError(f"Item {index} has size {size}, which is not between 1 and the capacity {capacity}.")
        place = bisect.bisect_left(rooms, size)
        if place == len(rooms):
            number, room = len(bins), capacity
            bins.append([])
        else:
            room = rooms[place]
            number = bins_with_room[room].pop()
            if not bins_with_room[room]:
                del bins_with_room[room], rooms[place]
        bins[number].append(index)
        room -= size
        if room:
            if room not in bins_with_room:
                bisect.insort(rooms, room)
                bins_with_room[room] = []
            bins_with_room[room].append(number)
    return bins


def pack_patches(
    patches: Sequence[torch.Tensor],
    grids: Sequence[tuple[int, int]],
    packed_sequence_length: int,
    positions: Sequence[torch.Tensor] | None = None,
    rows: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Each image's flattened patches (`(rows * cols, D)`, its grid's in `grids`) packed whole by
    `best_fit_decreasing` into rows of `packed_sequence_length` slots (see `packed_sequence_length` in the class
    docstring), written from the plan; the processor's and the training collator's packer. With `positions` (each
    image's kept places of its grid, row-major, one per patch given: NaViT's token dropping), `patches` are only those
    kept, and `image_slot_index` is -1 at the places left out. With `rows` (the images of each row, every image once,
    e.g. a training sampler's plan), the batch has exactly those rows, in that order (an empty one is all padding)."""
    sizes = [len(image) for image in patches]
    places = [torch.arange(rows * cols) for rows, cols in grids] if positions is None else positions
    places = [torch.as_tensor(kept, dtype=torch.long).cpu() for kept in places]
    if [len(kept) for kept in places] != sizes:
        what = "their grid's rows * cols" if positions is None else "one place per patch given (`positions`)"
        raise ValueError(f"Each image's patches must be {what}: {sizes} patches for grids {list(grids)}.")
    for index, (kept, (height, width)) in enumerate(zip(places, grids)):
        if len(kept) and (int(kept.min()) < 0 or int(kept.max()) >= height * width or len(kept.unique()) < len(kept)):
            raise ValueError(f"`positions` of image {index} must be distinct places of its {height}x{width} grid.")
    device, length = patches[0].device, packed_sequence_length
    plan = best_fit_decreasing(sizes, length) if rows is None else [list(row) for row in rows]
    if sorted(index for row in plan for index in row) != list(range(len(sizes))) or any(
        sum(sizes[index] for index in row) > length for row in plan
    ):
        raise ValueError(
            f"`rows` {plan} must hold each of the {len(sizes)} images once, each row at most "
            f"`packed_sequence_length` = {length} patches (the images' {sizes})."
        )
    pixel_values = torch.zeros(len(plan), length, patches[0].shape[-1], device=device)
    image_slot_index = torch.full((len(sizes), max(height * width for height, width in grids)), -1, dtype=torch.long)
    for row, indices in enumerate(plan):
        start = row * length
        for index in indices:
            end = start + sizes[index]
            pixel_values.view(-1, pixel_values.shape[-1])[start:end] = patches[index]
            image_slot_index[index, places[index]] = torch.arange(start, end)
            start = end
    return {
        "pixel_values": pixel_values,
        "spatial_shapes": torch.tensor([list(grid) for grid in grids], dtype=torch.long, device=device),
        "image_slot_index": image_slot_index.to(device),
    }
