r"""NaFlex rows of the benchmark: inference on a native-aspect batch of K patches per image (mixed aspect ratios,
padded) against a square batch of the same K (the ordinary path), and against timm's NaFlexVit on the same batch with
the same weights (where timm imports; hf-vit's copy converted by `hf_vit.convert.timm_naflex` and checked against its
logits first), eager and SDPA, in alternating rounds. The model is timm's `naflexvit_base_patch16_gap` at ViT-Ti
width. `--doc` rewrites the `<!-- naflex:table -->` block of docs/benchmarks.md.

    PYTHONPATH=. $PEER/bin/python benchmarks/naflex_speed.py --doc docs/benchmarks.md
    python benchmarks/naflex_speed.py --max_num_patches 16 --batch_size 2 --repeats 1 --depth 1   # seconds
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from benchmarks.report import _markdown_table, print_table, speed_parser
from benchmarks.timing import timed_rounds
from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor

# (height, width) of the mixed batch's images: square, wide, tall, panoramic, portrait, ...
ASPECTS = [(224, 224), (160, 320), (320, 160), (120, 480), (300, 200), (200, 300), (256, 192), (180, 360)]


def timm_model(args):
    """timm's NaFlexVit (the `naflexvit_base_patch16_gap` blocks at the asked width), or None without timm."""
    try:
        import timm
    except ImportError:
        return None
    torch.manual_seed(0)
    model = timm.create_model(
        "naflexvit_base_patch16_gap", pretrained=False, num_classes=1000, embed_dim=args.width, depth=args.depth,
        num_heads=args.heads, pos_embed_grid_size=(14, 14),
    )  # fmt: skip
    return model.eval()


def hf_vit_from_timm(model, implementation: str) -> VisionTransformerForImageClassification:
    """hf-vit's copy of timm's model, through the converter that loads timm's NaFlexViT checkpoints."""
    from hf_vit.convert.timm_naflex import naflex_config, naflex_to_hf_vit_state_dict

    heads = model.blocks[0].attn.num_heads
    settings = {"architecture": "naflexvit_base_patch16_gap", "model_args": {"num_heads": heads}}
    state_dict = model.state_dict()
    config = naflex_config(state_dict, settings)
    config._attn_implementation = implementation
    ours = VisionTransformerForImageClassification(config)
    ours.load_state_dict(naflex_to_hf_vit_state_dict(state_dict, settings, config))
    return ours.eval()


def hf_vit_alone(args, implementation: str) -> VisionTransformerForImageClassification:
    torch.manual_seed(0)
    config = VisionTransformerConfig(
        image_size=224, patch_size=16, hidden_size=args.width, num_hidden_layers=args.depth,
        num_attention_heads=args.heads, intermediate_size=4 * args.width, classifier="gap", fc_norm=True,
        num_register_tokens=4, layer_scale_init_value=1e-5, use_class_token=False, num_labels=1000,
        interpolation_antialias=True, attn_implementation=implementation,
    )  # fmt: skip
    return VisionTransformerForImageClassification(config).eval()


def batches(args) -> tuple[dict, torch.Tensor, dict]:
    """The mixed-aspect native batch (hf-vit's processor), the square batch of the same K tokens per image, and the
    mixed batch as timm's NaFlex dict (patches, coordinates, validity)."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (*ASPECTS[i % len(ASPECTS)], 3), dtype=np.uint8) for i in range(args.batch_size)]
    processor = VisionTransformerImageProcessor(max_num_patches=args.max_num_patches, patch_size=16)
    native = processor(images, return_tensors="pt")
    side = math.isqrt(args.max_num_patches)
    square = torch.randn(args.batch_size, 3, side * 16, side * 16, generator=torch.Generator().manual_seed(0))
    coords = torch.zeros(args.batch_size, args.max_num_patches, 2, dtype=torch.long)
    for row, (rows, cols) in enumerate(native["spatial_shapes"].tolist()):
        grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
        coords[row, : rows * cols] = grid
    valid = torch.arange(args.max_num_patches) < native["spatial_shapes"].prod(-1)[:, None]
    return dict(native), square, {"patches": native["pixel_values"], "patch_coord": coords, "patch_valid": valid}


def fused(model, implementation: str):
    """timm's `model` with its attention as `implementation`: SDPA when fused, else its own matmul-softmax."""
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = implementation == "sdpa"
    return model


