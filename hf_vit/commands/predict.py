"""Classify images with a saved model: each image's top classes with their scores (softmax; independent sigmoids for
a multi-label model), as JSON lines on stdout (one image a line), or into a .jsonl or .csv file.

hf-vit-predict --model outputs/main photo.jpg more/photos/
hf-vit-predict --model out/lora-run images/ --top_k 3 --output predictions.csv
hf-vit-predict --model outputs/main photo.jpg --max_num_patches 256 --patch_size 8

outputs/main is the model `make train` writes; after `make train QUICK=1`, outputs/quick serves the same way.
--model takes an hf-vit folder, a LoRA run's folder or a transformers/timm checkpoint by Hub id; a folder among the
images stands for every image file under it. --max_num_patches K keeps each image's aspect ratio: it is resized to the
largest grid of at most K patches (no centre crop) and the model takes the padded patches (native-aspect batches).
--patch_size P runs the checkpoint at another patch size, its patch embedding resampled (FlexiViT).
"""

from __future__ import annotations

import sys

from hf_vit.commands import CommandParser
from hf_vit.flags import error_status


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser("hf-vit-predict", __doc__)
    parser.add_argument("--model", required=True, help="hf-vit folder, LoRA run folder or Hub id")
    parser.add_argument("images", nargs="+", metavar="IMAGE_OR_FOLDER", help="image files, or folders of them")
    parser.add_argument("--top_k", type=int, default=5, help="classes per image (default 5, at most all)")
    parser.add_argument("--output", help="a new .jsonl or .csv file (default: JSON lines on stdout)")
    parser.add_argument(
        "--batch_size", type=int, default=32, help="images per forward pass (default 32; lower it if memory runs out)"
    )
    parser.add_argument("--max_num_patches", type=int, metavar="K", help="native aspect ratio: at most K patches each")
    parser.add_argument("--patch_size", type=int, metavar="P", help="the checkpoint resampled to P-pixel patches")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch_size must be at least 1, got {args.batch_size}")
    # The heavy imports (torch, transformers' models) come after the flags are read.
    import logging

    from transformers.utils import logging as transformers_logging

    from hf_vit.infer.predict import predict_files, write_predictions

    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    transformers_logging.disable_progress_bar()  # stderr keeps the warnings and errors
    try:
        rows = predict_files(
            args.model, args.images, args.top_k, args.batch_size, args.max_num_patches, args.patch_size
        )
        text = write_predictions(rows, args.output)
    except (ValueError, OSError) as error:
        return error_status(error)
    if args.output is None:
        sys.stdout.write(text)
    else:
        print(f"{len(rows)} images -> {args.output}", file=sys.stderr)
    return 0
