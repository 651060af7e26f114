"""The recipes' speed on CPU: the EMA update's cost against a ViT-S/16 training step, and RandAugment's per-core
throughput against timm's `rand_augment_transform` (when timm is importable: the comparison environment).

    python benchmarks/recipes_speed.py                  # EMA row (and RandAugment without timm's)
    PYTHONPATH=. ~/.cache/hfvit-peer-env/bin/python benchmarks/recipes_speed.py --only rand_augment

Both run in one process with one torch thread, alternating what they compare (the order reverses every round); the
figures are medians of the rounds that other processes did not disturb (`timing.timed_rounds`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np
import PIL.Image
import torch

from benchmarks.inputs import sample_photos
from benchmarks.models import build_hf_vit, hf_vit_config
from benchmarks.runners import random_batch
from benchmarks.settings import BenchmarkSettings, add_flags
from benchmarks.timing import make_optimizer, make_train_step, timed_rounds
from hf_vit.data.augment.rand_augment import RandAugment, posterize
from hf_vit.train.ema import WeightAverage

RAND_AUGMENT = "rand-m9-mstd0.5-inc1"


def ema_cost(batch_size: int, repeats: int, steps: int, device: str = "cpu", dtype: str = "fp32") -> dict:
    """Seconds of a ViT-S/16 training step (forward, backward, AdamW) and of the EMA update after it, alternating;
    and the step with the update against the step without it. On `device` (a GPU: `dtype` "bf16" for autocast)."""
    settings = BenchmarkSettings(batch_size=batch_size, device=device, dtypes=[dtype])
    model = build_hf_vit(hf_vit_config(settings)).to(device).train()
    optimizer = make_optimizer(model)
    pixel_values, labels = random_batch(model.config, batch_size, torch.device(device))
    train_step = make_train_step(model, optimizer, pixel_values, labels, dtype)
    average, counter = WeightAverage(model, 0.9998, warmup=True), itertools.count(2)

    def update() -> None:
        average.update(next(counter))

    def step_with_ema() -> None:
        train_step()
        update()

    fns = {"training step": train_step, "EMA update": update, "training step + EMA update": step_with_ema}
    timed = timed_rounds(fns, steps, repeats, torch.device(device))  # after a warm-up: the optimiser's state
    seconds = timed["seconds"]
    result = dict(model="vit-small-patch16-224", device=device, dtype=dtype, batch_size=batch_size, seconds=seconds)
    result.update(averaged_values=sum(p.numel() for p in average.params))
    result["update_over_step"] = seconds["EMA update"] / seconds["training step"]
    result["with_over_without"] = seconds["training step + EMA update"] / seconds["training step"]
    return {**result, "clean_samples": {name: sum(sample["clean"]) for name, sample in timed["samples"].items()}}


def sample_images(count: int, size: int) -> list:
    """`count` real photo crops (scikit-learn's sample images) resized to `size` x `size`, as PIL images."""
    return [image.resize((size, size), PIL.Image.Resampling.BILINEAR) for image in sample_photos(count)]


def rand_augment_throughput(count: int, size: int, repeats: int, policy: str) -> dict:
    """Images/s on one thread: hf-vit's `RandAugment` on uint8 [3, H, W] tensors (the training transform's pixel path)
    and timm's `rand_augment_transform` on PIL images (its transform's input), with the same policy, fill 128 and
    bilinear resampling. Each pass draws its operations afresh (hf-vit from a generator seeded per pass)."""
    images = sample_images(count, size)
    tensors = [torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images]
    ours = RandAugment(policy, fill=128, resample="bilinear")
    generator, passes = torch.Generator(), itertools.count(1)

    def hf_vit() -> None:
        seed = next(passes) * 100_003
        for index, pixels in enumerate(tensors):
            ours(pixels, generator.manual_seed(seed + index))

    fns = {"hf_vit": hf_vit}
    try:
        from timm.data import auto_augment
        from timm.data.auto_augment import rand_augment_transform

        # timm's posterize passes 0 bits (its strongest magnitudes) to Pillow's ImageOps.posterize, which refuses
        # them: give it the same black image that hf-vit's makes, so that both run the whole policy.
        for name in ("Posterize", "PosterizeIncreasing"):
            auto_augment.NAME_TO_OP[name] = lambda image, bits, **_: posterize(image, bits)
        theirs = rand_augment_transform(
            policy, {"img_mean": (128,) * 3, "interpolation": PIL.Image.Resampling.BILINEAR}
        )
        fns["timm"] = lambda: [theirs(image) for image in images]
    except ImportError as error:
        print(f"timm is not importable ({error}): hf-vit's row only", file=sys.stderr)
    rates = {name: count / seconds for name, seconds in timed_rounds(fns, 1, repeats)["seconds"].items()}
    result = {"policy": policy, "images": count, "size": size, "images_per_s": rates}
    if "timm" in rates:
        result["hf_vit_over_timm"] = rates["hf_vit"] / rates["timm"]
        result["pixels_against_timm"] = rand_augment_parity(8, 96, policy)
    return result


def rand_augment_parity(count: int, size: int, policy: str) -> dict:
    """hf-vit's operations against timm's own (`timm.data.auto_augment.NAME_TO_OP`, the functions its RandAugment
    calls) with the same argument (each operation's level at magnitudes 0..10 and both signs), on photo crops: the
    largest pixel difference and the share of pixels that differ, per operation."""
    from timm.data import auto_augment

    from hf_vit.data.augment.rand_augment import OPERATIONS

    images = [np.asarray(image) for image in sample_images(count, size)]
    ours = RandAugment(policy, fill=128, resample="bilinear")
    kwargs = {"fillcolor": (128, 128, 128), "resample": PIL.Image.Resampling.BILINEAR}
    result = {}
    for name in ours.policy.ops:
        level, _ = OPERATIONS[name]
        largest, differing, total = 0, 0, 0
        for magnitude in range(11):
            for seed, image in enumerate(images):
                argument = None if level is None else level(magnitude, torch.Generator().manual_seed(seed))
                mine = ours.apply(image, name, magnitude, torch.Generator().manual_seed(seed))
                args = () if argument is None else (argument,)
                theirs = np.asarray(auto_augment.NAME_TO_OP[name](PIL.Image.fromarray(image), *args, **kwargs))
                difference = np.abs(mine.astype(int) - theirs.astype(int))
                largest = max(largest, int(difference.max()))
                differing, total = differing + int((difference > 0).sum()), total + difference.size
        result[name] = {"largest_difference": largest, "share_differing": differing / total}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["ema", "rand_augment"], default=None)
    add_flags(parser, {
        "batch_size": (16, "ViT-S/16 training batch (the benchmark's 16)"), "repeats": (5, None), "images": (64, None),
        "steps": (1, "training steps per timed sample"), "image_size": (224, None), "policy": (RAND_AUGMENT, None),
    })  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only in (None, "rand_augment"):
        print(json.dumps(rand_augment_throughput(args.images, args.image_size, args.repeats, args.policy)), flush=True)
    if args.only in (None, "ema"):
        print(json.dumps(ema_cost(args.batch_size, args.repeats, args.steps)), flush=True)


if __name__ == "__main__":
    main()
