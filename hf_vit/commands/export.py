"""Export an hf-vit model for deployment: an ONNX file (checked with onnxruntime against PyTorch) or a torch.export
program (.pt2). The graph takes any batch size and any image size divisible by the patch size; the position
embeddings are resampled inside it.

    hf-vit-export --model outputs/main --format onnx --output vit-digits.onnx
    hf-vit-export --model outputs/main --format torch_export --output vit-digits.pt2
    hf-vit-export --model outputs/main --max_num_patches 256 --output vit-native.onnx

With --max_num_patches K the graph takes the image processor's native-aspect batches (max_num_patches): pixel_values
(batch, patches, patch * patch * channels) float32, pixel_attention_mask (batch, patches) int32 and spatial_shapes
(batch, 2) int64, any batch and any number of patches, each image's grid read from spatial_shapes; it is traced at K
patches and checked with onnxruntime at K and at a smaller and a larger count.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from transformers.utils import logging as transformers_logging

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerModel
from hf_vit.commands import CommandParser
from hf_vit.export import FORMATS, check_export_output, check_onnx, export
from hf_vit.flags import error_status


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser("hf-vit-export", __doc__)
    parser.add_argument("--model", required=True, help="hf-vit folder to export")
    parser.add_argument("--format", default="onnx", choices=FORMATS)
    parser.add_argument("--output", required=True, help="file to write (.onnx or .pt2)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    parser.add_argument(
        "--check_sizes",
        type=int,
        nargs="*",
        help="H W pairs onnxruntime is checked at against PyTorch (default: the model's size and a non-square one)",
    )
    parser.add_argument(
        "--max_num_patches",
        type=int,
        metavar="K",
        help="export for native-aspect batches (flattened patches, mask, grids), traced at K patches; any count after",
    )
    args = parser.parse_args(argv)
    if args.check_sizes is not None and len(args.check_sizes) % 2:
        parser.error("--check_sizes takes pairs: H W [H W ...]")
    if args.max_num_patches is not None and args.check_sizes is not None:
        parser.error("--check_sizes checks whole images: with --max_num_patches the check runs at patch counts")
    if args.max_num_patches is not None and args.max_num_patches < 2:
        parser.error(f"--max_num_patches must be at least 2 patches (the count the graph is traced at), got "
                     f"{args.max_num_patches}")  # fmt: skip
    # torch.onnx needs these deep inside the export: told before anything loads
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if args.format == "onnx" and missing:
        print(
            f'error: --format onnx needs {", ".join(missing)}, not installed: pip install "hf-vit[export]" '
            "(or --format torch_export, which needs nothing more).",
            file=sys.stderr,
        )
        return 2
    try:  # before anything is loaded: the file's name and place
        check_export_output(args.output, args.format, args.model, args.overwrite)
    except (ValueError, OSError) as error:
        return error_status(error)
    transformers_logging.disable_progress_bar()  # the weights' loading bar: the command prints only its own lines
    try:
        config = VisionTransformerConfig.from_pretrained(args.model)
        is_classifier = any("ForImageClassification" in name for name in (config.architectures or []))
        model_class = VisionTransformerForImageClassification if is_classifier else VisionTransformerModel
        model = model_class.from_pretrained(args.model, attn_implementation="sdpa").eval()
        patch = config.patch_size
        pairs = list(zip(args.check_sizes[::2], args.check_sizes[1::2])) if args.check_sizes else []
        bad = [f"{h}x{w}" for h, w in pairs if h % patch or w % patch]
        if bad:  # checked before anything is written
            raise ValueError(f"--check_sizes {', '.join(bad)}: sizes must be multiples of the patch size {patch}.")
        path = export(model, args.output, args.format, overwrite=args.overwrite, max_num_patches=args.max_num_patches)
    except (OSError, ValueError) as error:
        return error_status(error)
    _report(path, model, args, pairs)
    return 0


def _report(path: Path, model, args, pairs: list[tuple[int, int]]) -> None:
    """Say what was written and, for ONNX, how far onnxruntime is from PyTorch on the sizes checked."""
    (height, width), patch, count = model.config.image_hw, model.config.patch_size, args.max_num_patches
    written = f"wrote {path}: {type(model).__name__} as {args.format}"
    if count is not None:
        print(f"{written} on native-aspect batches, dynamic batch and number of patches")
        sizes, counts = (), [count, max(2, count // 3), count * 2]
    else:
        print(f"{written}, dynamic batch, height and width")
        sizes, counts = pairs or [(height, width), (height + 2 * patch, max(patch, width - patch))], ()
    if args.format != "onnx":
        return
    differences = check_onnx(path, model, sizes, 3 if counts else 2, counts)
    print("onnxruntime vs PyTorch, largest absolute difference: "
          + ", ".join(f"{k}: {v:.1e}" for k, v in differences.items()))  # fmt: skip
