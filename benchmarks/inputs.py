"""The inputs' side: hf-vit's image processor against transformers' on real photos, and the training input
pipelines (hf-vit, torchvision as in transformers' example, timm) per core on JPEG files."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hf_vit import VisionTransformerImageProcessor

from .settings import HF_VIT, PIL_DECODE, TIMM, TORCHVISION, TRANSFORMERS
from .timing import timed_rounds


def sample_photos(count: int = 32) -> list:
    """`count` crops of scikit-learn's two sample photos (427x640), in four sizes: real photographs, offline."""
    import PIL.Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    sizes = [(427, 640), (384, 576), (320, 480), (256, 384)]
    images, index = [], 0
    while len(images) < count:
        photo = photos[index % len(photos)]
        crop_h, crop_w = sizes[(index // len(photos)) % len(sizes)]
        shift = index // (len(photos) * len(sizes))
        top = (shift * 37) % (photo.shape[0] - crop_h + 1)
        left = (shift * 53) % (photo.shape[1] - crop_w + 1)
        images.append(PIL.Image.fromarray(photo[top : top + crop_h, left : left + crop_w]))
        index += 1
    return images


def compare_processors(image_size: int, count: int = 32, repeats: int = 5) -> dict:
    """Images/s of hf-vit's processor and transformers' `ViTImageProcessorPil` on real photos, and how far apart
    their outputs are in [0, 1] pixel units."""
    from transformers import ViTImageProcessorPil

    images = sample_photos(count)
    processors = {
        HF_VIT: VisionTransformerImageProcessor(size=image_size),
        TRANSFORMERS: ViTImageProcessorPil(size={"height": image_size, "width": image_size}),
    }
    fns = {name: functools.partial(processor, images, return_tensors="pt") for name, processor in processors.items()}
    outputs = {name: fn()["pixel_values"] for name, fn in fns.items()}  # warm-up and the outputs to compare
    timed = timed_rounds(fns, 1, repeats, warmup=0)
    std = torch.tensor(processors[TRANSFORMERS].image_std, dtype=torch.float32).view(1, -1, 1, 1)
    # pixel_values = (x - mean) / std, so a difference in pixel_values times std is a difference of x in [0, 1].
    difference = (outputs[HF_VIT].float() - outputs[TRANSFORMERS].float()).abs() * std
    result = dict(images=count, image_sizes=sorted({f"{image.height}x{image.width}" for image in images}))
    result.update(output_size=image_size, seconds=timed["samples"])
    result["images_per_s"] = {name: count / seconds for name, seconds in timed["seconds"].items()}
    result.update(mean_abs_diff_01=difference.mean().item(), max_abs_diff_01=difference.max().item())
    return {**result, "shapes_match": tuple(outputs[HF_VIT].shape) == tuple(outputs[TRANSFORMERS].shape)}


PIPELINE_NAMES = {
    HF_VIT: "hf-vit make_train_transform",
    TORCHVISION: "torchvision, as transformers' run_image_classification.py",
    TIMM: "timm create_transform(is_training=True, color_jitter=None)",
    PIL_DECODE: "PIL decoding alone (open, RGB)",
}
PHOTO_SIZES = {"photo": [(640, 427), (500, 375)], "large_photo": [(2048, 1365), (1600, 1200)]}


def jpeg_photos(count: int, sizes: Sequence[tuple[int, int]], quality: int = 90) -> list[bytes]:
    """`count` JPEG files of scikit-learn's two sample photos (640x427) resized to `sizes` (width, height) in turn."""
    import io

    import PIL.Image
    from sklearn.datasets import load_sample_images

    photos = [PIL.Image.fromarray(photo) for photo in load_sample_images().images]
    files = []
    for index in range(count):
        photo, size = photos[index % len(photos)], sizes[(index // len(photos)) % len(sizes)]
        photo = photo if photo.size == size else photo.resize(size, PIL.Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        photo.save(buffer, format="JPEG", quality=quality)
        files.append(buffer.getvalue())
    return files


def input_pipelines(output_size: int) -> tuple[dict[str, Callable[[list[bytes]], object]], dict[str, str]]:
    """Training input pipelines from JPEG bytes to a normalised float batch (crop, flip), and why any is missing:
    hf-vit's, transformers' example's (torchvision), timm's without colour jitter, and PIL's decoding alone."""
    import io

    import PIL.Image

    from hf_vit.data.augment.train_transform import make_train_transform

    processor = VisionTransformerImageProcessor(size=output_size)
    mean, std = list(processor.image_mean), list(processor.image_std)
    hf_vit_transform = make_train_transform(processor)

    def decode(data: bytes) -> PIL.Image.Image:
        return PIL.Image.open(io.BytesIO(data)).convert("RGB")

    pipelines: dict[str, Callable[[list[bytes]], object]] = {
        HF_VIT: lambda files: hf_vit_transform({"image": [{"path": None, "bytes": data} for data in files]}),
    }
    skipped = {}
    try:
        from torchvision import transforms

        crop = [transforms.RandomResizedCrop(output_size), transforms.RandomHorizontalFlip()]
        example = transforms.Compose([*crop, transforms.ToTensor(), transforms.Normalize(mean, std)])
        pipelines[TORCHVISION] = lambda files: torch.stack([example(decode(data)) for data in files])
    except Exception as error:  # noqa: BLE001 - torchvision is optional (the peer environment has it)
        skipped[TORCHVISION] = f"{type(error).__name__}: {error}"
    try:
        from timm.data import create_transform

        timm_transform = create_transform(output_size, is_training=True, color_jitter=None, mean=mean, std=std)
        pipelines[TIMM] = lambda files: torch.stack([timm_transform(decode(data)) for data in files])
    except Exception as error:  # noqa: BLE001 - timm is optional
        skipped[TIMM] = f"{type(error).__name__}: {error}"
    pipelines[PIL_DECODE] = lambda files: [decode(data) for data in files]
    return pipelines, skipped


def compare_input_pipelines(output_size: int, count: int = 48, repeats: int = 5, profile: bool = False) -> dict:
    """Images/s per core of the training input pipelines on JPEG photos of the sizes in `PHOTO_SIZES`: one torch
    thread (as in a DataLoader worker), the pipelines alternating round by round like the models; with `profile`,
    where hf-vit's transform spends its time on the photos, by Python function (cProfile, self time)."""
    pipelines, skipped = input_pipelines(output_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    result: dict = {"names": PIPELINE_NAMES, "skipped": skipped, "output_size": output_size, "threads": 1}
    try:
        for kind, sizes in PHOTO_SIZES.items():
            files = jpeg_photos(count if kind == "photo" else max(count // 4, 4), sizes)
            fns = {name: functools.partial(pipeline, files) for name, pipeline in pipelines.items()}
            for name, fn in fns.items():  # every pipeline must give the same kind of batch
                if name != PIL_DECODE:
                    output = fn()
                    pixels = output["pixel_values"] if isinstance(output, dict) else output
                    expected = (len(files), 3, output_size, output_size)
                    if tuple(pixels.shape) != expected or pixels.dtype != torch.float32:
                        raise AssertionError(f"{name} gave {tuple(pixels.shape)} {pixels.dtype}, not {expected}")
            timed = timed_rounds(fns, None, repeats)  # at least a quarter second per sample
            result[kind] = {
                "images": len(files),
                "image_sizes": [f"{width}x{height}" for width, height in sizes],
                "jpeg_kib": sum(len(data) for data in files) / len(files) / 1024,
                "seconds": timed["samples"],
                "images_per_s": {name: len(files) / seconds for name, seconds in timed["seconds"].items()},
            }
        if profile:
            result["profile"] = _profile(pipelines[HF_VIT], jpeg_photos(count, PHOTO_SIZES["photo"]))
    finally:
        torch.set_num_threads(threads)
    return result


def _profile(pipeline: Callable[[list[bytes]], object], files: list[bytes], top: int = 12) -> dict:
    import cProfile
    import pstats

    pipeline(files)  # warm-up
    (profiler := cProfile.Profile()).runcall(pipeline, files)
    stats = pstats.Stats(profiler)
    total, count = stats.total_tt, len(files)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # by own (self) time
    functions = []
    for (file, line, name), (_, _, own, _, _) in rows:
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        functions.append({"function": where, "self_ms_per_image": 1e3 * own / count, "pct": 100 * own / total})
    return {"images": count, "total_ms_per_image": 1e3 * total / count, "top_functions": functions}
