"""The named recipes against no recipe on real images (scikit-learn's digits): test accuracy at a fixed budget over
several seeds. Fine-tuning: a small ViT pretrained on the digits 0-4, fine-tuned on `--images` of the digits 5-9
(without a recipe: the paper's fine-tuning defaults); from scratch: the same ViT trained on `--scratch_images` of all
ten digits (without a recipe: the paper's pretraining defaults). Every row runs the same epochs at the same batch;
each (row, set-up) runs its seeds in one child process with one torch thread, one process at a time.

    python benchmarks/recipes_digits.py --output_dir /tmp/recipes-digits --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ARCHITECTURE = "hidden_size=64,num_hidden_layers=4,num_attention_heads=2,intermediate_size=256"
QUIET = ["--per_device_eval_batch_size", "256", "--save_strategy", "no", "--eval_strategy", "no"]
QUIET += ["--report_to", "none", "--disable_tqdm", "True", "--overwrite_output_dir", "True"]
QUIET += ["--dataloader_num_workers", "0"]
COMMON = [*QUIET, "--hflip", "False", "--image_size", "16"]
RUNS = {"no recipe": [], **{name: name.split() for name in ("--recipe augreg", "--recipe deit", "--recipe finetune")}}
# The recipes' augmentation and regularisation at a learning rate for short runs of small batches (the papers scale
# theirs down with the batch: DeiT's 5e-4 at 512 is 3.1e-5 at 32).
SCALED = {
    name: name.split() for name in ("--recipe deit --learning_rate 1e-3", "--recipe finetune --learning_rate 1e-3")
}


def split_digits(folder: Path, images: int) -> tuple[Path, Path]:
    """Two data sets saved to disk: digits 0-4 (train, validation, test) and `images` training images of 5-9 with
    the validation and test images of 5-9 (labels renumbered 0-4)."""
    from datasets import ClassLabel, DatasetDict

    from hf_vit.data.datasets import load_digits_dataset

    digits = load_digits_dataset()
    first = DatasetDict({split: data.filter(lambda row: row["label"] < 5) for split, data in digits.items()})
    second = DatasetDict({split: data.filter(lambda row: row["label"] >= 5) for split, data in digits.items()})
    second = second.map(lambda row: {"label": row["label"] - 5}).cast_column("label", ClassLabel(names=list("56789")))
    first = first.cast_column("label", ClassLabel(names=list("01234")))
    second["train"] = second["train"].select(range(min(images, len(second["train"]))))
    first.save_to_disk(str(folder / "digits-0-4"))
    second.save_to_disk(str(folder / "digits-5-9"))
    return folder / "digits-0-4", folder / "digits-5-9"


def run_training(task: str, argv: list[str], **options) -> dict:
    """hf-vit's `task` ("pretrain", "finetune") run in this process from its command line `argv`: its metrics."""
    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    return train(task, *parse_args(task, argv), **options)


def run_seeds(task: str, runs: list[list[str]]) -> list[dict]:
    """Run in a child process: one training run per argv (one per seed), and each one's test metrics."""
    import torch

    torch.set_num_threads(1)
    results = []
    for argv in runs:
        metrics = run_training(task, argv)
        results.append({k: metrics[k] for k in ("eval_accuracy", "eval_loss", "train_loss", "train_runtime")})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=Path("/tmp/recipes-digits"))
    parser.add_argument("--images", type=int, default=300, help="Fine-tuning images of the digits 5-9.")
    parser.add_argument("--scratch_images", type=int, default=300, help="Training images (all ten digits), scratch.")
    parser.add_argument("--pretrain_epochs", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--setups", nargs="+", default=["finetune", "scratch"], choices=["finetune", "scratch"])
    rows_help = "recipes: no recipe and each named recipe; scaled: the recipes at a learning rate for short runs."
    parser.add_argument("--rows", nargs="+", default=["recipes"], choices=["recipes", "scaled"], help=rows_help)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        task, runs = json.loads(Path(args.child).read_text())
        print(json.dumps(run_seeds(task, runs)))
        return
    import torch

    torch.set_num_threads(1)
    pretraining, finetuning = split_digits(args.output_dir, args.images)
    pretrained = args.output_dir / "pretrain"
    architecture = ["--patch_size", "4", "--config_overrides", ARCHITECTURE]
    if (pretrained / "model.safetensors").is_file():
        print(f"reusing the pretrained model in {pretrained} (delete it to pretrain again)", file=sys.stderr)
    elif "finetune" in args.setups:
        pre = ["--output_dir", str(pretrained), "--dataset_name", str(pretraining), *architecture]
        pre += ["--num_train_epochs", str(args.pretrain_epochs), "--per_device_train_batch_size", "64"]
        pre += ["--learning_rate", "1e-3", "--crop_scale_min", "0.7"]
        run_training("pretrain", pre + COMMON)
    rows = {**(RUNS if "recipes" in args.rows else {}), **(SCALED if "scaled" in args.rows else {})}
    data = {  # per set-up: the model and data set
        "finetune": ["--model_name_or_path", str(pretrained), "--dataset_name", str(finetuning)],
        "scratch": ["--dataset_name", "digits", "--max_train_samples", str(args.scratch_images), *architecture],
    }
    results: dict[tuple[str, str], list[dict]] = {}
    for setup in args.setups:
        for name, flags in rows.items():
            runs = []
            for seed in args.seeds:
                tag = "-".join(part.strip("-") for part in name.split()) or "none"
                out = args.output_dir / f"{setup}-{tag}-{seed}"
                argv = ["--output_dir", str(out), "--seed", str(seed), "--num_train_epochs", str(args.epochs)]
                argv += ["--per_device_train_batch_size", str(args.batch_size), *COMMON, *flags, *data[setup]]
                runs.append(argv)
            task = "finetune" if setup == "finetune" else "pretrain"
            plan = args.output_dir / f"{setup}-{tag}-runs.json"
            plan.write_text(json.dumps([task, runs]))
            command = [sys.executable, __file__, "--child", str(plan)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{setup} {name} failed:\n{done.stderr[-4000:]}")
            results[setup, name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(table_row(setup, name, results[setup, name]), flush=True)
    print(
        f"\n{args.epochs} epochs of batch {args.batch_size} at 16x16, seeds {args.seeds}; fine-tuning: {args.images} "
        f"images of the digits 5-9 from a ViT pretrained on 0-4; from scratch: {args.scratch_images} images of all "
        "ten digits"
    )
    print("| set-up | run | test accuracy (mean ± sd) | per seed | train loss | train s |")
    print("|---|---|---|---|---|---|")
    for (setup, name), rows_ in results.items():
        print(table_row(setup, name, rows_))


def table_row(setup: str, name: str, results: list[dict]) -> str:
    accuracies = [row["eval_accuracy"] for row in results]
    spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
    loss, runtime = (statistics.mean(row[key] for row in results) for key in ("train_loss", "train_runtime"))
    shown = f"{statistics.mean(accuracies):.3f} ± {spread:.3f} | {' / '.join(f'{a:.3f}' for a in accuracies)}"
    return f"| {setup} | {name} | {shown} | {loss:.3f} | {runtime:.0f} |"


if __name__ == "__main__":
    main()
