r"""SimMIM row of the benchmark: a training step of hf-vit's `VisionTransformerForMaskedImageModeling` against
transformers' `ViTForMaskedImageModeling` with the same weights (checked to give its loss and reconstruction first),
on the same batch and mask, eager and SDPA, in alternating rounds. `--doc` rewrites the `<!-- simmim:table -->` block.

    python benchmarks/simmim_speed.py --doc docs/benchmarks.md
    python benchmarks/simmim_speed.py --image_size 32 --depth 1 --batch_size 2 --repeats 1   # seconds
"""

from __future__ import annotations

import copy
import functools
import sys
import tempfile

import torch
from transformers import ViTConfig, ViTForMaskedImageModeling

from benchmarks.report import _markdown_table, print_table, speed_parser
from benchmarks.timing import timed_rounds
from hf_vit import VisionTransformerForMaskedImageModeling


def the_two_models(args) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' SimMIM model at random, and hf-vit's converted from its saved folder."""
    config = ViTConfig(
        image_size=args.image_size, patch_size=args.patch_size, encoder_stride=args.patch_size, hidden_size=args.width,
        num_hidden_layers=args.depth, num_attention_heads=args.heads, intermediate_size=4 * args.width,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = ViTForMaskedImageModeling(config)
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = VisionTransformerForMaskedImageModeling.from_pretrained(folder)
    return theirs.train(), ours.train()


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    theirs, ours = the_two_models(args)
    generator = torch.Generator().manual_seed(1)
    grid = (args.image_size // args.patch_size) ** 2
    batch = {
        "pixel_values": torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator),
        "bool_masked_pos": torch.rand(args.batch_size, grid, generator=generator) < 0.6,
    }
    with torch.no_grad():
        expected, found = theirs(**batch), ours(**batch)
    difference = {
        "loss": abs(expected.loss.item() - found.loss.item()),
        "reconstruction": (expected.reconstruction - found.reconstruction).abs().max().item(),
    }
    steps = {}
    for implementation in ("eager", "sdpa"):
        for name, model in (("transformers", theirs), ("hf-vit", ours)):
            copied = copy.deepcopy(model)
            copied.set_attn_implementation(implementation)
            optimizer = torch.optim.AdamW(copied.parameters(), lr=1e-4)
            steps[f"{name} {implementation}"] = functools.partial(training_step, copied, optimizer, batch)
    timed = timed_rounds(steps, args.steps, args.repeats)  # after a warm-up: the optimizer's state
    return {
        "steps_per_s": {name: 1.0 / value for name, value in timed["seconds"].items()},
        "difference": difference,
        "load_average": timed["load_average"],
        "threads": torch.get_num_threads(),
    }


def format_rows(result: dict, args) -> str:
    rate, rows = result["steps_per_s"], []
    for implementation in ("eager", "sdpa"):
        theirs, ours = rate[f"transformers {implementation}"], rate[f"hf-vit {implementation}"]
        rows.append([implementation, f"{theirs:.2f}", f"{ours:.2f}", f"{ours / theirs:.2f}x"])
    header = ["attention", "transformers ViTForMaskedImageModeling (steps/s)", "hf-vit SimMIM (steps/s)"]
    load, difference = result["load_average"], result["difference"]
    return _markdown_table([*header, "hf-vit / transformers (target >= 1.0)"], rows) + (
        f"\n\nWidth {args.width}, depth {args.depth}, {args.heads} heads, {args.image_size}px images, patch "
        f"{args.patch_size}, batch {args.batch_size}, 60% of the patches masked; fp32 training step (forward, loss, "
        f"backward, AdamW), {result['threads']} threads. 1-minute load average {load[0]:.2f} before, {load[1]:.2f} "
        f"after. Same weights: max |difference| loss {difference['loss']:.1e}, reconstruction "
        f"{difference['reconstruction']:.1e}."
    )


def main(argv: list[str] | None = None) -> int:
    threads = (None, "torch threads (default: torch's)", int)
    parser = speed_parser(__doc__, "simmim", {"image_size": (224, None), "patch_size": (16, None), "threads": threads})
    args = parser.parse_args(argv)
    if args.image_size % args.patch_size:
        parser.error(f"--image_size {args.image_size} must be a multiple of --patch_size {args.patch_size}")
    print_table(format_rows(measure(args), args), args.doc, "simmim_speed.py", argv, "simmim")
    return 0


if __name__ == "__main__":
    sys.exit(main())
