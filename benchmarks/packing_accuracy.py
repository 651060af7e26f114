r"""Packing against padding in training: held-out accuracy against training time, at the same patch slots per step.

scikit-learn's 1797 digits (no download) made mixed-aspect: each digit, scaled to the short side, at a random place of
a canvas of between `--min_share` x K and K patches (drawn anew per epoch, the same draw for both runs); a stratified
`--test_images` of them held out (fixed canvases, never in a training batch). One small classifier trained twice from
the same weights on the same image stream, optimiser (AdamW, warm-up, cosine, clipping) and steps, each step B x K
patch slots: "padded" (B images, one per row of K) and "packed" (B x K / L rows of L holding the next images, as many
as best-fit-decreasing packs). The runs are interleaved step by step, each timing its own steps (the batches made
before the clock starts). Printed: accuracy at equal steps and equal training time, images seen per second, the
padding shares, and the time packing needs to reach the padded run's final accuracy; the two layouts' logits of the
same images are checked equal first.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/packing_accuracy.py --threads 1   # a few minutes on CPU
    PYTHONPATH=. python benchmarks/packing_accuracy.py --quick                         # seconds: a tiny run
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys

import numpy as np
import PIL.Image
import torch

from benchmarks.packing_speed import check_packing_flags, small_classifier
from benchmarks.report import _markdown_table, write_json
from benchmarks.settings import add_flags
from benchmarks.timing import CPU, make_train_step, timed_call
from hf_vit import VisionTransformerImageProcessor
from hf_vit.model.image_processing_vit import best_fit_decreasing

RUNS = ("padded", "packed")
COLUMNS = ("s", "images seen", "held-out accuracy")
TRAIN_SEED, TEST_SEED = 1, 2  # the canvases' draws: training images per (epoch, image), test images once


def load_digits_split(test_images: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """scikit-learn's digits as 0..255 uint8 8x8 images, split stratified into "train" and "test": per split (images,
    labels, indices into the whole set)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    train, test = train_test_split(np.arange(len(labels)), test_size=test_images, stratify=labels, random_state=seed)
    return {name: (pixels[index], labels[index], index) for name, index in (("train", train), ("test", test))}


