"""Evaluate a saved model on a data set's split, without training: the metrics of its objective (accuracy and top-5
accuracy, or mean average precision and F1 for multi-label data, and the loss) and, for single-label data, each
class's precision, recall and F1 and the confusion matrix (rows: true class, columns: predicted), printed as JSON
(the per-class table and the matrix also as text, on standard error); in --output_dir `<split>_results.json` and the
confusion matrix's plot (`<split>_confusion_matrix.png`, with matplotlib).

hf-vit-evaluate --model outputs/main --dataset_name digits --split test
hf-vit-evaluate --model out/lora-run --dataset_name path/to/images --output_dir out/lora-run/evaluation
hf-vit-evaluate --model outputs/main --dataset_name digits --max_num_patches 4,16,64 --output_dir outputs/dial

outputs/main is the model `make train` writes; after `make train QUICK=1`, outputs/quick serves the same way.
--model takes an hf-vit folder, a LoRA run's folder or a transformers/timm checkpoint by Hub id; its head is used as
it is, so its classes must be the data set's. A run's folder on the data set it trained on is measured on the run's
splits (its record, hf_vit_run.json: split names, the share held out, a stream's rule; an image folder's images by
their paths in it), so "validation" is the images the run held out, wherever the folder moved (images added, removed
or changed since are named, and only the run's are measured); a split flag that contradicts the record is refused.
Every figure is said with its number of images, with a warning under 50.

--max_num_patches K measures it on native-aspect batches (each image at its own aspect ratio on the largest grid of at
most K patches, no centre crop); --patch_size P at another patch size, its patch embedding resampled (FlexiViT). A
list of either (16,64,144 or 8,16,32) measures the compute dial: one row per value (the numbers of patches at the
model's patch size, or with --patch_size P at P; the patch sizes on whole images, or with --max_num_patches K at K),
printed as JSON and written with its plot to --output_dir (compute_dial.json, compute_dial.png).
"""

from __future__ import annotations

import json
import sys

from hf_vit.commands import CommandParser
from hf_vit.flags import error_status


def _report(metrics: dict, printed_only: bool) -> None:
    """The metrics as JSON on stdout; the headline, warnings and per-class table on stderr."""
    from hf_vit.infer.evaluate import per_class_table
    from hf_vit.metrics import few_images_warning, images_text

    split = metrics["split"]
    print(json.dumps(metrics, indent=2))
    name = next((key for key in ("accuracy", "mean_average_precision", "loss") if f"{split}_{key}" in metrics), None)
    count = metrics.get(f"{split}_samples")
    if name is not None:
        figure = f"{name} {metrics[f'{split}_{name}']:.4f}"
        print(f"{split} {figure} of {metrics['dataset_name']}, on {images_text(count)}", file=sys.stderr)
    if few := few_images_warning(count):
        print(f"warning: {few}", file=sys.stderr)
    table = per_class_table(metrics, split)
    if table:  # on stderr, as the note below: standard output stays the JSON
        print(table, file=sys.stderr)
    if printed_only:
        print(
            f"(printed only: pass --output_dir to write {split}_results.json and the confusion matrix)",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser("hf-vit-evaluate", __doc__)
    parser.add_argument("--model", required=True, help="hf-vit folder, LoRA run folder or Hub id")
    parser.add_argument(
        "--dataset_name", required=True, help="'digits', an image folder, a save_to_disk folder or a Hub data set"
    )
    parser.add_argument("--split", help="split to measure (default: test, or validation without one)")
    parser.add_argument(
        "--validation_fraction",
        type=float,
        help="share of train held out as validation when the data set has none (default: the run's, else 0.1)",
    )
    for split in ("train", "validation", "test"):
        parser.add_argument(
            f"--{split}_split", help=f"the data set's {split} split (default: the run's, else {split})"
        )
    parser.add_argument("--image_column_name", default="image")
    parser.add_argument("--label_column_name", default="label")
    parser.add_argument(
        "--output_dir",
        help="where the results JSON and the confusion matrix are written; without it they are only printed (JSON)",
    )
    parser.add_argument(
        "--max_num_patches", metavar="K[,K...]", help="native aspect ratio: at most K patches an image"
    )
    parser.add_argument("--patch_size", metavar="P[,P...]", help="the checkpoint resampled to P-pixel patches")
    args = parser.parse_args(argv)
    # The heavy imports (torch, transformers' models, datasets) come after the flags are read.
    import logging

    from transformers.utils import logging as transformers_logging

    from hf_vit.data.datasets import DataSource
    from hf_vit.flags import parse_sizes
    from hf_vit.infer.compute_dial import evaluate_dial
    from hf_vit.infer.evaluate import evaluate_saved_model, recorded_source
    from hf_vit.outputs.output_folders import check_no_file_in_the_way, check_outside_data_set

    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    import datasets

    transformers_logging.disable_progress_bar()  # stderr keeps the warnings and errors
    datasets.disable_progress_bars()
    datasets.utils.logging.disable_propagation()  # datasets prints through its own handler: not twice
    given = {name: getattr(args, name) for name in ("train_split", "validation_split", "test_split")}
    given["validation_fraction"] = args.validation_fraction
    columns = {name: getattr(args, name) for name in ("dataset_name", "image_column_name", "label_column_name")}
    source = DataSource(**columns, **{flag: value for flag, value in given.items() if value is not None})
    try:
        source = recorded_source(args.model, source, given)  # the splits as the run that trained --model made them
        if args.output_dir is not None:
            check_no_file_in_the_way(args.output_dir)
            check_outside_data_set(args.output_dir, args.dataset_name)
        counts = parse_sizes(args.max_num_patches, "--max_num_patches") or []
        patch_sizes = parse_sizes(args.patch_size, "--patch_size") or []
        if len(counts) > 1 or len(patch_sizes) > 1:
            rows = evaluate_dial(args.model, source, args.split, args.output_dir, counts, patch_sizes)
            print(json.dumps(rows, indent=2))
            return 0
        count, patch = (counts or [None])[0], (patch_sizes or [None])[0]
        metrics = evaluate_saved_model(
            args.model, args.dataset_name, args.split, args.output_dir, source, count, patch
        )
    except (ValueError, OSError) as error:
        return error_status(error)
    _report(metrics, printed_only=args.output_dir is None)
    return 0
