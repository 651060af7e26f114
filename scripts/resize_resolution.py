#!/usr/bin/env python
r"""Make a resolution variant of an hf-vit model: position embeddings resampled in 2D (bicubic by default), config and
processor set to the new size, so it runs there without `interpolate_pos_encoding`.

    python scripts/resize_resolution.py --model outputs/main --image_size 36 --output outputs/main-36
    python scripts/resize_resolution.py --model vit-224 --image_size 384 512 --output vit-384x512 \
        --push_to_hub --hub_model_id my-org/vit-384x512
"""

from __future__ import annotations

import argparse
import sys

from hf_vit.hub import push_folder_to_hub
from hf_vit.resolution import MODES, make_resolution_variant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="hf-vit folder to start from")
    parser.add_argument("--image_size", required=True, type=int, nargs="+", help="N, or H W for non-square")
    parser.add_argument("--output", required=True, help="folder to write the variant to")
    parser.add_argument("--interpolation", default="bicubic", choices=MODES)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    parser.add_argument("--push_to_hub", action="store_true", help="push the variant to the Hub")
    parser.add_argument("--hub_model_id", help="<user or org>/<name> to push to")
    parser.add_argument("--hub_private_repo", action="store_true")
    parser.add_argument("--hub_token", default=None)
    args = parser.parse_args(argv)
    if len(args.image_size) not in (1, 2):
        parser.error("--image_size takes N or H W")
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id <user or org>/<name>")
    size = args.image_size[0] if len(args.image_size) == 1 else args.image_size
    try:
        model, _ = make_resolution_variant(args.model, size, args.output, args.interpolation, overwrite=args.overwrite)
    except (ValueError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    height, width = model.config.image_hw
    print(f"wrote {args.output}: {type(model).__name__} at {height}x{width}")
    if args.push_to_hub:
        url = push_folder_to_hub(args.output, args.hub_model_id, private=args.hub_private_repo, token=args.hub_token)
        print(f"pushed to {args.hub_model_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
