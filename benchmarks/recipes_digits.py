"""The named recipes against the paper's fine-tuning defaults on a few hundred real images: test accuracy.

A small ViT is pretrained (supervised, at 16x16) on the embedded digits 0-4, then fine-tuned at 24x24 on `--images`
training images of the digits 5-9 (which it never saw) with each recipe, and tested on the digits 5-9 of the test
split. Each fine-tune runs in its own process, from the same pretrained model, for the same number of epochs.

    python benchmarks/recipes_digits.py --output_dir /tmp/recipes-digits
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ARCHITECTURE = "hidden_size=96,num_hidden_layers=4,num_attention_heads=3,intermediate_size=384"
COMMON = ["--per_device_eval_batch_size", "256", "--save_strategy", "no", "--eval_strategy", "no"]
COMMON += ["--report_to", "none", "--disable_tqdm", "True", "--overwrite_output_dir", "True"]
COMMON += ["--dataloader_num_workers", "0"]
RUNS = {
    "paper's fine-tuning (SGD)": [],
    "--recipe augreg": ["--recipe", "augreg"],
    "--recipe deit": ["--recipe", "deit"],
    "--recipe finetune": ["--recipe", "finetune"],
}


def split_digits(folder: Path, images: int) -> tuple[Path, Path]:
    """Two data sets saved to disk: digits 0-4 (train, validation, test) and `images` training images of 5-9 with
    the validation and test images of 5-9 (labels renumbered 0-4)."""
    from datasets import ClassLabel, DatasetDict

    from hf_vit.run.datasets import load_digits_dataset

    digits = load_digits_dataset()
    first = DatasetDict({split: data.filter(lambda row: row["label"] < 5) for split, data in digits.items()})
    second = DatasetDict({split: data.filter(lambda row: row["label"] >= 5) for split, data in digits.items()})
    second = second.map(lambda row: {"label": row["label"] - 5}).cast_column("label", ClassLabel(names=list("56789")))
    first = first.cast_column("label", ClassLabel(names=list("01234")))
    second["train"] = second["train"].select(range(min(images, len(second["train"]))))
    first.save_to_disk(str(folder / "digits-0-4"))
    second.save_to_disk(str(folder / "digits-5-9"))
    return folder / "digits-0-4", folder / "digits-5-9"


def finetune(argv: list[str]) -> dict:
    """Run in a child process: one fine-tune and its test metrics."""
    from hf_vit.run.arguments import parse_args
    from hf_vit.run.training import train

    metrics = train("finetune", *parse_args("finetune", argv))
    return {k: metrics[k] for k in ("eval_accuracy", "eval_loss", "train_loss", "train_runtime")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=Path("/tmp/recipes-digits"))
    parser.add_argument("--images", type=int, default=300, help="Fine-tuning images of the digits 5-9.")
    parser.add_argument("--pretrain_epochs", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(finetune(args.child)))
        return
    from hf_vit.run.arguments import parse_args
    from hf_vit.run.training import train

    pretraining, finetuning = split_digits(args.output_dir, args.images)
    pretrained = args.output_dir / "pretrain"
    pre = ["--output_dir", str(pretrained), "--dataset_name", str(pretraining), "--patch_size", "4"]
    pre += ["--image_size", "16", "--config_overrides", ARCHITECTURE, "--num_train_epochs", str(args.pretrain_epochs)]
    pre += ["--per_device_train_batch_size", "64", "--learning_rate", "1e-3", "--crop_scale_min", "0.7"]
    train("pretrain", *parse_args("pretrain", pre + COMMON))
    rows: dict[str, list[dict]] = {}
    for name, flags in RUNS.items():
        for seed in args.seeds:
            out = args.output_dir / f"{name.strip('-').split()[-1].strip('()')}-{seed}"
            argv = ["--model_name_or_path", str(pretrained), "--output_dir", str(out), "--image_size", "24"]
            argv += ["--dataset_name", str(finetuning), "--num_train_epochs", str(args.epochs), "--seed", str(seed)]
            argv += ["--per_device_train_batch_size", "32", "--hflip", "False", *COMMON, *flags]
            command = [sys.executable, __file__, "--child", *argv]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"digits 5-9: {args.images} training images, {args.epochs} epochs at 24x24 (batch 32), seeds {args.seeds}, "
        "from a ViT pretrained on the digits 0-4"
    )
    print(f"{'':<28}{'test acc':>16}{'train loss':>12}{'s':>8}")
    for name, results in rows.items():
        accuracies = [row["eval_accuracy"] for row in results]
        shown = " / ".join(f"{a:.3f}" for a in accuracies)
        train_loss = sum(row["train_loss"] for row in results) / len(results)
        runtime = sum(row["train_runtime"] for row in results) / len(results)
        print(f"{name:<28}{shown:>16}{train_loss:>12.3f}{runtime:>8.0f}")


if __name__ == "__main__":
    main()
