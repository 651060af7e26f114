"""A data set's images to model inputs by the image processor's own pixel path (serving uses it too; the training
transform adds its augmentations apart, in `augment/`), then to batches (`collate_fn`). A corrupt image is never
dropped silently (that would change the data set): it raises `CorruptImageError` naming its file."""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import PIL.Image
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

from ..model.image_processing_vit import (
    VisionTransformerImageProcessor,
    load_images,
    open_image,
    pack_patches,
    pad_patches,
)

_IMAGE_DECODER = datasets.Image()
PACKED_ROW = "packed_row"
"""An example's row in its packed batch, where a sampler planned it (`packed_batches.PackedBatchSampler`)."""

Transform = Callable[[Mapping[str, Sequence[Any]]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Augmentation:
    """How a run augments its training images: the augmentation flags' values (`--hflip` resolved)."""

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
    """The sizes of a run's training batches: the values of their flags, under their names."""

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
    """A data set image (`{"path", "bytes"}` dict, path or bytes) decoded by the processor's `open_image`; decoded
    pixels as they are. A `CorruptImageError` names the file (and `index`, its place in the batch)."""
    where = "" if index is None else f" (image {index} of the batch)"
    if isinstance(image, (PIL.Image.Image, np.ndarray, torch.Tensor)):
        return _checked_pixels(image, f"{type(image).__name__}{where}")
    path, data = encoded_image(image)
    if path is None and data is None and not isinstance(image, Mapping):
        raise TypeError(f"Unsupported image type {type(image).__name__}: expected a PIL image, a path or bytes.")
    image, source = {"path": path, "bytes": data}, path or f"{len(data or b'')} bytes of image data"
    try:
        if data is None and path is not None and "://" in path:
            decoded = _IMAGE_DECODER.decode_example(image)  # remote files (hf://, s3://) are read by datasets
        else:
            decoded = open_image(data if data is not None else path)
    except (ValueError, OSError) as err:
        cause = err.__cause__ if isinstance(err.__cause__, Exception) else err  # PIL's own error, not our wrapper
        reason = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(cause))  # PIL names its buffer
        raise CorruptImageError(f"Cannot decode image {source}{where}: {reason}") from cause
    return _checked_pixels(decoded, f"{source}{where}")


def encoded_image(image: Any) -> tuple[str | None, bytes | None]:
    """(path, bytes) of an encoded image: a path, bytes, or a data set's `{"path", "bytes"}` dict; (None, None) for
    anything else."""
    if isinstance(image, (str, os.PathLike)):
        return os.fspath(image), None
    if isinstance(image, (bytes, bytearray, memoryview)):
        return None, bytes(image)
    return (image.get("path"), image.get("bytes")) if isinstance(image, Mapping) else (None, None)


def local_encoded(image: Any) -> tuple[str | io.BytesIO, str] | None:
    """(what `PIL.Image.open` reads, the name of the file for messages) of an encoded image on this machine (a path,
    bytes or a data set's `{"path", "bytes"}` dict); None for decoded pixels and remote files."""
    path, data = encoded_image(image)
    if data is not None:
        return io.BytesIO(data), path or f"{len(data)} bytes of image data"
    return None if path is None or "://" in path else (path, path)


def header_size(image: Any) -> tuple[int, int] | None:
    """`(height, width)` of an encoded image on this machine from its header, its pixels undecoded (its EXIF
    orientation not applied); None for decoded pixels and remote files. A `CorruptImageError` names a file whose
    header cannot be read or has no pixels."""
    if (found := local_encoded(image)) is None:
        return None
    file, source = found
    try:
        with PIL.Image.open(file) as opened:
            width, height = opened.size
    except PIL.UnidentifiedImageError as error:
        raise CorruptImageError(f"{source}: not an image file PIL can read") from error
    except (OSError, ValueError) as error:
        raise CorruptImageError(f"{source}: {getattr(error, 'strerror', None) or error}") from error
    if not width or not height:
        raise CorruptImageError(f"Image {source} has no pixels ({width}x{height}): remove it from the data set.")
    return height, width


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
    """`decode_image`'s image as an RGB PIL image of the processor's pixels (`load_images`)."""
    (pixels,) = load_images(decode_image(image, index))
    if pixels.is_floating_point():
        pixels = pixels.round().clamp(0, 255).to(torch.uint8)
    return PIL.Image.fromarray(pixels.expand(3, -1, -1).permute(1, 2, 0).numpy())


def make_eval_transform(processor: VisionTransformerImageProcessor) -> Transform:
    """Batch transform for evaluation: decode the images, then `processor` does everything else (as at inference);
    one example per image, also for a processor that packs (`packed_sequence_length`): a batch's rows are made where
    the batch is, by `collate_fn` or `pack_native_batch`."""
    if getattr(processor, "packed_sequence_length", None) is not None:
        processor = processor.with_options(packed_sequence_length=None)

    def transform(batch: Mapping[str, Sequence[Any]]) -> dict[str, torch.Tensor]:
        images = [decode_image(image, i) for i, image in enumerate(batch["image"])]
        processed = processor(images, return_tensors="pt")
        # native-aspect batches (the processor's max_num_patches) carry their padding mask and grids along
        return {**processed, **with_labels(processed["pixel_values"], batch)}

    return transform


def with_labels(pixel_values: torch.Tensor, batch: Mapping[str, Sequence[Any]]) -> dict[str, torch.Tensor]:
    output = {"pixel_values": pixel_values.to(torch.float32)}
    if "label" in batch:
        labels = np.asarray(batch["label"])
        # class ids, or multi-hot float vectors for multi-label classification
        output["labels"] = torch.as_tensor(labels, dtype=torch.float32 if labels.ndim == 2 else torch.long)
    return output


def apply_transforms(
    ds: DatasetDict | IterableDatasetDict,
    train_transform: Transform,
    eval_transform: Transform,
    *,
    train_split: str = "train",
    stream_batch_size: int = 32,
) -> DatasetDict | IterableDatasetDict:
    """`ds` with `train_transform` on `train_split` and `eval_transform` on the others, the images undecoded (so
    that a corrupt one is named by its file)."""
    # datasets' "couldn't be hashed properly" warning kept quiet: a lazy `with_transform` caches nothing, so the random
    # fingerprint it warns about changes nothing for the user, who saw it in every run
    fingerprint = logging.getLogger("datasets.fingerprint")
    level, transformed = fingerprint.level, {}
    fingerprint.setLevel(logging.ERROR)
    try:
        for split, data in ds.items():
            transform = train_transform if split == train_split else eval_transform
            if isinstance(data, IterableDataset):
                columns = data.column_names or ["image", "label"]
                data = data.decode(False)
                data = data.map(transform, batched=True, batch_size=stream_batch_size, remove_columns=columns)
            else:
                data = data.cast_column("image", datasets.Image(decode=False)).with_transform(transform)
            transformed[split] = data
    finally:
        fingerprint.setLevel(level)
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
    ids) or [N, C] (multi-hot), one per image. Native-aspect examples (flattened patches [K_i, P*P*C]) are padded or
    packed by `_native_batch`; with `packed_rows`, a planned batch is padded with empty rows to exactly that many."""
    if "spatial_shapes" in examples[0]:
        native = [{key: torch.as_tensor(value) for key, value in example.items()} for example in examples]
        batch = _native_batch(native, packed_sequence_length, packed_rows)
    else:
        if packed_sequence_length is not None:
            raise ValueError("`packed_sequence_length` packs native-aspect examples (with `spatial_shapes`).")
        batch = {"pixel_values": torch.stack([torch.as_tensor(example["pixel_values"]) for example in examples])}
    if "labels" in examples[0]:
        labels = [torch.as_tensor(example["labels"]) for example in examples]
        batch["labels"] = torch.stack(labels) if labels[0].ndim else torch.stack(labels).long()
    return batch


def _native_batch(
    examples: Sequence[Mapping[str, torch.Tensor]], packed_sequence_length: int | None, packed_rows: int | None = None
) -> dict:
    """Native-aspect examples (patches, grid; the places kept after token dropping) padded to the longest (each one's
    patches first, then zeros; `pixel_attention_mask` [N, K] marks them), or with `packed_sequence_length` packed by
    the image processor's `pack_patches` (rows of that many slots): into the rows they carry (`PACKED_ROW`, planned by
    `PackedBatchSampler`), padded to `packed_rows`, or largest first."""
    grids = [tuple(example["spatial_shapes"].tolist()) for example in examples]
    positions = None
    if "patch_positions" in examples[0]:  # token dropping: only the kept patches, with their places
        if packed_sequence_length is None:
            raise ValueError(
                "Examples with dropped patches (`patch_positions`) are packed: give `packed_sequence_length`."
            )
        positions = [example["patch_positions"][example["patch_positions"] >= 0] for example in examples]
        counts = [len(kept) for kept in positions]
    else:
        counts = [rows * cols for rows, cols in grids]
    patches = [example["pixel_values"][:count].float() for example, count in zip(examples, counts)]
    if packed_sequence_length is None:
        return pad_patches(patches, grids, max(len(example["pixel_values"]) for example in examples))
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
    return {**others, **_native_batch(examples, packed_sequence_length)}


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


def check_eval_images(raw) -> None:
    """Before training, decode every image of the evaluation splits once and read every training image's header (its
    pixels are decoded when its batches come), so that unreadable files stop the run at once, all of them named, one
    line each."""
    problems = []
    for split in ("train", "validation", "test"):
        data = raw.get(split)
        if data is None or isinstance(data, datasets.IterableDataset):
            continue
        undecoded = data.cast_column("image", datasets.Image(decode=False))
        for start in range(0, len(undecoded), 256):
            for image in undecoded[start : start + 256]["image"]:
                problem = image_problem(header_size if split == "train" else decode_rgb, image)
                problems += [f"{split}: {problem}"] if problem else []
    if problems:
        raise CorruptImageError(
            f"{len(problems)} image(s) cannot be read; fix or remove them (--no_check_eval_images skips this "
            "check):\n  " + "\n  ".join(problems)
        )


def image_problem(read: Callable[[Any], Any], image: Any) -> str | None:
    """`read`'s (`header_size`'s, `decode_rgb`'s) error for `image` as one line, or None when it reads."""
    try:
        read(image)
    except CorruptImageError as error:
        return str(error).replace("\n", " ")
    return None
