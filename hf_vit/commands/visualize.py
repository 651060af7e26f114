r"""Figures of the paper's section 4.5 for an hf-vit model: what the model learned and where it attends.

    hf-vit-visualize --model outputs/main --output outputs/main/analysis
    hf-vit-visualize --model vit-b16 --image cat.jpg dog.png --output figures --image_size 384 512 --bf16

Writes to --output:
  embedding_and_attention_distance.png  the paper's Figure 7: principal components of the patch-embedding filters,
                                        position-embedding similarity, mean attention distance per head and layer
                                        (averaged over the images)
  rollout.png (rollout_1.png, ...)      the paper's Figure 6: each image and its attention rollout, 8 per figure

Pixels come from the processor saved with the model; --image_size runs at another size (position embeddings
interpolated). Without --image, --num_images digits of the test split are used.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.analysis import HEAD_FUSIONS, write_analysis_figures
from hf_vit.flags import error_status
from hf_vit.outputs.output_folders import check_outside_image_folders


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
    """The images to analyse (decoded now, so a missing or corrupt file is named before any work) and captions."""
    if args.image:
        from hf_vit.model.image_processing_vit import open_image

        images = []
        for name in args.image:
            try:
                images.append(open_image(name))
            except FileNotFoundError as error:
                raise FileNotFoundError(f"--image {name}: no such file.") from error
            except (OSError, ValueError) as error:
                raise ValueError(f"--image {name}: cannot be read as an image ({error}).") from error
        return images, [Path(name).name for name in args.image]
    from hf_vit.data.datasets import load_digits_dataset

    test = load_digits_dataset()["test"]
    test = test.select(range(min(args.num_images, len(test))))
    return list(test["image"]), [f"digit {label}" for label in test["label"]]


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser(
        VisualizeArguments, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    if args.image_size is not None and len(args.image_size) not in (1, 2):
        parser.error("--image_size takes one size (square) or two (height width)")
    if args.head_fusion not in HEAD_FUSIONS:
        parser.error(f"--head_fusion must be one of {HEAD_FUSIONS}")
    if args.num_images < 1:
        parser.error("--num_images must be at least 1")

    import sys

    try:
        import matplotlib  # noqa: F401 - the figures need it: checked before the analysis runs
    except ImportError:
        print('error: hf-vit-visualize draws with matplotlib, which is not installed: pip install "hf-vit[plot]" '
              "(or: pip install matplotlib).", file=sys.stderr)  # fmt: skip
        return 2
    try:
        check_outside_image_folders(args.output, args.image or ())
        written = _visualize(args)
    except (OSError, ValueError) as error:  # a missing model or image, a corrupt image, a size the patch cannot tile
        return error_status(error)
    print(f"wrote {len(written)} figures to {args.output}: " + ", ".join(path.name for path in written[:4]))
    return 0


def _visualize(args: VisualizeArguments) -> list[Path]:
    from hf_vit import VisionTransformerConfig

    try:
        config = VisionTransformerConfig.from_pretrained(args.model)
        processor = VisionTransformerImageProcessor.from_pretrained(args.model)
    except OSError as error:
        raise OSError(
            f"--model {args.model}: not an hf-vit model folder (or Hub id) with config.json and "
            f"preprocessor_config.json ({str(error).splitlines()[0]})"
        ) from error
    if processor.max_num_patches is not None:
        # The figures are maps over the model's square grid of patches (rollout, attention distance): a folder saved
        # by a native-aspect run (packed or not) is drawn from whole images at its size, as --image_size draws them
        # at another.
        processor = processor.with_options(max_num_patches=None, packed_sequence_length=None)
    size = None if args.image_size is None else tuple((args.image_size * 2)[:2])
    if size is not None and (size[0] % config.patch_size or size[1] % config.patch_size):
        raise ValueError(
            f"--image_size {' '.join(map(str, args.image_size))}: the model's patches are {config.patch_size}x"
            f"{config.patch_size}; pass sizes divisible by {config.patch_size}."
        )
    images, captions = load_inputs(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The classification class loads encoder-only folders too (only a head may be missing), without a load report.
    model = VisionTransformerForImageClassification.from_pretrained(args.model).eval().to(device)
    if args.bf16:
        model = model.to(torch.bfloat16)
    return write_analysis_figures(
        model,
        processor,
        images,
        args.output,
        captions=captions,
        image_size=size,
        name=Path(args.model).name,
        **{name: getattr(args, name) for name in ("head_fusion", "discard_ratio", "num_components", "batch_size")},
    )
