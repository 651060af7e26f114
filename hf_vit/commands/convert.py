"""Convert a checkpoint from another ViT implementation into an hf-vit folder.

hf-vit-convert --source jax --input ViT-B_16.npz --output vit-b16-in21k
hf-vit-convert --source jax --input ViT-B_16.npz --output vit-b16-384 --image_size 384
hf-vit-convert --source timm --input path/to/model.safetensors --output vit-timm
hf-vit-convert --source transformers --input path/to/google-vit --output vit-hf

jax: the authors' .npz files (google-research/vision_transformer, AugReg, big_vision names). timm: timm
VisionTransformer weights (.safetensors, a torch file, or a Hub folder with config.json). transformers: a saved
transformers ViT folder, whose config.json describes the model: --preset and --image_size are refused for it (use
hf-vit-resize on the converted folder to change its resolution).

--preset checks the checkpoint's sizes against a named model (e.g. vit-base-patch16-224; its resolution is not used).
--image_size converts at another resolution, resampling the position embeddings in 2D.
--base_model names the source (e.g. its Hub id) in the model card written beside the weights (default: the input's
file or folder name; never a local path).

--output is refused when it is, contains, or lies inside the input. --overwrite replaces only a folder hf-vit wrote:
an hf-vit config.json and nothing but the files hf-vit writes (weights, configs, code files, card, metrics, curves).
The new folder is written beside the old one and swapped in, so a crash leaves the old or the new one complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hf_vit.commands import CommandParser
from hf_vit.convert import (
    ConversionError,
    convert_jax_checkpoint,
    convert_timm_checkpoint,
    convert_transformers_checkpoint,
)
from hf_vit.flags import error_status

CONVERTERS = {
    "jax": convert_jax_checkpoint,
    "timm": convert_timm_checkpoint,
    "transformers": convert_transformers_checkpoint,
}


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser("hf-vit-convert", __doc__)
    parser.add_argument("--source", required=True, choices=sorted(CONVERTERS), help="layout of the input checkpoint")
    parser.add_argument("--input", required=True, help="file or folder of the checkpoint to convert")
    parser.add_argument("--output", required=True, help="folder to write the hf-vit checkpoint to")
    parser.add_argument("--preset", help="named model the checkpoint must match (jax, timm)")
    parser.add_argument("--image_size", type=int, help="resolution to convert at (jax, timm)")
    parser.add_argument("--overwrite", action="store_true", help="replace an output folder hf-vit wrote")
    parser.add_argument("--base_model", help="the source's Hub id, named in the model card")
    parser.add_argument(
        "--hidden_act",
        choices=["gelu_pytorch_tanh", "gelu"],
        help="jax: the MLP activation; default gelu_pytorch_tanh, the tanh GELU the authors' Flax code computes",
    )
    args = parser.parse_args(argv)
    given = " and ".join(f"--{name}" for name in ("preset", "image_size") if getattr(args, name) is not None)
    refusal = None
    if args.hidden_act is not None and args.source != "jax":
        refusal = (
            f"--hidden_act is for --source jax; {args.source} checkpoints keep the exact GELU their own models use."
        )
    elif given and args.source == "transformers":
        refusal = (
            f"{given} cannot be used with --source transformers: the folder's config.json describes the model. "
            "Convert first, then change the resolution with hf-vit-resize."
        )
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    kwargs = {"overwrite": args.overwrite, "base_model": args.base_model}
    if args.source != "transformers":
        kwargs.update(preset=args.preset, image_size=args.image_size)
    if args.hidden_act is not None:
        kwargs["hidden_act"] = args.hidden_act
    output = Path(args.output).resolve()
    try:
        model = CONVERTERS[args.source](args.input, output, **kwargs)
    except (ConversionError, OSError) as error:  # OSError: output refusals, unreadable or unwritable files
        return error_status(error)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {output}: {type(model).__name__}, {params / 1e6:.2f}M parameters")
    return 0
