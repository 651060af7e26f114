#!/usr/bin/env python
r"""Checks against timm, run in the comparison environment (`bash benchmarks/peer_env.sh`); what timm computes is
recorded for the tests, which cannot import it.

1. `--fixtures DIR`: tiny random timm NaFlexViT models in timm's Hub layout, each with `outputs.safetensors`: timm's
   logits on images at two sizes and on a NaFlex batch built by timm's own transforms and collator
   (tests/test_naflex_checkpoints.py compares hf-vit's logits with them).
2. `--resample`: hf-vit's `resample_patch_embedding` against timm's `resample_patch_embed`, the largest difference.
3. `--erasing`: hf-vit's `RandomErasing` against timm's in distribution over 2000 draws: share erased, area and
   aspect (Kolmogorov-Smirnov distance against its 0.1% critical value), position, fill; also with 3 rectangles.

    PYTHONPATH=. $PEER/bin/python benchmarks/peer_checks.py --fixtures tests/data/timm_naflex --resample
    PYTHONPATH=. $PEER/bin/python benchmarks/peer_checks.py --erasing
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

COMMAND = "PYTHONPATH=. $PEER/bin/python benchmarks/peer_checks.py --fixtures tests/data/timm_naflex --resample"
TINY = {"patch_size": 4, "embed_dim": 16, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0}
# name: (timm architecture, model_args beyond TINY, image sizes (H, W) for the image path, NaFlex max_seq_len)
FIXTURES = {
    # average pooling, 4 registers, LayerScale, fc_norm: the architecture's own blocks
    "gap": ("naflexvit_base_patch16_gap", {"pos_embed_grid_size": [4, 4]}, [(16, 16), (12, 24)], 20),
    # the class token pooled, 2 registers, LayerScale, bilinear position resampling
    "token": (
        "naflexvit_base_patch16_gap",
        {"pos_embed_grid_size": [4, 4], "class_token": True, "reg_tokens": 2, "global_pool": "token",
         "fc_norm": False, "pos_embed_interp_mode": "bilinear"},
        [(16, 16), (20, 8)],
        20,
    ),
    # attention pooling (SigLIP 2's NaFlex tower: no prefix tokens, tanh GELU) on a 3x5 position grid
    "map": ("naflexvit_base_patch16_siglip", {"pos_embed_grid_size": [3, 5]}, [(12, 20), (24, 16)], 24),
}  # fmt: skip
NUM_CLASSES = 5
# raw image sizes (H, W) of the NaFlex batch: square, wide, tall, extreme
RAW_SIZES = [(40, 40), (20, 80), (90, 30), (10, 120)]


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every weight away from its initial value (timm starts LayerScale at 1e-5 and the tokens near zero, which
    would hide them), so that each one shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.startswith("head."):  # logits of order one, so that a tolerance of 1e-5 says something
                parameter.copy_(noise)
            elif name.endswith("gamma"):
                parameter.copy_(0.5 + 0.2 * noise)
            elif "norm" in name and name.endswith("weight"):
                parameter.copy_(1 + 0.1 * noise)
            else:
                parameter.add_(0.1 * noise)


def naflex_batch(patch_size: int, max_seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """A NaFlex batch of random images built by timm's own data path: resized to fit `max_seq_len` patches at their
    aspect ratio (`ResizeToSequence`), normalised, patchified (`Patchify`) and padded (`NaFlexCollator`)."""
    from timm.data.naflex_dataset import NaFlexCollator
    from timm.data.naflex_transforms import Patchify, ResizeToSequence
    from torchvision import transforms

    rng = np.random.default_rng(seed)
    resize = ResizeToSequence(patch_size, max_seq_len=max_seq_len, interpolation="bicubic")
    steps = [transforms.ToTensor(), resize, transforms.Normalize([0.5] * 3, [0.5] * 3), Patchify(patch_size)]
    transform = transforms.Compose(steps)
    samples = [(transform(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), 0) for h, w in RAW_SIZES]
    batch, _ = NaFlexCollator(max_seq_len=max_seq_len)(samples)
    return {name: batch[name] for name in ("patches", "patch_coord", "patch_valid")}


def write_fixture(folder: Path, name: str, seed: int) -> dict:
    """One tiny NaFlexViT in timm's Hub layout in `folder`, with inputs and timm's logits in outputs.safetensors."""
    import timm
    from safetensors.torch import save_file
    from timm.models import save_for_hf

    architecture, extra, sizes, max_seq_len = FIXTURES[name]
    model_args = {**TINY, **extra}
    torch.manual_seed(seed)
    model = timm.create_model(
        architecture, pretrained=False, num_classes=NUM_CLASSES,
        **{k: tuple(v) if isinstance(v, list) else v for k, v in model_args.items()},
    ).eval()  # fmt: skip
    _randomise(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_for_hf(model, folder, model_args=model_args, safe_serialization=True)
    outputs, generator = {}, torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for index, (height, width) in enumerate(sizes):
            outputs[f"images_{index}"] = images = torch.randn(2, 3, height, width, generator=generator)
            outputs[f"logits_{index}"] = model(images)
        batch = naflex_batch(model_args["patch_size"], max_seq_len, seed)
        outputs.update(batch, naflex_logits=model(dict(batch)))
    valid = batch["patch_valid"]
    grids = [(int(c[v][:, 0].max()) + 1, int(c[v][:, 1].max()) + 1) for c, v in zip(batch["patch_coord"], valid)]
    outputs["spatial_shapes"] = torch.tensor(grids)
    save_file({k: v.contiguous() for k, v in outputs.items()}, folder / "outputs.safetensors")
    record = dict(architecture=architecture, model_args=model_args, timm=timm.__version__, torch=torch.__version__)
    record.update(image_sizes=[list(s) for s in sizes], naflex_grids=[list(g) for g in grids], command=COMMAND)
    (folder / "outputs.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def compare_resampling() -> None:
    """Prints hf-vit's `resample_patch_embedding` against timm's `resample_patch_embed` on the same random kernel."""
    from timm.layers import resample_patch_embed

    from hf_vit.model.resolution import resample_patch_embedding

    generator = torch.Generator().manual_seed(0)
    for old, new in ((16, 8), (16, 24), (16, 32), (8, 16), (32, 16), (14, 16)):
        weight = torch.randn(64, 3, old, old, generator=generator)
        for antialias in (True, False):
            ours = resample_patch_embedding(weight, new, "bicubic", antialias)
            theirs = resample_patch_embed(weight, [new, new], interpolation="bicubic", antialias=antialias)
            print(
                f"resample_patch_embedding {old}->{new} bicubic antialias={antialias}: max |hf-vit - timm| "
                f"{(ours - theirs).abs().max().item():.2e} (largest weight {theirs.abs().max().item():.2f})"
            )


def _erasing_statistics(erase, draws: int, size: int, **options) -> dict:
    """The statistics of what `erase(image, **options)` (in place) did to `draws` constant images (every value 5)."""
    images = [torch.full((3, size, size), 5.0) for _ in range(draws)]
    for image in images:
        erase(image, **options)
    erased = [image for image in images if (image != 5.0).any()]
    masks = [(image != 5.0).any(0) for image in erased]
    areas, aspects, tops, lefts, fills = [], [], [], [], []
    for image, mask in zip(erased, masks):
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        height, width = int(rows[-1] - rows[0] + 1), int(cols[-1] - cols[0] + 1)
        areas.append(mask.float().mean().item())
        aspects.append(math.log(height / width))
        tops.append(int(rows[0]))
        lefts.append(int(cols[0]))
        fills.append(image[:, mask])
    fill = torch.cat(fills, 1) if fills else torch.zeros(3, 0)
    statistics = dict(erased=len(erased) / len(images), areas=np.array(areas), log_aspects=np.array(aspects))
    statistics.update(mean_area=float(np.mean(areas)), mean_top=float(np.mean(tops)), mean_left=float(np.mean(lefts)))
    return dict(statistics, fill_mean=fill.mean().item(), fill_std=fill.std().item())


def compare_random_erasing(draws: int = 2000, size: int = 32, probability: float = 0.5) -> list[dict]:
    """hf-vit's `RandomErasing` against timm's over `draws` images: the same statistics of each, side by side."""
    import random

    from scipy.stats import ks_2samp
    from timm.data.random_erasing import RandomErasing as TimmErasing

    from hf_vit.data.augment.random_erasing import RandomErasing

    rows = []
    for mode, count in (("pixel", 1), ("pixel", 3), ("rand", 1)):
        random.seed(0)
        torch.manual_seed(0)
        theirs = _erasing_statistics(TimmErasing(probability, mode=mode, max_count=count, device="cpu"), draws, size)
        generator = torch.Generator().manual_seed(0)
        ours = _erasing_statistics(RandomErasing(probability, mode, count), draws, size, generator=generator)
        n, m = len(ours["areas"]), len(theirs["areas"])
        critical = 1.95 * math.sqrt((n + m) / (n * m))  # the KS distance's critical value at the 0.1% level
        share_sd = math.sqrt(probability * (1 - probability) * 2 / draws)
        paired = ("erased", "mean_area", "mean_top", "mean_left", "fill_mean", "fill_std")
        row = dict(mode=mode, count=count, ks_critical=critical, **{key: (ours[key], theirs[key]) for key in paired})
        row["ks_area"] = float(ks_2samp(ours["areas"], theirs["areas"]).statistic)
        # with several rectangles the bounding box of their union says little about one rectangle's aspect
        row["ks_log_aspect"] = (
            float(ks_2samp(ours["log_aspects"], theirs["log_aspects"]).statistic) if count == 1 else None
        )
        row["within"] = bool(
            abs(ours["erased"] - theirs["erased"]) < 4 * share_sd
            and row["ks_area"] < critical
            and (row["ks_log_aspect"] is None or row["ks_log_aspect"] < critical)
        )
        rows.append(row)
        aspect = "" if row["ks_log_aspect"] is None else f", KS log aspect {row['ks_log_aspect']:.3f}"
        print(
            f"random erasing {mode} count<={count}, {draws} draws of {size}x{size} at p={probability} "
            f"(hf-vit / timm): erased {ours['erased']:.3f} / {theirs['erased']:.3f}, mean erased area "
            f"{ours['mean_area']:.4f} / {theirs['mean_area']:.4f}, KS area {row['ks_area']:.3f}{aspect} "
            f"(critical {critical:.3f}), mean top {ours['mean_top']:.2f} / {theirs['mean_top']:.2f}, mean left "
            f"{ours['mean_left']:.2f} / {theirs['mean_left']:.2f}, fill mean {ours['fill_mean']:.3f} / "
            f"{theirs['fill_mean']:.3f}, fill std {ours['fill_std']:.3f} / {theirs['fill_std']:.3f}: "
            f"{'within' if row['within'] else 'OUTSIDE'} tolerance"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", type=Path, help="folder to write the timm NaFlexViT fixtures into")
    parser.add_argument("--resample", action="store_true", help="compare the patch-embedding resampling with timm's")
    parser.add_argument("--erasing", action="store_true", help="compare random erasing's statistics with timm's")
    args = parser.parse_args(argv)
    if not args.fixtures and not args.resample and not args.erasing:
        parser.error("give --fixtures DIR, --resample and/or --erasing")
    torch.set_num_threads(1)
    if args.fixtures:
        for seed, name in enumerate(FIXTURES):
            record = write_fixture(args.fixtures / name, name, seed)
            print(f"fixture {args.fixtures / name}: {record['architecture']}, NaFlex grids {record['naflex_grids']}")
    if args.resample:
        compare_resampling()
    return 1 if args.erasing and not all(row["within"] for row in compare_random_erasing()) else 0


if __name__ == "__main__":
    sys.exit(main())
