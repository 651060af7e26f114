r"""Packing rows of the benchmark: what padding costs on CPU, and what packing the images saves.

Images at native resolution (each a grid of between `--min_share` x K and K patches) through hf-vit's processor at
equal patch slots: padded, B images one per row of K patches (`max_num_patches`), and packed, the same images and the
next ones, whole, into B * K / L rows of L slots (`packed_sequence_length`), as many as fit. First their attention, as
the model runs it on CPU (`ALL_ATTENTION_FUNCTIONS` with the segments of the model's `BatchLayout`, a class token per
image), inference and a training step, in alternating rounds: "padded + mask" (the padding masked as keys) and
"packed + mask" (the model's packed path: on CPU each image's run attended alone). Then the whole classifier
(`--model_width`, `--model_depth`) on a square batch (B images of exactly K patches), the padded and the packed batch,
eager and under `torch.compile` (no compiled row starts once `--compile_budget_s` of compilation is spent, the square
rows last), with each row's padding share and real patches per second; the batches' shared images get the same
logits first. Last, the frames and graphs Dynamo compiles anew for each of `--recompile_batches` packed batches of
other images (eager backend: guards decide it).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/packing_speed.py --threads 1 [--no_compile] [--min_share 0.95]
    PYTHONPATH=. python benchmarks/packing_speed.py --quick   # seconds: a tiny batch, compiled with Dynamo's eager
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import sys
import types
from pathlib import Path

import numpy as np
import torch

from benchmarks.report import SPEED_FLAGS, _markdown_table
from benchmarks.settings import add_flags
from benchmarks.timing import timed_rounds
from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.model.attention import ALL_ATTENTION_FUNCTIONS
from hf_vit.model.image_processing_vit import best_fit_decreasing
from hf_vit.model.layout import BatchLayout

PATCH = 16
ROWS = ("padded + mask", "packed + mask")
MODEL_ROWS = ("square", "padded + mask", "packed + mask")
MODES = ("inference", "training")
# --quick, here and in the GPU benchmark's packing rows (`gpu_packing`): seconds on a CPU
QUICK = dict(max_num_patches=16, packed_sequence_length=32, batch_size=6, width=32, depth=1, heads=2)
PATHS = {
    "square": "no mask (no padding)",
    "padded + mask": "padding masked as keys: one SDPA call",
    "packed + mask": "the model's path (CPU: each image's run alone; compiled: each image in a row of its own)",
}


def small_classifier(max_num_patches: int, width: int, depth: int, heads: int, seed: int, patch: int = PATCH):
    """A seeded classifier (SDPA, 10 labels) of `width` and `depth` at a square grid of K patches."""
    torch.manual_seed(seed)
    config = VisionTransformerConfig(
        image_size=math.isqrt(max_num_patches) * patch, patch_size=patch, hidden_size=width, num_hidden_layers=depth,
        num_attention_heads=heads, intermediate_size=4 * width, num_labels=10, zero_init_head=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    return VisionTransformerForImageClassification(config)


def native_images(args, count: int) -> list[np.ndarray]:
    """`count` images of random aspect ratio, each a whole grid of between min_share * K and K patches (the first
    ones the same for any count)."""
    rng = np.random.default_rng(args.seed)
    low = max(1, math.ceil(args.min_share * args.max_num_patches))
    images = []
    while len(images) < count:
        rows = int(rng.integers(1, args.max_num_patches + 1))
        cols = int(rng.integers(1, args.max_num_patches // rows + 1))
        if low <= rows * cols <= args.max_num_patches:
            images.append(rng.integers(0, 256, (rows * PATCH, cols * PATCH, 3), dtype=np.uint8))
    return images


def layouts(args) -> dict[str, dict]:
    """Per layout ("square": B square images of exactly K patches; "padded": B native-resolution images, one per row
    of K slots; "packed": those and the next ones, whole, in B * K / L rows of L): the processor's batch, the model's
    `BatchLayout` of it (a class token per image), its images and real patches, its rows, their length in tokens and
    its padding share; "sizes": the packed images' patches."""
    processor = VisionTransformerImageProcessor(
        max_num_patches=args.max_num_patches, patch_size=PATCH, do_resize=False
    )
    images = native_images(args, 4 * args.batch_size)
    sizes = processor(images, return_tensors="pt")["spatial_shapes"].prod(1).tolist()
    count, rows = args.batch_size, args.batch_size * args.max_num_patches // args.packed_sequence_length
    # as many of the images as best-fit-decreasing packs into B * K / L rows of L
    while count < len(sizes) and len(best_fit_decreasing(sizes[: count + 1], args.packed_sequence_length)) <= rows:
        count += 1
    side = math.isqrt(args.max_num_patches) * PATCH
    rng = np.random.default_rng(args.seed)
    square = [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(args.batch_size)]
    packed = {"packed_sequence_length": args.packed_sequence_length}
    chosen = {"square": (square, {}), "padded": (images[: args.batch_size], {}), "packed": (images[:count], packed)}
    result = {"sizes": sizes[:count]}
    for name, (batch_images, extra) in chosen.items():
        batch = dict(processor(batch_images, return_tensors="pt", **extra))
        rows, length = batch["pixel_values"].shape[:2]  # rows of patch slots
        patches = int(batch["spatial_shapes"].prod(1).sum())
        result[name] = dict(batch=batch, layout=BatchLayout.of(prefix=1, **batch), rows=rows, length=length)
        result[name].update(images=len(batch_images), patches=patches, padding=1 - patches / (rows * length))
    return result


