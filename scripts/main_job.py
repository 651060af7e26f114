#!/usr/bin/env python
"""The main job (`make train`): pretrain a small ViT on the embedded digits at 16x16, fine-tune it at 24x24, and
make its 36x36 resolution variant (measured as interpolated, and after a short fine-tune).

Both stages are the library's `pretrain` and `finetune` runs with the paper's recipes; the fine-tuned model, its
processor, model card, `all_results.json` (test-split metrics) and training curves land in `--output_dir`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from pathlib import Path

import datasets
import torch

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.analysis import write_analysis_figures
from hf_vit.data.datasets import load_digits_dataset
from hf_vit.metrics import images_text
from hf_vit.outputs.cards import write_model_card
from hf_vit.outputs.files import write_beside
from hf_vit.train.arguments import parse_args
from hf_vit.train.training import train
from hf_vit.variants import make_evaluated_variant

ARCHITECTURE = "hidden_size=96,num_hidden_layers=4,num_attention_heads=3,intermediate_size=384"
TRAIN_IMAGES = 1257  # the digits' training split
# The job's wall time as a fixed part (starting, loading data, saving, the analysis figures) plus its training steps'
# compute times a factor (the data path's augmentation in the training process, evaluation each epoch), fitted to
# the job and its quick version measured on 2 quiet CPU cores; docs/benchmarks.md gives the measurement.
FIXED_MINUTES = 0.43
OVERHEAD = 1.9


def step_seconds(image_size: int, batch: int, repeats: int = 3) -> float:
    """Seconds of one training step (forward, backward, SGD update) of the main job's model on this machine now."""
    config = VisionTransformerConfig(
        image_size=image_size, patch_size=4, hidden_size=96, num_hidden_layers=4, num_attention_heads=3,
        intermediate_size=384, num_labels=10, representation_size=96,
    )  # fmt: skip
    model = VisionTransformerForImageClassification(config).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pixels, labels = torch.randn(batch, 3, image_size, image_size), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(repeats + 1):  # the first step warms up
        started = time.perf_counter()
        model(pixel_values=pixels, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return sorted(times[1:])[len(times[1:]) // 2]


def estimate_minutes(args: argparse.Namespace) -> float:
    """The main job's wall time on this machine, from its steps' measured time (`FIXED_MINUTES`, `OVERHEAD`)."""
    stages = [
        (16, 64, math.ceil(TRAIN_IMAGES / 64) * args.pretrain_epochs),
        (24, 32, math.ceil(TRAIN_IMAGES / 32) * args.finetune_epochs),
        (36, 32, args.variant_steps),
    ]
    return FIXED_MINUTES + OVERHEAD * sum(step_seconds(size, batch) * steps for size, batch, steps in stages) / 60


def machine_load() -> tuple[float | None, int]:
    """(the machine's load, its 1-minute average of runnable processes: None where the system does not say; the
    cores this process may use): what the estimate assumes stays as it is while the job runs."""
    try:
        load = round(os.getloadavg()[0], 1)
    except (AttributeError, OSError):  # not on Unix
        load = None
    return load, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _load_text(load: float | None, cores: int) -> str:
    return f"load {load} on {cores} cores" if load is not None else f"{cores} cores"


def _duration(minutes: float) -> str:
    return f"{minutes * 60:.0f} seconds" if minutes < 2 else f"{minutes:.0f} minutes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output_dir", default=None, help="default: outputs/main (outputs/quick with --quick)")
    parser.add_argument("--pretrain_dir", default=None, help="default: outputs/pretrain (outputs/quick-pretrain)")
    parser.add_argument("--pretrain_epochs", type=int, default=None, help="default: 60 (6 with --quick)")
    parser.add_argument("--finetune_epochs", type=int, default=None, help="default: 30 (3 with --quick)")
    parser.add_argument("--variant_steps", type=int, default=None, help="default: 300 (30 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="a short version (a tenth of the training) into outputs/quick*"
    )
    args = parser.parse_args()
    quick = args.quick
    defaults = dict(
        output_dir="outputs/quick" if quick else "outputs/main",
        pretrain_dir="outputs/quick-pretrain" if quick else "outputs/pretrain",
        pretrain_epochs=6 if quick else 60,
        finetune_epochs=3 if quick else 30,
        variant_steps=30 if quick else 300,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    datasets.utils.logging.disable_propagation()  # datasets prints through its own handler: not twice
    common = ["--seed", str(args.seed), "--dataset_name", "digits", "--per_device_eval_batch_size", "256"]
    common += ["--save_strategy", "no", "--crop_scale_min", "0.7", "--logging_steps", "20"]
    common += ["--overwrite_output_dir", "True"]  # the main job's own output folders, rewritten by every run
    common += ["--dataloader_num_workers", "0"]  # as measured for the README; the scripts default to workers
    estimate, load_before = estimate_minutes(args), machine_load()
    print(
        f"The main job{' (quick version)' if quick else ''}: about {_duration(estimate)} on this machine now "
        f"({torch.get_num_threads()} threads, {_load_text(*load_before)}; measured from a few training steps at this "
        "load: other work starting or stopping on the machine changes it). `make train QUICK=1` runs a short version.",
        flush=True,
    )
    started = time.perf_counter()

    print(f"[1/3] pretraining ViT (width 96, depth 4, patch 4) on digits at 16x16 for {args.pretrain_epochs} epochs")
    pretrain_args = ["--output_dir", args.pretrain_dir, "--preset", "vit-tiny-patch16-224", "--patch_size", "4"]
    pretrain_args += ["--image_size", "16", "--config_overrides", ARCHITECTURE, "--learning_rate", "1e-3"]
    pretrain_args += ["--num_train_epochs", str(args.pretrain_epochs), "--per_device_train_batch_size", "64"]
    pretrain_args += ["--eval_strategy", "epoch"]
    pretrained = train("pretrain", *parse_args("pretrain", pretrain_args + common))
    pretrain_minutes = (time.perf_counter() - started) / 60

    print(f"[2/3] fine-tuning at 24x24 (position embeddings resampled in 2D) for {args.finetune_epochs} epochs")
    finetune_args = ["--output_dir", args.output_dir, "--model_name_or_path", args.pretrain_dir, "--image_size", "24"]
    finetune_args += ["--learning_rate", "0.03", "--num_train_epochs", str(args.finetune_epochs)]
    finetune_args += ["--per_device_train_batch_size", "32", "--eval_strategy", "epoch"]
    model_args, data_args, training_args = parse_args("finetune", finetune_args + common)
    finetuned = train("finetune", model_args, data_args, training_args)
    minutes = (time.perf_counter() - started) / 60

    output = Path(args.output_dir)
    write_beside(output / "pretraining_curves.png", (Path(args.pretrain_dir) / "training_curves.png").read_bytes())
    summary = {
        "estimated_minutes": round(estimate, 2),
        "load_at_estimate": load_before[0],
        "pretrain_test_accuracy_16x16": pretrained["eval_accuracy"],
        "finetune_test_accuracy_24x24": finetuned["eval_accuracy"],
        "test_images": finetuned.get("eval_samples"),
        "pretrain_minutes": round(pretrain_minutes, 2),
        "finetune_minutes": round(minutes - pretrain_minutes, 2),
    }
    write_beside(output / "main_job.json", json.dumps(summary, indent=2) + "\n")
    write_model_card(
        output,
        model=VisionTransformerForImageClassification.from_pretrained(output),
        metrics=finetuned,
        task="finetune",
        dataset_name="digits",
        training_args=training_args,
        repo_id="hf-vit/vit-digits-24",
        summary=(
            "A small Vision Transformer trained from scratch by hf-vit's main job (`make train`): pretrained on "
            f"scikit-learn's handwritten digits at 16x16 with the paper's pretraining recipe (test accuracy "
            f"{pretrained['eval_accuracy']:.4f}), then fine-tuned at 24x24 with the paper's fine-tuning recipe."
        ),
        resolution_note="Fine-tuned at 24x24 from a model pretrained at 16x16; the position embeddings were "
        "resampled bicubically from the 4x4 to the 6x6 patch grid before fine-tuning.",
    )
    # The paper's section 4.5 for this model: filters, position similarity, attention distance, rollout.
    digits = load_digits_dataset()["test"].select(range(8))
    write_analysis_figures(
        VisionTransformerForImageClassification.from_pretrained(output).eval(),
        VisionTransformerImageProcessor.from_pretrained(output),
        list(digits["image"]),
        output / "analysis",
        captions=[f"digit {label}" for label in digits["label"]],
        name="vit-digits-24",
    )

    print("[3/3] resolution variant at 36x36 (1.5x): accuracy as interpolated, then after a short fine-tune")
    variant_dir, variant_ft_dir = f"{args.output_dir}-36", f"{args.output_dir}-36-finetuned"
    variant = make_evaluated_variant(
        output, 36, variant_dir, repo_id="hf-vit/vit-digits-36", base_model="hf-vit/vit-digits-24", overwrite=True
    )
    short_args = ["--output_dir", variant_ft_dir, "--model_name_or_path", variant_dir, "--keep_head", "True"]
    short_args += ["--learning_rate", "0.003", "--max_steps", str(args.variant_steps), "--eval_strategy", "no"]
    short_args += ["--per_device_train_batch_size", "32", "--warmup_steps", "0.1"]
    # A gentler crop than the 0.7 of the main stages: the model only adapts to the new resolution here.
    variant_args = parse_args("finetune", short_args + common + ["--crop_scale_min", "0.85"])
    variant_ft = train("finetune", *variant_args)
    write_model_card(
        variant_ft_dir,
        model=VisionTransformerForImageClassification.from_pretrained(variant_ft_dir),
        metrics=variant_ft,
        task="finetune",
        dataset_name="digits",
        training_args=variant_args[2],
        repo_id="hf-vit/vit-digits-36-finetuned",
        base_model="hf-vit/vit-digits-36",
        summary=f"hf-vit/vit-digits-36 fine-tuned for {args.variant_steps} steps at 36x36 on the digits.",
        resolution_note="Interpolated from 24x24 to 36x36 (bicubic), then fine-tuned at 36x36, keeping its head.",
    )
    summary.update(
        variant_36_test_accuracy_interpolated=variant["eval_accuracy"],
        variant_36_test_accuracy_after_short_finetune=variant_ft["eval_accuracy"],
        variant_finetune_steps=args.variant_steps,
        total_minutes=round((time.perf_counter() - started) / 60, 2),
        load_at_end=machine_load()[0],
    )
    write_beside(output / "main_job.json", json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    # One total: the three stages, as main_job.json has it.
    load_after = _load_text(summary["load_at_end"], load_before[1])
    figure = f"test accuracy {finetuned['eval_accuracy']:.4f} on {images_text(summary['test_images'])}"
    print(
        f"wrote {output}: {figure} in {summary['total_minutes']:.1f} minutes "
        f"(estimated {estimate:.1f} at {_load_text(*load_before)}; {load_after} at the end)"
    )


if __name__ == "__main__":
    main()
