r"""Make a resolution variant of an hf-vit model: position embeddings resampled in 2D (bicubic by default), with
--patch_size the patch embedding too (FlexiViT's pseudo-inverse resize), config and processor set to the new sizes,
so it runs there without `interpolate_pos_encoding`.

    hf-vit-resize --model outputs/main --image_size 36 --output outputs/main-36
    hf-vit-resize --model outputs/main --patch_size 8 --output outputs/main-p8   # FlexiViT: the patch resampled
    hf-vit-resize --model outputs/native --max_num_patches 64 --output outputs/native-64   # native aspect ratio
    hf-vit-resize --model vit-224 --image_size 384 512 --output vit-384x512 \
        --push_to_hub --hub_model_id my-org/vit-384x512 --base_model my-org/vit-224 --dataset_name digits

The variant carries a model card naming its base model (--base_model, a Hub id; default: the folder's name) and what
was changed; with --dataset_name its accuracy is measured (no training) on the test split, else the validation split
(the source's, or the images the run that trained --model held out: its splits travel with the variant, so
hf-vit-evaluate --split validation on the variant measures them too), reported in the card and in all_results.json.

A native-aspect model (its processor has max_num_patches) resizes each image to the largest grid of at most that many
patches, whatever the image size: it is resized by --max_num_patches, and --image_size is refused there.

--output is refused when it is, contains, or lies inside --model. --overwrite replaces only a folder hf-vit wrote (an
hf-vit config.json and nothing but the files hf-vit writes), as hf-vit-convert does (see `hf-vit-convert --help`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_vit.commands import CommandParser
from hf_vit.flags import error_status
from hf_vit.metrics import few_images_warning, images_text
from hf_vit.model.resolution import MODES
from hf_vit.outputs.push import push_folder_to_hub
from hf_vit.variants import make_resolution_variant


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser("hf-vit-resize", __doc__)
    parser.add_argument("--model", required=True, help="hf-vit folder to start from")
    parser.add_argument("--image_size", type=int, nargs="+", help="N, or H W for non-square (default: the model's)")
    parser.add_argument(
        "--patch_size",
        type=int,
        help="a new patch size: the patch embedding is resampled by FlexiViT's pseudo-inverse resize, the position "
        "grid follows (default: the model's)",
    )
    parser.add_argument(
        "--max_num_patches",
        type=int,
        help="serve native-aspect images of at most this many patches (a native-aspect model's size)",
    )
    parser.add_argument("--output", required=True, help="folder to write the variant to")
    parser.add_argument("--interpolation", default="bicubic", choices=MODES)
    parser.add_argument("--overwrite", action="store_true", help="replace an output folder hf-vit wrote")
    parser.add_argument("--base_model", help="Hub id of --model, named in the card")
    parser.add_argument(
        "--dataset_name",
        help="measure accuracy on this data set (e.g. digits): test split, else validation",
    )
    parser.add_argument("--push_to_hub", action="store_true", help="push the variant to the Hub")
    parser.add_argument("--hub_model_id", help="<user or org>/<name> to push to")
    parser.add_argument("--hub_private_repo", action="store_true")
    parser.add_argument("--hub_token")
    args = parser.parse_args(argv)
    if args.image_size is None and args.patch_size is None and args.max_num_patches is None:
        parser.error("give --image_size, --patch_size or --max_num_patches: the size(s) of the variant")
    if args.image_size is not None and len(args.image_size) not in (1, 2):
        parser.error("--image_size takes N or H W")
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id <user or org>/<name>")
    size = None if args.image_size is None else args.image_size[0] if len(args.image_size) == 1 else args.image_size
    data_source = None
    if args.dataset_name:
        from hf_vit.data.datasets import DataSource

        data_source = DataSource(dataset_name=args.dataset_name)
    output = Path(args.output).resolve()
    try:
        model, processor = make_resolution_variant(
            args.model, size, output, args.interpolation, overwrite=args.overwrite,
            base_model=args.base_model, repo_id=args.hub_model_id, data_source=data_source, patch_size=args.patch_size,
            max_num_patches=args.max_num_patches,
        )  # fmt: skip
    except (ValueError, OSError) as error:  # OSError: output refusals, missing or unwritable folders
        return error_status(error)
    height, width = model.config.image_hw
    patch, budget = model.config.patch_size, processor.max_num_patches
    served = f"at most {budget} patches of {patch}x{patch} per image" if budget else f"at {height}x{width}"
    print(f"wrote {output}: {type(model).__name__} {served}, patch {patch}")
    if data_source is not None:
        metrics = json.loads((output / "all_results.json").read_text())
        split, count = metrics.get("eval_split", "test"), metrics.get("eval_samples")
        name = "accuracy" if "eval_accuracy" in metrics else "mean_average_precision"  # multi-label: mAP
        figure = f"{metrics[f'eval_{name}']:.4f}, on {images_text(count)}"
        print(f"{split} {name} on {args.dataset_name} as interpolated: {figure}")
        if few := few_images_warning(count):
            print(f"warning: {few}", file=sys.stderr)
    if args.push_to_hub:
        try:
            url = push_folder_to_hub(output, args.hub_model_id, private=args.hub_private_repo, token=args.hub_token)
        except (ValueError, OSError) as error:  # refusals: a symlink, a text file naming a local path
            print(f"error: the variant was written, but not pushed: {error}", file=sys.stderr)
            return 2
        print(f"pushed to {args.hub_model_id}: {url}")
    return 0