def canvas_grid(rng: np.random.Generator, args) -> tuple[int, int]:
    """A grid (rows, cols) of between min_share * K and K patches, at least 3 patches a side, aspect at most
    `--max_aspect`."""
    low = max(1, math.ceil(args.min_share * args.max_num_patches))
    while True:
        rows, cols = (int(value) for value in rng.integers(3, args.max_num_patches // 3 + 1, size=2))
        if low <= rows * cols <= args.max_num_patches and max(rows / cols, cols / rows) <= args.max_aspect:
            return rows, cols


def mixed_aspect_image(digit: np.ndarray, rng: np.random.Generator, args) -> np.ndarray:
    """The 8x8 `digit` scaled (bilinear) to the short side of a canvas of a random grid and placed at a random place
    along its long side: (rows * P, cols * P, 3) uint8, black around it as the digits' own background."""
    rows, cols = canvas_grid(rng, args)
    height, width = rows * args.patch_size, cols * args.patch_size
    side = min(height, width)
    scaled = np.asarray(PIL.Image.fromarray(digit).resize((side, side), PIL.Image.BILINEAR))
    canvas = np.zeros((height, width), dtype=np.uint8)
    top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
    canvas[top : top + side, left : left + side] = scaled
    return np.repeat(canvas[:, :, None], 3, axis=2)


class Stream:
    """The training images in epochs, each epoch a permutation of the training set (the same for every stream of one
    seed), each image's canvas drawn anew per (epoch, image) (the same for every stream)."""

    def __init__(self, digits: np.ndarray, labels: np.ndarray, args) -> None:
        self.digits, self.labels, self.args = digits, labels, args
        self.epoch, self.position, self.order = 0, 0, self._order(0)
        self.lookahead: tuple[np.ndarray, int, int] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.args.seed, epoch)).permutation(len(self.labels))

    def peek(self) -> tuple[np.ndarray, int, int]:
        """The next (image, label, patches) without taking it."""
        if self.lookahead is None:
            if self.position == len(self.order):
                self.epoch, self.position = self.epoch + 1, 0
                self.order = self._order(self.epoch)
            index = int(self.order[self.position])
            self.position += 1
            rng = np.random.default_rng((self.args.seed, TRAIN_SEED, self.epoch, index))
            image = mixed_aspect_image(self.digits[index], rng, self.args)
            patches = (image.shape[0] // self.args.patch_size) * (image.shape[1] // self.args.patch_size)
            self.lookahead = (image, int(self.labels[index]), patches)
        return self.lookahead

    def take(self) -> tuple[np.ndarray, int, int]:
        item = self.peek()
        self.lookahead = None
        return item


def next_batch(stream: Stream, run: str, processor: VisionTransformerImageProcessor, args) -> dict:
    """A step's batch of B x K patch slots: B images padded to K each, or as many images as best-fit-decreasing
    packs into B x K / L rows of L (the stream's next image that does not fit waits for the next step)."""
    images, labels, sizes = [], [], []
    length, rows = args.packed_sequence_length, args.batch_size * args.max_num_patches // args.packed_sequence_length
    while (
        len(images) < args.batch_size
        if run == "padded"
        else not images or len(best_fit_decreasing([*sizes, stream.peek()[2]], length)) <= rows
    ):
        for items, item in zip((images, labels, sizes), stream.take()):
            items.append(item)
    extra = {} if run == "padded" else {"packed_sequence_length": length}
    batch = dict(processor(images, return_tensors="pt", **extra))
    slots = batch["pixel_values"].shape[:2].numel()
    return {"inputs": batch, "labels": torch.tensor(labels), "images": len(images), "patches": sum(sizes),
            "slots": slots}  # fmt: skip


def schedule(steps: int, warmup: int):
    """Linear warm-up over `warmup` steps, then cosine decay to zero at `steps`: the learning rate's factor."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


def evaluate(model: torch.nn.Module, test: list[dict]) -> float:
    correct = total = 0
    model.eval()
    with torch.no_grad():
        for batch in test:
            predictions = model(**batch["inputs"]).logits.argmax(-1)
            correct += int((predictions == batch["labels"]).sum())
            total += len(batch["labels"])
    return correct / total


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    split = load_digits_split(args.test_images, args.seed)
    (train_digits, train_labels, _), (test_digits, test_labels, _) = split["train"], split["test"]  # disjoint
    # Digits that scikit-learn's set holds twice (the same 8x8 pixels under two indices) can fall on both sides
    train_pixels = {digit.tobytes() for digit in train_digits}
    duplicates = sum(digit.tobytes() in train_pixels for digit in test_digits)
    processor = VisionTransformerImageProcessor(
        max_num_patches=args.max_num_patches, patch_size=args.patch_size, do_resize=False
    )
    rng = np.random.default_rng((args.seed, TEST_SEED))
    test_images = [mixed_aspect_image(digit, rng, args) for digit in test_digits]
    starts = range(0, len(test_images), size := args.eval_batch_size)
    test = [{"inputs": dict(processor(test_images[i : i + size], return_tensors="pt")),
             "labels": torch.tensor(test_labels[i : i + size])} for i in starts]  # fmt: skip

    model = small_classifier(args.max_num_patches, args.width, args.depth, args.heads, args.seed, args.patch_size)
    models = {"padded": model, "packed": copy.deepcopy(model)}  # the same initial weights
    # The two layouts compute the same function: the same images padded and packed get the same logits.
    images = test_images[: args.batch_size]
    padded = dict(processor(images, return_tensors="pt"))
    packed = dict(processor(images, packed_sequence_length=args.packed_sequence_length, return_tensors="pt"))
    with torch.no_grad():
        difference = (models["padded"].eval()(**padded).logits - models["packed"].eval()(**packed).logits).abs().max()
    if difference > 1e-4:
        raise SystemExit(
            f"The padded and packed batches of the same images disagree on their logits: {difference:.2e}"
        )

    streams = {name: Stream(train_digits, train_labels, args) for name in RUNS}
    optimizers, schedulers = {}, {}
    for name, model in models.items():
        optimizers[name] = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
        warmup = max(1, round(args.warmup * args.steps))
        schedulers[name] = torch.optim.lr_scheduler.LambdaLR(optimizers[name], schedule(args.steps, warmup))
    totals = {name: {"seconds": 0.0, "images": 0, "patches": 0, "slots": 0} for name in RUNS}

    def evaluation(step: int) -> dict:
        point = {name: {key: totals[name][key] for key in ("seconds", "images")} for name in RUNS}
        return {"step": step, **{name: {**point[name], "accuracy": evaluate(models[name], test)} for name in RUNS}}

    curve = [evaluation(0)]
    load_before = os.getloadavg()
    for step in range(args.steps):
        for name in RUNS if step % 2 == 0 else RUNS[::-1]:
            batch = next_batch(streams[name], name, processor, args)  # made before the clock starts
            model, optimizer = models[name].train(), optimizers[name]
            train_step = make_train_step(model, optimizer, batch["inputs"], batch["labels"], "fp32", args.clip)
            totals[name]["seconds"] += timed_call(train_step, CPU)
            schedulers[name].step()
            for key in ("images", "patches", "slots"):
                totals[name][key] += batch[key]
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append(evaluation(step + 1))
    load_after = os.getloadavg()
    return {
        "curve": curve,
        "totals": totals,
        "train_images": len(train_labels),
        "test_images": len(test_labels),
        "test_duplicates_of_train_digits": duplicates,
        "epochs": {name: totals[name]["images"] / len(train_labels) for name in RUNS},
        "max_difference": float(difference),
        "load_average": [load_before[0], load_after[0]],
        "threads": torch.get_num_threads(),
    }


def format_result(result: dict, args) -> str:
    curve, totals = result["curve"], result["totals"]
    header = ["step"] + [f"{name}: training s" if key == "s" else key for name in RUNS for key in COLUMNS]
    table = [
        [point["step"]]
        + [f"{point[n]['seconds']:.1f} | {point[n]['images']} | {point[n]['accuracy']:.1%}" for n in RUNS]
        for point in curve
    ]
    horizon = min(totals[name]["seconds"] for name in RUNS)
    times = []
    for share in (0.25, 0.5, 0.75, 1.0):
        times.append([f"{share * horizon:.1f} s"])
        for name in RUNS:  # the run's last evaluation within that much training
            point = [point for point in curve if point[name]["seconds"] <= share * horizon][-1]
            times[-1].append(f"{point[name]['accuracy']:.1%} ({point['step']})")
    header_times = ["training time"] + [f"{name}: held-out accuracy (step)" for name in RUNS]
    lines = [_markdown_table(header, table), "", _markdown_table(header_times, times)]
    rate = {name: totals[name]["images"] / totals[name]["seconds"] for name in RUNS}
    padding = {name: 1 - totals[name]["patches"] / totals[name]["slots"] for name in RUNS}
    step_seconds = {name: totals[name]["seconds"] / args.steps for name in RUNS}
    final = curve[-1]
    target = final["padded"]["accuracy"]
    reached = next((point for point in curve if point["packed"]["accuracy"] >= target), None)
    if reached is None:
        reached_line = "Packing did not reach the padded run's final accuracy."
    else:
        seconds, padded_seconds = reached["packed"]["seconds"], totals["padded"]["seconds"]
        reached_line = (
            f"Packing reached the padded run's final accuracy at step {reached['step']}, after {seconds:.1f} s of "
            f"training ({seconds / padded_seconds:.2f}x the padded run's {padded_seconds:.1f} s)."
        )
    header = ["run", "images per step", "padding share", "seconds per step", "images seen per second", "epochs"]
    runs = [
        [name, f"{totals[name]['images'] / args.steps:.1f}", f"{padding[name]:.1%}", f"{step_seconds[name]:.3f}",
         f"{rate[name]:.1f}", f"{result['epochs'][name]:.1f}"]
        for name in RUNS
    ]  # fmt: skip
    lines += ["", _markdown_table(header, runs)]
    load = result["load_average"]
    lines += [
        "",
        f"Packed / padded: images seen per second {rate['packed'] / rate['padded']:.2f}x, seconds per step "
        f"{step_seconds['packed'] / step_seconds['padded']:.2f}x; final held-out accuracy "
        f"{final['packed']['accuracy']:.1%} packed, {target:.1%} padded (after {args.steps} steps each). "
        + reached_line,
        f"Digits on canvases of {math.ceil(args.min_share * args.max_num_patches)} to {args.max_num_patches} patches "
        f"of {args.patch_size}x{args.patch_size} pixels (aspect up to {args.max_aspect:g}); {result['train_images']} "
        f"training digits, {result['test_images']} held out ({result['test_duplicates_of_train_digits']} of them with "
        f"the same 8x8 pixels as a training digit). Each step B x K = {args.batch_size} x {args.max_num_patches} "
        f"patch slots: padded, {args.batch_size} rows of K; packed, "
        f"{args.batch_size * args.max_num_patches // args.packed_sequence_length} rows of L = "
        f"{args.packed_sequence_length}. A classifier of width {args.width}, {args.depth} blocks, {args.heads} heads, "
        f"SDPA, fp32, the same initial weights; AdamW (lr {args.learning_rate:g}, weight decay {args.weight_decay:g}, "
        f"{args.warmup:.0%} warm-up, cosine), gradient clipping {args.clip:g}; seed {args.seed}; {result['threads']} "
        f"threads; the two runs interleaved step by step. Padded and packed logits of the same images agree to "
        f"{result['max_difference']:.1e}. 1-minute load average {load[0]:.2f} before, {load[1]:.2f} after.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, {
        "patch_size": (4, None), "max_num_patches": (64, "K, the most patches of one image"),
        "packed_sequence_length": (256, "L, patch slots per packed row"),
        "min_share": (0.3, "the fewest patches of an image, as a share of K"),
        "max_aspect": (3.0, "the longest side over the shortest, at most"),
        "batch_size": (32, "B: images of a padded step"), "steps": (600, None), "eval_every": (50, None),
        "test_images": (360, "digits held out for the accuracy"), "eval_batch_size": (128, None), "width": (96, None),
        "depth": (4, None), "heads": (3, None), "learning_rate": (1e-3, None), "weight_decay": (0.05, None),
        "warmup": (0.1, "warm-up, as a share of the steps"), "clip": (1.0, "gradient norm clipping"),
        "threads": (0, "torch threads (0: torch's default)"), "seed": (0, None),
        "json": (None, "also write the result here"),
        "quick": (False, "a tiny model, a few steps: seconds"),
    })  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.max_num_patches, args.packed_sequence_length, args.batch_size = 16, 32, 8
        args.steps, args.eval_every, args.test_images = 6, 3, 100
        args.width, args.depth, args.heads = 32, 1, 2
    check_packing_flags(parser, args)
    if args.batch_size * args.max_num_patches % args.packed_sequence_length:
        parser.error("--batch_size x --max_num_patches must be a multiple of --packed_sequence_length (whole rows)")
    if math.isqrt(args.max_num_patches) < 3 or args.max_aspect < 1:
        parser.error("--max_num_patches must be at least 9, --max_aspect at least 1")
    result = run(args)
    print(format_result(result, args))
    if args.json:
        write_json({"settings": vars(args), **result}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
