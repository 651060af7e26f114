#!/usr/bin/env python
r"""Packing rows of the benchmark: what padding costs on CPU, and what packing the images saves.

The images are at their native resolution (NaViT's setting: each a grid of between `--min_share` x K and K patches;
`--min_share` sets the padded batch's padding share: at 0.4 a quarter of its slots, at 0.95 a few percent), through
hf-vit's processor at equal patch slots: padded, B images one per row of K patches (`max_num_patches`), and packed,
whole images best-fit-decreasing into B * K / L rows of L patch slots (`packed_sequence_length`), the same images and
the next ones, as many as fit. Their attention is timed in one process, in alternating rounds
(`timing.time_alternating`), as the model runs it on CPU: through the model's attention function
(`ALL_ATTENTION_FUNCTIONS`) with each batch's `AttentionSegments`, made by the model's layout (`BatchLayout.of`, one
class token per image) from the processor's fields:

    padded + mask       one image per row, the padding masked as keys (an additive (B, 1, N, N) key mask)
    packed + mask       packed rows, a block-diagonal mask (each image's tokens see their image, the padding itself)

for inference and for a training step (forward and backward), and prints images/s and the ratios against
`padded + mask`. On CPU these are the only paths the model takes for such batches (`segment_attention_path` gives
"mask" there; variable-length attention, `varlen_attn`, is CUDA's: `gpu_packing.py`).

Then the whole model (a classifier, `--model_width`, `--model_depth`) at the same patch slots: a square batch (B
square images of exactly K patches: no padding, no mask), the padded batch (its padding masked as keys) and the packed
batch (a block-diagonal mask); eager, and under `torch.compile` (inductor; `--no_compile` leaves these rows out; no
compiled row starts compiling once `--compile_budget_s` of compilation is spent, the square rows coming last). The
layout is the processor's (`row_image_index`, `image_slot_index`) and the forward reads nothing back, so compiled and
eager take the same attention path. The images the padded and packed batches hold get the same logits, eager and
compiled, before anything is timed; each row prints its batch's padding share and its real (image) patches per
second, the fair measure at equal slots. Last, whether packed batches of the same L with other images recompile the
compiled model: frames and graphs Dynamo compiles anew for each of `--recompile_batches` such batches (Dynamo's guards
decide it whatever the backend, so this check compiles with the eager backend and costs no inductor time).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/packing_speed.py --threads 1
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/packing_speed.py --threads 1 --no_compile   # eager rows only
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/packing_speed.py --threads 1 --no_compile --min_share 0.95
                                                              # a padded batch of a few percent padding
    PYTHONPATH=. python benchmarks/packing_speed.py --quick   # seconds: a tiny batch, one sample per row, the
                                                              # compiled rows with Dynamo's eager backend
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.timing import median_seconds, time_alternating
from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.model.attention import ALL_ATTENTION_FUNCTIONS
from hf_vit.model.image_processing_vit import best_fit_decreasing
from hf_vit.model.layout import AttentionSegments, BatchLayout

PATCH = 16
ROWS = ("padded + mask", "packed + mask")
MODEL_ROWS = ("square", "padded + mask", "packed + mask")
MODES = ("inference", "training")
PATHS = {
    "square": "no mask (no padding)",
    "padded + mask": "padding masked as keys: one SDPA call",
    "packed + mask": "the model's path (CPU: each image gathered into a row of its own, padding masked as keys)",
}


class _Attention(torch.nn.Module):
    """What the attention functions read from the model's attention module."""

    is_causal = False