def measure(args) -> dict:
    native, square, timm_batch = batches(args)
    theirs = timm_model(args)
    fns, checks = {}, {}
    for implementation in ("eager", "sdpa"):
        ours = hf_vit_from_timm(theirs, implementation) if theirs is not None else hf_vit_alone(args, implementation)
        fns[f"hf-vit {implementation} mixed"] = lambda model=ours: model(**native)
        fns[f"hf-vit {implementation} square"] = lambda model=ours: model(square, interpolate_pos_encoding=True)
        if theirs is not None:
            with torch.no_grad():
                logits = ours(**native).logits, fused(theirs, implementation)(dict(timm_batch))
            difference = checks[implementation] = (logits[0] - logits[1]).abs().max().item()
            if difference > 1e-3:
                raise SystemExit(f"hf-vit and timm disagree on the batch ({implementation}): {difference:.2e}")
            timm_copy = fused(timm_model(args), implementation)
            timm_copy.load_state_dict(theirs.state_dict())
            fns[f"timm {implementation} mixed"] = lambda model=timm_copy: model(dict(timm_batch))
    with torch.no_grad():
        timed = timed_rounds(fns, args.steps, args.repeats)
    valid = int(native["spatial_shapes"].prod(-1).sum())
    return {
        "images_per_s": {name: args.batch_size / value for name, value in timed["seconds"].items()},
        "logits_difference": checks,
        "load_average": timed["load_average"],
        "valid_share": valid / (args.batch_size * args.max_num_patches),
        "grids": native["spatial_shapes"].tolist(),
        "threads": torch.get_num_threads(),
    }


def format_rows(result: dict, args) -> str:
    rate, rows = result["images_per_s"], []
    for implementation in ("eager", "sdpa"):
        mixed, square = rate[f"hf-vit {implementation} mixed"], rate[f"hf-vit {implementation} square"]
        timm_rate = rate.get(f"timm {implementation} mixed")
        timm_cells = [f"{timm_rate:.1f}", f"{mixed / timm_rate:.2f}x"] if timm_rate else ["-", "-"]
        rows.append([implementation, f"{mixed:.1f}", f"{square:.1f}", f"{mixed / square:.2f}x", *timm_cells])
    header = ["attention", "mixed-aspect K batch (images/s)", "square batch, same K (images/s)"]
    header += ["ratio (target >= 0.95)", "timm NaFlexVit, same batch (images/s)", "hf-vit / timm (target >= 1.0)"]
    load = result["load_average"]
    checks = ", ".join(f"{k} {v:.1e}" for k, v in result["logits_difference"].items()) or "timm absent"
    return _markdown_table(header, rows) + (
        f"\n\nViT-Ti/16 width {args.width}, depth {args.depth}, {args.heads} heads (timm's naflexvit_base_patch16_gap "
        f"blocks), batch {args.batch_size}, K = {args.max_num_patches}, fp32 inference, {result['threads']} threads; "
        f"{result['valid_share']:.0%} of the mixed batch's patches are images (the rest padding); grids "
        f"{result['grids']}. 1-minute load average {load[0]:.2f} before, {load[1]:.2f} after. Max |logits hf-vit - "
        f"timm| on the batch: {checks}."
    )


def main(argv: list[str] | None = None) -> int:
    parser = speed_parser(__doc__, "naflex", {"max_num_patches": (196, "K, a square number (default 196)")})
    args = parser.parse_args(argv)
    if math.isqrt(args.max_num_patches) ** 2 != args.max_num_patches:
        parser.error(f"--max_num_patches must be a square number (a square grid), not {args.max_num_patches}")
    print_table(format_rows(measure(args), args), args.doc, "naflex_speed.py", argv, "naflex")
    return 0


if __name__ == "__main__":
    sys.exit(main())
