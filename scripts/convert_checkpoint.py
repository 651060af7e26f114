#!/usr/bin/env python
"""Convert a checkpoint from another ViT implementation into an hf-vit folder.

python scripts/convert_checkpoint.py --source transformers --input path/to/google-vit --output vit-hf
"""

from __future__ import annotations

import argparse
import sys

from hf_vit.convert import ConversionError, convert_transformers_checkpoint

CONVERTERS = {"transformers": convert_transformers_checkpoint}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, choices=sorted(CONVERTERS), help="layout of the input checkpoint")
    parser.add_argument("--input", required=True, help="folder (or file) of the checkpoint to convert")
    parser.add_argument("--output", required=True, help="folder to write the hf-vit checkpoint to")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    args = parser.parse_args(argv)
    try:
        model = CONVERTERS[args.source](args.input, args.output, overwrite=args.overwrite)
    except (ConversionError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.output}: {type(model).__name__}, {params / 1e6:.2f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
