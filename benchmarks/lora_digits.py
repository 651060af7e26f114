"""LoRA against full fine-tuning on the embedded digits: test accuracy, trainable parameters, peak memory, step time.

Each fine-tune runs in its own process (peak RSS is per process), from the same pretrained model (pretrained here
at 16x16 as the main job does, unless --pretrained names one), at 24x24 with the paper's fine-tuning recipe.

    python benchmarks/lora_digits.py --output_dir /tmp/lora-digits
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

from benchmarks.recipes_digits import QUIET, run_training

ARCHITECTURE = "hidden_size=96,num_hidden_layers=4,num_attention_heads=3,intermediate_size=384"
COMMON = ["--dataset_name", "digits", "--crop_scale_min", "0.7", *QUIET]


def finetune(argv: list[str]) -> dict:
    """Run in a child process: one fine-tune, its metrics, trainable parameters and peak RSS."""
    import torch
    from transformers import TrainerCallback

    trained = {}

    class Count(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            trained["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            trained["total"] = sum(p.numel() for p in model.parameters())

    torch.manual_seed(0)
    metrics = run_training("finetune", argv, callbacks=[Count()])
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**trained, "peak_rss_mb": peak_mb, **{k: metrics[k] for k in ("eval_accuracy", "train_runtime")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=Path("/tmp/lora-digits"))
    parser.add_argument("--pretrained", type=Path, default=None)
    parser.add_argument("--pretrain_epochs", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(finetune(args.child)))
        return
    pretrained = args.pretrained
    if pretrained is None:
        pretrained = args.output_dir / "pretrain"
        pre = ["--output_dir", str(pretrained), "--patch_size", "4", "--image_size", "16"]
        pre += ["--config_overrides", ARCHITECTURE, "--num_train_epochs", str(args.pretrain_epochs)]
        pre += ["--per_device_train_batch_size", "64", "--learning_rate", "1e-3"]
        run_training("pretrain", pre + COMMON)
    runs = {
        "full fine-tuning": ["--learning_rate", "0.03"],
        "LoRA r8 qkv": ["--learning_rate", "0.1", "--lora_rank", "8"],
        "LoRA r8 query,value": ["--learning_rate", "0.1", "--lora_rank", "8", "--lora_target_modules", "query,value"],
    }
    steps, rows = None, {}
    for name, flags in runs.items():
        out = args.output_dir / name.replace(" ", "-").replace(",", "-")
        argv = ["--model_name_or_path", str(pretrained), "--output_dir", str(out), "--image_size", "24"]
        argv += ["--num_train_epochs", str(args.epochs), "--per_device_train_batch_size", "32", *COMMON, *flags]
        done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, check=True)
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
        steps = steps or json.loads((out / "trainer_state.json").read_text())["global_step"]
    print(f"digits, {args.epochs} epochs at 24x24 ({steps} steps of batch 32), from {pretrained}")
    print(f"{'':<22}{'test acc':>9}{'trained params':>16}{'of total':>10}{'peak RSS MB':>13}{'s/step':>8}")
    for name, row in rows.items():
        share = row["trainable"] / row["total"]
        print(
            f"{name:<22}{row['eval_accuracy']:>9.4f}{row['trainable']:>16,}{share:>10.1%}"
            f"{row['peak_rss_mb']:>13.0f}{row['train_runtime'] / steps:>8.3f}"
        )


if __name__ == "__main__":
    main()
