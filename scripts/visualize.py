#!/usr/bin/env python
r"""Figures of the paper's section 4.5 for an hf-vit model: what the model learned and where it attends.

    python scripts/visualize.py --model outputs/main --output outputs/main/analysis
    python scripts/visualize.py --model vit-b16 --image cat.jpg dog.png --output figures --image_size 384 512 --bf16

Writes to --output:
  embedding_and_attention_distance.png  the paper's Figure 7: principal components of the patch-embedding filters,
                                        position-embedding similarity, mean attention distance per head and layer
                                        (averaged over the images)
  rollout.png (rollout_1.png, ...)      the paper's Figure 6: each image and its attention rollout, 8 per figure

Pixels come from the processor saved with the model; --image_size runs at another size (position embeddings
interpolated). Without --image, --num_images digits of the test split are used.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.analysis import (
    HEAD_FUSIONS,
    attention_summary,
    components_as_images,
    patch_embedding_components,
    position_embedding_similarity,
    upsample_maps,
)
from hf_vit.plotting import plot_attention_rollout, plot_embedding_analysis

IMAGES_PER_FIGURE = 8


@dataclass
class VisualizeArguments:
    model: str = field(metadata={"help": "hf-vit model folder (or Hub id) with its preprocessor_config.json"})
    output: str = field(metadata={"help": "folder for the PNG figures (created if missing)"})
    image: list[str] | None = field(default=None, metadata={"help": "image files; default: digits of the test split"})
    num_images: int = field(default=8, metadata={"help": "digits to use when no --image is given"})
    image_size: list[int] | None = field(default=None, metadata={"help": "N, or H W: run at this size"})
    bf16: bool = field(default=False, metadata={"help": "run the model in bfloat16"})
    head_fusion: str = field(default="mean", metadata={"help": f"rollout head fusion, one of {HEAD_FUSIONS}"})
    discard_ratio: float = field(default=0.0, metadata={"help": "rollout: weakest fraction of attention dropped"})
    num_components: int = field(default=28, metadata={"help": "principal components of the filters shown"})
    batch_size: int = field(default=32, metadata={"help": "images per forward"})


def load_inputs(args: VisualizeArguments) -> tuple[list, list[str]]:
    """The images to analyse and their captions."""
    if args.image:
        return list(args.image), [Path(name).name for name in args.image]
    from hf_vit.data import load_digits_dataset

    test = load_digits_dataset()["test"].select(range(args.num_images))
    return list(test["image"]), [f"digit {label}" for label in test["label"]]


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser(VisualizeArguments, description=__doc__)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    if args.image_size is not None and len(args.image_size) not in (1, 2):
        parser.error("--image_size takes one size (square) or two (height width)")
    if args.head_fusion not in HEAD_FUSIONS:
        parser.error(f"--head_fusion must be one of {HEAD_FUSIONS}")
    if args.num_images < 1:
        parser.error("--num_images must be at least 1")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The classification class loads encoder-only folders too (only a head may be missing), without a load report.
    model = VisionTransformerForImageClassification.from_pretrained(args.model).eval().to(device)
    if args.bf16:
        model = model.to(torch.bfloat16)
    processor = VisionTransformerImageProcessor.from_pretrained(args.model)
    config = model.config
    size = None if args.image_size is None else (args.image_size * 2)[:2]
    interpolate = size is not None and tuple(size) != config.image_hw
    output = Path(args.output)

    images, captions = load_inputs(args)
    shown, maps, distances = [], [], []
    for start in tqdm(range(0, len(images), args.batch_size), desc="images", unit="batch"):
        batch = images[start : start + args.batch_size]
        options = {} if size is None else {"size": {"height": size[0], "width": size[1]}, "do_center_crop": False}
        pixel_values = processor(batch, return_tensors="pt", **options)["pixel_values"]
        summary = attention_summary(model, pixel_values, args.head_fusion, args.discard_ratio, interpolate)
        maps.append(upsample_maps(summary.rollout, pixel_values.shape[-2:]))
        shown.append(displayable(pixel_values, processor))
        distances.append(summary.mean_distances)
    shown, maps = torch.cat(shown), torch.cat(maps)
    distances = torch.cat(distances).mean(dim=0)  # (layers, heads), over all images

    components = patch_embedding_components(model, args.num_components).components
    height, width = shown.shape[1:3]
    written = [
        plot_embedding_analysis(
            components_as_images(components),
            position_embedding_similarity(model),
            distances,
            output / "embedding_and_attention_distance.png",
            patch_size=config.patch_size,
            title=f"{Path(args.model).name}: {len(images)} images at {height}x{width}",
        )
    ]
    pages = range(0, len(images), IMAGES_PER_FIGURE)
    for page, start in enumerate(pages, start=1):
        name = "rollout.png" if len(pages) == 1 else f"rollout_{page}.png"
        end = start + IMAGES_PER_FIGURE
        written.append(
            plot_attention_rollout(
                shown[start:end],
                maps[start:end],
                output / name,
                captions=captions[start:end],
                title=f"attention rollout ({args.head_fusion} over heads)",
            )
        )
    print(f"wrote {len(written)} figures to {output}: " + ", ".join(path.name for path in written[:4]))
    return 0


def displayable(pixel_values: torch.Tensor, processor: VisionTransformerImageProcessor) -> torch.Tensor:
    """Processed pixels back to `(B, H, W, 3)` in [0, 1]: the image exactly as the model saw it."""
    values = pixel_values.float()
    if processor.do_normalize:
        mean = torch.tensor(processor.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(processor.image_std, dtype=torch.float32).view(1, -1, 1, 1)
        values = values * std + mean
    if values.shape[1] != 3:
        values = values[:, :1].expand(-1, 3, -1, -1)
    return values.clamp(0, 1).permute(0, 2, 3, 1)


if __name__ == "__main__":
    sys.exit(main())