def layout_calls(runner, batches: dict, rows, context=contextlib.nullcontext, optimizer=None):
    """ "row | mode" -> one call of `runner` on that row's batch (the row's first word) under `context(row)`:
    inference, or a training step (forward and loss on label 0 for every image, backward, the `optimizer`'s step if
    any, gradients zeroed)."""
    fns = {}
    for row in rows:
        batch = batches[row.split()[0]]
        target = torch.zeros(len(batch["spatial_shapes"]), dtype=torch.long, device=batch["pixel_values"].device)

        def infer(batch=batch, row=row):
            with torch.no_grad(), context(row):
                runner.eval()(**batch)

        def train(batch=batch, target=target, row=row):
            with context(row):
                loss = runner.train()(**batch, labels=target).loss
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            (optimizer or runner).zero_grad(set_to_none=True)

        fns[f"{row} | inference"], fns[f"{row} | training"] = infer, train
    return fns


def views(buffer: torch.Tensor) -> list[torch.Tensor]:
    """The (rows, heads, tokens, d_h) query, key and value of a (rows, tokens, 3, heads, d_h) buffer."""
    return [part.transpose(1, 2) for part in buffer.unbind(2)]


def measure(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    shapes = layouts(args)
    sizes, head_dim = shapes["sizes"], args.width // args.heads
    sdpa = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
    module = types.SimpleNamespace(is_causal=False, training=False)  # what the attention functions read of it
    generator = torch.Generator().manual_seed(args.seed)
    tokens = [torch.randn(1 + size, 3, args.heads, head_dim, generator=generator) for size in sizes]
    fns, reference, difference = {}, None, 0.0
    for name in ROWS:
        layout = shapes[name.split()[0]]["layout"]
        # a (rows, tokens, 3, heads, d_h) buffer as the qkv projection leaves it (zero padding)
        per_image = tokens[0].new_zeros(*layout.token_mask.shape, *tokens[0].shape[1:])
        for index, image in enumerate(tokens[: len(per_image)]):
            per_image[index, : len(image)] = image
        buffer = layout.segments.to_blocks(per_image, layout.segments.blocks_shape)
        trainable = buffer.clone().requires_grad_()
        parts, trainable_parts = views(buffer), views(trainable)

        def attend(parts, segments=layout.segments):
            return sdpa(module, *parts, segments, scaling=head_dim**-0.5)[0]

        # The rows compute the same function: the images they share have the same outputs before anything is timed.
        output = layout.unpack(attend(parts))
        shared = [output[index, : 1 + size] for index, size in enumerate(sizes[: args.batch_size])]
        reference = reference or shared
        difference = max([difference] + [(a - b).abs().max().item() for a, b in zip(shared, reference)])

        def infer(parts=parts, attend=attend):
            with torch.no_grad():
                attend(parts)

        def train(parts=trainable_parts, attend=attend, x=trainable):
            attend(parts).sum().backward()
            x.grad = None

        fns[f"{name} | inference"], fns[f"{name} | training"] = infer, train
    if difference > 1e-4:
        raise SystemExit(f"The attention rows disagree on the images' outputs: {difference:.2e}")
    timed = timed_rounds(fns, args.steps, args.repeats)
    count = {"padded": args.batch_size, "packed": len(sizes)}
    return {
        "images_per_s": {name: count[name.split()[0]] / value for name, value in timed["seconds"].items()},
        "model": measure_model(args, shapes) if args.model_depth else None,
        "images": count,
        "padding_share": {name: shapes[name]["padding"] for name in count},
        "rows": {name: shapes[name]["rows"] for name in count},
        "max_difference": difference,
        "load_average": timed["load_average"],
        "threads": torch.get_num_threads(),
    }


def measure_model(args, shapes: dict) -> dict:
    """The whole classifier on the square, padded and packed batches, eager and compiled, timed in alternating rounds
    (one call per sample): per row its attention path, padding share, images and real patches per call, seconds per
    inference call and per training step (forward, loss, backward), and the first (compiling) call's seconds."""
    model = small_classifier(args.max_num_patches, args.model_width, args.model_depth, args.model_heads, args.seed)
    inputs = {name: shape["batch"] for name, shape in shapes.items() if name != "sizes"}
    variants = {"eager": model} | (
        {} if args.no_compile else {"compiled": torch.compile(model, backend=args.compile_backend)}
    )

    def logits_of(runner, name: str) -> torch.Tensor:
        with torch.no_grad():
            return runner.eval()(**inputs[name.split()[0]]).logits

    # The padded and packed rows give the images they share the same logits; eager and compiled agree on every batch.
    eager = {name: logits_of(model, name) for name in MODEL_ROWS}
    shared = [eager[name][: args.batch_size] for name in MODEL_ROWS[1:]]
    difference = max((value - shared[0]).abs().max().item() for value in shared)
    if difference > 1e-4:
        raise SystemExit(f"The model rows disagree on the images' logits: {difference:.2e}")
    calls = {}
    order = [(name, mode) for group in (MODEL_ROWS[1:], MODEL_ROWS[:1]) for mode in MODES for name in group]
    for variant, runner in variants.items():  # the square rows last: a spent compile budget leaves them out first
        by_row = layout_calls(runner, inputs, MODEL_ROWS)
        calls.update({f"{name} | {variant} | {mode}": by_row[f"{name} | {mode}"] for name, mode in order})

    def budget(key: str, first_call: dict) -> str | None:  # the first calls of the compiled rows: their compilation
        spent = sum(seconds for call, seconds in first_call.items() if " | compiled | " in call)
        if " | compiled | " in key and spent > args.compile_budget_s:
            return f"not compiled, {spent:.0f} s of compilation spent (--compile_budget_s)"
        return None

    timed = timed_rounds(calls, args.model_steps, args.repeats, skip=budget)
    compiled_rows = [name for name in MODEL_ROWS if f"{name} | compiled | inference" in timed["first_call_s"]]
    differences = [(logits_of(variants["compiled"], name) - eager[name]).abs().max().item() for name in compiled_rows]
    if max(differences, default=0.0) > 1e-3:
        raise SystemExit(f"The compiled model's logits differ from the eager model's by {max(differences):.2e}")
    rows = {}
    for variant in variants:
        for name in MODEL_ROWS:
            layout = name.split()[0]
            row = dict(path=PATHS[name], **{key: shapes[layout][key] for key in ("padding", "images", "patches")})
            row["first_call_s"] = {}
            for mode in MODES:
                key = f"{name} | {variant} | {mode}"
                if key in timed["seconds"]:
                    row[f"{mode}_s"], row["first_call_s"][mode] = timed["seconds"][key], timed["first_call_s"][key]
            rows[f"{name} | {variant}"] = row
    compiled = "compiled" in variants
    return {
        "rows": rows,
        "skipped": timed["skipped"],
        "max_difference": difference,
        "compiled_difference": max(differences, default=0.0) if compiled else None,
        "recompiles": recompile_check(args, model) if compiled and args.recompile_batches > 1 else None,
    }


def recompile_check(args, model: torch.nn.Module) -> list[dict]:
    """A fresh Dynamo cache, the model compiled with the eager backend, one inference call on each of
    `--recompile_batches` packed batches (`layouts` with seeds seed, seed + 1, ...); per batch, the frames Dynamo
    compiled again (by file), the graphs it added and the frames at the recompile limit."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    results = []
    for index in range(args.recompile_batches):
        packed = layouts(argparse.Namespace(**{**vars(args), "seed": args.seed + index}))["packed"]
        failures_before = {code: len(failures) for code, failures in guard_failures.items()}
        graphs_before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            compiled.eval()(**packed["batch"])
        recompiled = [code for code, seen in guard_failures.items() if len(seen) > failures_before.get(code, 0)]
        by_file = dict(collections.Counter(Path(code.co_filename).name for code in recompiled))
        limit = torch._dynamo.config.recompile_limit  # a frame with this many graphs runs eagerly from then on
        at_limit = [f"{Path(code.co_filename).name}:{code.co_name}" for code in guard_failures]
        at_limit = sorted(name for name, code in zip(at_limit, guard_failures) if len(cache_entries(code)) >= limit)
        results.append({
            "images": len(packed["batch"]["spatial_shapes"]), "rows": packed["rows"], "row_tokens": packed["length"],
            "new_graphs": counters["stats"]["unique_graphs"] - graphs_before, "recompiled_frames": len(recompiled),
            "by_file": by_file, "frames_at_recompile_limit": at_limit,
        })  # fmt: skip
    torch._dynamo.reset()
    return results


def format_rows(result: dict, args) -> str:
    rate, share, rows, load = result["images_per_s"], result["padding_share"], result["rows"], result["load_average"]
    header = ["row", "inference (images/s)", "vs padded + mask", "training step (images/s)", "vs padded + mask"]
    lines = []
    for name in ROWS:
        lines.append([name])
        for mode in MODES:
            value, base = rate[f"{name} | {mode}"], rate[f"padded + mask | {mode}"]
            lines[-1] += [f"{value:.1f}", f"{value / base:.2f}x"]
    images = result["images"]
    text = [
        _markdown_table(header, lines),
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
        text += ["", format_model_rows(result["model"], args)]
    return "\n".join(text)


def format_model_rows(model: dict, args) -> str:
    """The model rows: images/s and real patches/s (the ratio is of real patches/s against padded + mask of the same
    variant, eager or compiled), the padding share, the first call's seconds; compiled against eager; recompiles."""
    rows, table = model["rows"], []
    for key, row in rows.items():
        name, variant = key.split(" | ")
        base = rows.get(f"padded + mask | {variant}")
        cells = [f"model: {name} ({variant})", row["path"], f"{row['padding']:.0%}"]
        for mode in MODES:
            seconds = row.get(f"{mode}_s")
            patches = None if seconds is None else row["patches"] / seconds
            base_seconds = None if base is None else base.get(f"{mode}_s")
            ratio = "-" if base_seconds is None else f"{patches / (base['patches'] / base_seconds):.2f}x"
            cells += ["-"] * 3 if seconds is None else [f"{row['images'] / seconds:.1f}", f"{patches:.0f}", ratio]
        first = row["first_call_s"]
        first = " / ".join(f"{first[mode]:.1f}" if mode in first else "-" for mode in MODES)
        table.append(cells + [first if variant == "compiled" else "-"])
    header = ["model row", "attention", "padding", "inference images/s", "patches/s", "vs padded + mask"]
    header += ["training step images/s", "patches/s", "vs padded + mask", "first call (s)"]
    lines = [
        _markdown_table(header, table),
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
    lines += [f"Skipped {key}: {reason}." for key, reason in model["skipped"].items()]
    if model["recompiles"]:
        lines.append(format_recompiles(model["recompiles"], args))
    return "\n".join(lines)


def format_recompiles(checks: list[dict], args) -> str:
    first, *others = checks
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
    at_limit = ", ".join(checks[-1]["frames_at_recompile_limit"])
    return (
        f"Recompiles: packed batches of L = {args.packed_sequence_length} holding other images, one after another "
        f"through one compiled model (inference; Dynamo's eager backend, recompile_limit "
        f"{torch._dynamo.config.recompile_limit}): batch 1 ({first['images']} images, rows of "
        f"{first['row_tokens']} tokens) compiled {first['new_graphs']} graphs; {'; '.join(described)}. "
        + ("No recompiles." if recompiled == 0 else f"{recompiled} recompiled frames in all.")
        + (f" Frames at Dynamo's recompile limit, run uncompiled from then on: {at_limit}." if at_limit else "")
    )


FLAGS = {  # name: (default, help); the type is the default's
    "max_num_patches": (256, "K, the most patches of one image"),
    "packed_sequence_length": (1024, "L, patch slots per packed row"),
    "min_share": (0.4, "the fewest patches of an image, as a share of K"),
    "batch_size": (32, "images of the padded batch"),
    "width": (768, None),
    "heads": (12, None),
    **{name: SPEED_FLAGS[name] for name in ("steps", "repeats")},  # as naflex_speed.py's and simmim_speed.py's
    "model_width": (192, None),
    "model_depth": (4, "blocks of the model rows (0: no model rows)"),
    "model_heads": (3, None),
    "model_steps": (1, "calls per timed sample of the model rows"),
    "compile_budget_s": (300.0, "no compiled row starts compiling after this many seconds of compilation"),
    "recompile_batches": (10, "packed batches of the recompile check (0: no check)"),
    "threads": (0, "torch threads (0: torch's default)"),
    "seed": (0, None),
    "no_compile": (False, "leave the compiled model rows out"),
    "compile_backend": (None, "torch.compile's backend (default inductor)"),
    "quick": (False, "a tiny batch, one sample per row, compiled with Dynamo's eager backend"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, FLAGS)
    args = parser.parse_args(argv)
    if args.quick:  # the tiny shapes for the attention and the model rows alike
        model = {f"model_{key}": QUICK[key] for key in ("width", "depth", "heads")}
        vars(args).update(QUICK, **model, steps=1, repeats=1, compile_backend=args.compile_backend or "eager")
        args.recompile_batches = min(args.recompile_batches, 2)
    args.compile_backend = args.compile_backend or "inductor"
    if args.batch_size * args.max_num_patches < args.packed_sequence_length:
        parser.error("--batch_size x --max_num_patches must be at least --packed_sequence_length (one packed row)")
    check_packing_flags(parser, args)
    if args.model_depth and math.isqrt(args.max_num_patches) ** 2 != args.max_num_patches:
        parser.error(f"--max_num_patches ({args.max_num_patches}) must be a square number (the model's square batch)")
    print(format_rows(measure(args), args))
    return 0


def check_packing_flags(parser: argparse.ArgumentParser, args) -> None:
    """L at least K, and the share of K of the smallest image in (0, 1]."""
    if args.packed_sequence_length < args.max_num_patches:
        parser.error(
            f"--packed_sequence_length ({args.packed_sequence_length}) must be at least --max_num_patches "
            f"({args.max_num_patches})"
        )
    if not 0 < args.min_share <= 1:
        parser.error(f"--min_share must be in (0, 1], got {args.min_share}")


if __name__ == "__main__":
    sys.exit(main())