def native_images(args, count: int) -> list[np.ndarray]:
    """`count` images of random aspect ratio and resolution, each a whole grid of between min_share * K and K
    patches (the first ones the same for any count)."""
    rng = np.random.default_rng(args.seed)
    low = max(1, math.ceil(args.min_share * args.max_num_patches))
    images = []
    while len(images) < count:
        rows = int(rng.integers(1, args.max_num_patches + 1))
        cols = int(rng.integers(1, args.max_num_patches // rows + 1))
        if low <= rows * cols <= args.max_num_patches:
            images.append(rng.integers(0, 256, (rows * PATCH, cols * PATCH, 3), dtype=np.uint8))
    return images


def packed_count(args, sizes: list[int]) -> int:
    """How many of the images (of `sizes` patches, in order) best-fit-decreasing packs into the padded batch's
    patch slots: B * K / L rows of L."""
    rows = args.batch_size * args.max_num_patches // args.packed_sequence_length
    count = args.batch_size
    while count < len(sizes) and len(best_fit_decreasing(sizes[: count + 1], args.packed_sequence_length)) <= rows:
        count += 1
    return count


def segments_of(batch: dict, prefix: int = 1) -> AttentionSegments:
    """The attention runs the model gives a processed batch (`BatchLayout.of` with `prefix` tokens per image: the
    class token): the blocks' rows, each image's tokens a run, each row's padding its own."""
    fields = ("pixel_attention_mask", "patch_image_index", "patch_positions", "row_image_index", "image_slot_index")
    extra = {name: batch.get(name) for name in fields}
    return BatchLayout.of(batch["pixel_values"], batch["spatial_shapes"], prefix, **extra).segments


def layouts(args) -> dict[str, dict]:
    """Per layout ("padded", "packed"): each row's images, its runs of tokens (class token + patches per image), the
    rows' length in tokens and the attention segments the model makes of it, from hf-vit's processor. At equal patch
    slots: the padded batch is B images in B rows of K slots, the packed one the same images and the next ones, as
    many as fill B * K / L rows of L."""
    processor = VisionTransformerImageProcessor(
        max_num_patches=args.max_num_patches, patch_size=PATCH, do_resize=False
    )
    images = native_images(args, 4 * args.batch_size)
    sizes = processor(images, return_tensors="pt")["spatial_shapes"].prod(1).tolist()
    count = packed_count(args, sizes)
    padded = dict(processor(images[: args.batch_size], return_tensors="pt"))
    packed = dict(processor(images[:count], packed_sequence_length=args.packed_sequence_length, return_tensors="pt"))
    packed_rows = [[i for i in row if i >= 0] for row in packed["row_image_index"].tolist()]
    result = {
        "padded": {
            "images": [[index] for index in range(args.batch_size)],
            "runs": [[1 + size] for size in sizes[: args.batch_size]],
            "segments": segments_of(padded),
            "slots": padded["pixel_attention_mask"].numel(),
            "padding": 1 - sum(sizes[: args.batch_size]) / padded["pixel_attention_mask"].numel(),
        },
        "packed": {
            "images": packed_rows,
            "runs": [[1 + sizes[i] for i in row] for row in packed_rows],
            "segments": segments_of(packed),
            "slots": packed["pixel_attention_mask"].numel(),
            "padding": 1 - sum(sizes[:count]) / packed["pixel_attention_mask"].numel(),
        },
        "sizes": sizes[:count],
        "inputs": {"padded": padded, "packed": packed},
    }
    for name in ("padded", "packed"):  # the rows' tokens: K + 1 padded, L + a class token per image of the fullest
        result[name]["length"] = result[name]["segments"].row_length
    return result


def placements(layout: dict) -> list[tuple[int, int, int, int]]:
    """(image, row, first token, tokens) of every image of a layout."""
    placed = []
    for row, (images, runs) in enumerate(zip(layout["images"], layout["runs"])):
        start = 0
        for image, length in zip(images, runs):
            placed.append((image, row, start, length))
            start += length
    return sorted(placed)


def inputs_for(layout: dict, tokens: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A (B, N, 3, heads, d_h) buffer, as the model's qkv projection leaves it, holding each image's `tokens` where
    the layout puts them (zeros on the padding), and its (B, heads, N, d_h) views."""
    buffer = tokens[0].new_zeros(len(layout["runs"]), layout["length"], *tokens[0].shape[1:])
    for image, row, start, length in placements(layout):
        buffer[row, start : start + length] = tokens[image]
    return buffer, [part.transpose(1, 2) for part in buffer.unbind(2)]


def measure(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    shapes = layouts(args)
    sdpa = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
    module, scaling = _Attention().eval(), (args.width // args.heads) ** -0.5
    generator = torch.Generator().manual_seed(args.seed)
    # the model's attention function takes the segments in place of a mask and masks them as the model does on CPU
    masks = {name: shapes[name.split()[0]]["segments"] for name in ROWS}
    head_dim = args.width // args.heads
    tokens = [torch.randn(1 + size, 3, args.heads, head_dim, generator=generator) for size in shapes["sizes"]]
    inputs = {name: inputs_for(shapes[name.split()[0]], tokens) for name in ROWS}
    # The rows compute the same function: the images they share have the same outputs before anything is timed.
    reference, difference = None, 0.0
    for name in ROWS:
        output, _ = sdpa(module, *inputs[name][1], masks[name], scaling=scaling)
        placed = placements(shapes[name.split()[0]])[: args.batch_size]
        per_image = [output[row, start : start + length] for _, row, start, length in placed]
        reference = reference or per_image
        difference = max([difference] + [(a - b).abs().max().item() for a, b in zip(per_image, reference)])
    if difference > 1e-4:
        raise SystemExit(f"The attention rows disagree on the images' outputs: {difference:.2e}")
    fns = {}
    for name in ROWS:
        buffer, (query, key, value) = inputs[name]
        trainable = buffer.clone().requires_grad_()
        parts = [part.transpose(1, 2) for part in trainable.unbind(2)]

        def infer(q=query, k=key, v=value, mask=masks[name]):
            with torch.no_grad():
                sdpa(module, q, k, v, mask, scaling=scaling)

        def train(parts=parts, mask=masks[name], buffer=trainable):
            output, _ = sdpa(module, *parts, mask, scaling=scaling)
            output.sum().backward()
            buffer.grad = None

        fns[f"{name} | inference"] = infer
        fns[f"{name} | training"] = train
    for fn in fns.values():  # warm-up
        fn()
    load_before = os.getloadavg()
    samples = time_alternating(fns, args.steps, args.repeats, torch.device("cpu"))
    load_after = os.getloadavg()
    seconds = {name: median_seconds(sample) for name, sample in samples.items()}
    padded, packed = shapes["padded"], shapes["packed"]
    count = {"padded": args.batch_size, "packed": len(shapes["sizes"])}
    return {
        "images_per_s": {name: count[name.split()[0]] / value for name, value in seconds.items()},
        "model": measure_model(args, shapes) if args.model_depth else None,
        "images": count,
        "padding_share": {"padded": padded["padding"], "packed": packed["padding"]},
        "rows": {"padded": len(padded["runs"]), "packed": len(packed["runs"])},
        "max_difference": difference,
        "load_average": [load_before[0], load_after[0]],
        "threads": torch.get_num_threads(),
    }


def square_batch(args) -> dict:
    """B square images of exactly K patches each (K a square number), through the same processor: no padding."""
    side = math.isqrt(args.max_num_patches)
    rng = np.random.default_rng(args.seed)
    images = [rng.integers(0, 256, (side * PATCH, side * PATCH, 3), dtype=np.uint8) for _ in range(args.batch_size)]
    processor = VisionTransformerImageProcessor(max_num_patches=side * side, patch_size=PATCH, do_resize=False)
    return dict(processor(images, return_tensors="pt"))


def measure_model(args, shapes: dict) -> dict:
    """The whole classifier on the square, padded and packed batches, eager and compiled, timed in alternating rounds
    (one call per sample): per row its attention path, padding share, images and real patches per call, seconds per
    inference call and per training step (forward, loss, backward), and the first (compiling) call's seconds."""
    torch.manual_seed(args.seed)
    config = VisionTransformerConfig(
        image_size=math.isqrt(args.max_num_patches) * PATCH, patch_size=PATCH, hidden_size=args.model_width,
        num_hidden_layers=args.model_depth, num_attention_heads=args.model_heads,
        intermediate_size=4 * args.model_width, num_labels=10, zero_init_head=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = VisionTransformerForImageClassification(config).train()
    inputs = {"square": square_batch(args), **shapes["inputs"]}
    sizes = shapes["sizes"]
    batch = {  # per layout: images, real patches, the share of the patch slots that is padding
        "square": (args.batch_size, args.batch_size * args.max_num_patches, 0.0),
        "padded": (args.batch_size, sum(sizes[: args.batch_size]), shapes["padded"]["padding"]),
        "packed": (len(sizes), sum(sizes), shapes["packed"]["padding"]),
    }
    labels = {name: torch.zeros(len(value["spatial_shapes"]), dtype=torch.long) for name, value in inputs.items()}
    variants = {"eager": (model, MODEL_ROWS)}
    if not args.no_compile:
        variants["compiled"] = (torch.compile(model, backend=args.compile_backend), MODEL_ROWS)

    def logits_of(runner, name: str) -> torch.Tensor:
        with torch.no_grad():
            return runner.eval()(**inputs[name.split()[0]]).logits

    # The padded and packed rows give the images they share the same logits; eager and compiled agree on every batch.
    eager = {name: logits_of(model, name) for name in MODEL_ROWS}
    shared = [eager[name][: args.batch_size] for name in MODEL_ROWS[1:]]
    difference = max((value - shared[0]).abs().max().item() for value in shared)
    if difference > 1e-4:
        raise SystemExit(f"The model rows disagree on the images' logits: {difference:.2e}")
    fns, first_call, skipped, compiled_difference = {}, {}, {}, 0.0
    calls = []  # the compiled rows square last: a compile budget spent leaves out the square rows first
    for variant, (runner, rows) in variants.items():
        for group in ([name for name in rows if name != "square"], [name for name in rows if name == "square"]):
            calls += [(variant, runner, mode, name) for mode in MODES for name in group]
    for variant, runner, mode, name in calls:
        key = f"{name} | {variant} | {mode}"
        layout = name.split()[0]
        spent = sum(seconds for call, seconds in first_call.items() if " | compiled | " in call)
        if variant == "compiled" and spent > args.compile_budget_s:
            skipped[key] = f"not compiled, {spent:.0f} s of compilation spent (--compile_budget_s)"
            continue

        def infer(runner=runner, batch=inputs[layout]):
            with torch.no_grad():
                runner.eval()(**batch)

        def train(runner=runner, batch=inputs[layout], labels=labels[layout]):
            runner.train()(**batch, labels=labels).loss.backward()
            model.zero_grad(set_to_none=True)

        fn = infer if mode == "inference" else train
        begin = time.perf_counter()
        fn()  # warm-up; compiled: the compilation
        first_call[key] = time.perf_counter() - begin
        if variant == "compiled" and mode == "inference":
            difference_here = (logits_of(runner, name) - eager[name]).abs().max().item()
            compiled_difference = max(compiled_difference, difference_here)
        fns[key] = fn
    if compiled_difference > 1e-3:
        raise SystemExit(f"The compiled model's logits differ from the eager model's by {compiled_difference:.2e}")
    samples = time_alternating(fns, args.model_steps, args.repeats, torch.device("cpu"))
    rows = {}
    for variant, (_, names) in variants.items():
        for name in names:
            images, patches, padding = batch[name.split()[0]]
            row = {"path": PATHS[name], "padding": padding, "images": images, "patches": patches, "first_call_s": {}}
            for mode in MODES:
                key = f"{name} | {variant} | {mode}"
                if key in samples:
                    row[f"{mode}_s"], row["first_call_s"][mode] = median_seconds(samples[key]), first_call[key]
            rows[f"{name} | {variant}"] = row
    return {
        "rows": rows,
        "skipped": skipped,
        "max_difference": difference,
        "compiled_difference": compiled_difference if "compiled" in variants else None,
        "recompiles": recompile_check(args, model) if "compiled" in variants and args.recompile_batches > 1 else None,
    }


def recompile_check(args, model: torch.nn.Module) -> list[dict]:
    """Whether packed batches of the same L holding other images recompile the compiled model: a fresh Dynamo cache,
    the model compiled with the eager backend (Dynamo's guards decide recompilation whatever the backend), one
    inference call on each of `--recompile_batches` packed batches (`layouts` with seeds seed, seed + 1, ...); per
    batch after the first, the frames Dynamo compiled again (by file) and the graphs it added."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    results = []
    for index in range(args.recompile_batches):
        shape = layouts(argparse.Namespace(**{**vars(args), "seed": args.seed + index}))
        batch = shape["inputs"]["packed"]
        failures_before = {code: len(failures) for code, failures in guard_failures.items()}
        graphs_before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            compiled.eval()(**batch)
        recompiled = [code for code, seen in guard_failures.items() if len(seen) > failures_before.get(code, 0)]
        by_file: dict[str, int] = {}
        for code in recompiled:
            by_file[Path(code.co_filename).name] = by_file.get(Path(code.co_filename).name, 0) + 1
        limit = torch._dynamo.config.recompile_limit  # a frame with this many graphs runs eagerly from then on
        at_limit = sorted(
            f"{Path(code.co_filename).name}:{code.co_name}"
            for code in guard_failures
            if len(cache_entries(code)) >= limit
        )
        results.append({
            "images": len(batch["spatial_shapes"]), "rows": len(batch["pixel_values"]),
            "row_tokens": shape["packed"]["length"], "new_graphs": counters["stats"]["unique_graphs"] - graphs_before,
            "recompiled_frames": len(recompiled), "by_file": by_file, "frames_at_recompile_limit": at_limit,
        })  # fmt: skip
    torch._dynamo.reset()
    return results


def format_rows(result: dict, args) -> str:
    rate = result["images_per_s"]
    lines = [
        "| row | inference (images/s) | vs padded + mask | training step (images/s) | vs padded + mask |",
        "|---|---|---|---|---|",
    ]
    for name in ROWS:
        cells = []
        for mode in MODES:
            value, base = rate[f"{name} | {mode}"], rate[f"padded + mask | {mode}"]
            cells += [f"{value:.1f}", f"{value / base:.2f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    share, rows, load = result["padding_share"], result["rows"], result["load_average"]
    images = result["images"]
    lines += [
        "",
        f"Attention of images of {math.ceil(args.min_share * args.max_num_patches)} to {args.max_num_patches} "
        f"patches (native resolution) and a class token each, at equal patch slots: {images['padded']} images "
        f"padded into {rows['padded']} rows of K = {args.max_num_patches} ({share['padded']:.0%} padding), "
        f"{images['packed']} packed into {rows['packed']} rows of L = {args.packed_sequence_length} "
        f"({share['packed']:.0%} padding). Width {args.width}, {args.heads} heads, fp32, {result['threads']} "
        f"threads; the images the rows share have the same outputs to {result['max_difference']:.1e}. 1-minute load "
        f"average {load[0]:.2f} before, {load[1]:.2f} after.",
    ]
    if result["model"] is not None:
        lines += ["", format_model_rows(result["model"], args)]
    return "\n".join(lines)


def format_model_rows(model: dict, args) -> str:
    """The model rows: images/s and real patches/s (the ratio is of real patches/s against padded + mask of the same
    variant, eager or compiled), the padding share, the first call's seconds; compiled against eager; recompiles."""
    rows = model["rows"]
    lines = [
        "| model row | attention | padding | inference images/s | patches/s | vs padded + mask | training step "
        "images/s | patches/s | vs padded + mask | first call (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        name, variant = key.split(" | ")
        base = rows.get(f"padded + mask | {variant}")
        cells = [f"model: {name} ({variant})", row["path"], f"{row['padding']:.0%}"]
        for mode in MODES:
            seconds = row.get(f"{mode}_s")
            if seconds is None:
                cells += ["-", "-", "-"]
                continue
            patches = row["patches"] / seconds
            base_seconds = None if base is None else base.get(f"{mode}_s")
            ratio = "-" if base_seconds is None else f"{patches / (base['patches'] / base_seconds):.2f}x"
            cells += [f"{row['images'] / seconds:.1f}", f"{patches:.0f}", ratio]
        first = row["first_call_s"]
        compiled = variant == "compiled"
        cells.append(" / ".join(f"{first[mode]:.1f}" if mode in first else "-" for mode in MODES) if compiled else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Model rows: a classifier of width {args.model_width}, {args.model_depth} blocks, {args.model_heads} heads, "
        f"SDPA, fp32, at equal patch slots (square: {args.batch_size} images of exactly K = {args.max_num_patches} "
        "patches); a training step is forward, loss, backward; one call per timed sample, all rows alternating. "
        '"vs padded + mask" is of real patches/s, against the same variant\'s padded + mask row; "first call" is a '
        "compiled row's inference / training (the compilation). The padded and packed rows' shared images have the "
        f"same logits to {model['max_difference']:.1e}.",
    ]
    if model["compiled_difference"] is not None:
        backend = args.compile_backend
        lines[-1] += f" Compiled: torch.compile(backend={backend!r}), logits within {model['compiled_difference']:.1e}"
        ratios = [
            f"{name} {mode} {rows[f'{name} | eager'][f'{mode}_s'] / rows[f'{name} | compiled'][f'{mode}_s']:.2f}x"
            for name in MODEL_ROWS
            for mode in MODES
            if f"{mode}_s" in rows.get(f"{name} | compiled", {})
        ]
        lines[-1] += f" of eager. Compiled / eager speed: {', '.join(ratios)}."
    for key, reason in model["skipped"].items():
        lines.append(f"Skipped {key}: {reason}.")
    if model["recompiles"]:
        first, *others = model["recompiles"]
        described = []
        for index, check in enumerate(others, start=2):
            files = ", ".join(f"{file} {count}" for file, count in sorted(check["by_file"].items()))
            described.append(
                f"batch {index} ({check['images']} images, rows of {check['row_tokens']} tokens): "
                f"{check['recompiled_frames']} frames recompiled, {check['new_graphs']} new graphs"
                + (f" ({files})" if files and index == 2 else "")
                + (f", {len(check['frames_at_recompile_limit'])} frames at the limit" if index > 2 else "")
            )
        recompiled = sum(check["recompiled_frames"] for check in others)
        lines.append(
            f"Recompiles: packed batches of L = {args.packed_sequence_length} holding other images, one after another "
            f"through one compiled model (inference; Dynamo's eager backend, recompile_limit "
            f"{torch._dynamo.config.recompile_limit}): batch 1 ({first['images']} images, rows of "
            f"{first['row_tokens']} tokens) compiled {first['new_graphs']} graphs; {'; '.join(described)}. "
            + ("No recompiles." if recompiled == 0 else f"{recompiled} recompiled frames in all.")
        )
        at_limit = model["recompiles"][-1]["frames_at_recompile_limit"]
        if at_limit:
            lines[-1] += f" Frames at Dynamo's recompile limit, run uncompiled from then on: {', '.join(at_limit)}."
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_num_patches", type=int, default=256, help="K, the most patches of one image")
    parser.add_argument("--packed_sequence_length", type=int, default=1024, help="L, patch slots per packed row")
    parser.add_argument("--min_share", type=float, default=0.4, help="the fewest patches of an image, as a share of K")
    parser.add_argument("--batch_size", type=int, default=32, help="images of the padded batch")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2, help="calls per timed sample")
    parser.add_argument("--repeats", type=int, default=5, help="undisturbed samples per row")
    parser.add_argument("--model_width", type=int, default=192)
    parser.add_argument("--model_depth", type=int, default=4, help="blocks of the model rows (0: no model rows)")
    parser.add_argument("--model_heads", type=int, default=3)
    parser.add_argument("--model_steps", type=int, default=1, help="calls per timed sample of the model rows")
    parser.add_argument("--no_compile", action="store_true", help="leave the compiled model rows out")
    parser.add_argument("--compile_backend", default=None, help="torch.compile's backend (default inductor)")
    parser.add_argument(
        "--compile_budget_s",
        type=float,
        default=300,
        help="no compiled row starts compiling after this many seconds of compilation",
    )
    parser.add_argument(
        "--recompile_batches", type=int, default=10, help="packed batches of the recompile check (0: no check)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="a tiny batch, one sample per row, compiled with Dynamo's eager backend"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.max_num_patches, args.packed_sequence_length, args.batch_size = 16, 32, 6
        args.width, args.heads, args.steps, args.repeats = 32, 2, 1, 1
        args.model_width, args.model_depth, args.model_heads = 32, 1, 2
        args.compile_backend, args.recompile_batches = args.compile_backend or "eager", min(args.recompile_batches, 2)
    args.compile_backend = args.compile_backend or "inductor"
    if args.batch_size * args.max_num_patches < args.packed_sequence_length:
        parser.error("--batch_size x --max_num_patches must be at least --packed_sequence_length (one packed row)")
    if args.packed_sequence_length < args.max_num_patches:
        parser.error(
            f"--packed_sequence_length ({args.packed_sequence_length}) must be at least --max_num_patches "
            f"({args.max_num_patches})"
        )
    if args.model_depth and math.isqrt(args.max_num_patches) ** 2 != args.max_num_patches:
        parser.error(f"--max_num_patches ({args.max_num_patches}) must be a square number (the model's square batch)")
    if not 0 < args.min_share <= 1:
        parser.error(f"--min_share must be in (0, 1], got {args.min_share}")
    print(format_rows(measure(args), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
