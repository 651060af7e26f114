"""How long the commands take before their first word: `hf-vit-finetune --help`, an argument error, and the
inference commands' `--help`, against transformers' own example-like script (an `HfArgumentParser` over a model
dataclass and `TrainingArguments`, as transformers' `run_image_classification.py` starts) answering `--help`.

Each command runs in a fresh process, `--repeats` times; the figures are the medians of the wall time and of the
CPU time (user + system, of the process and its children: less sensitive to other work on the machine).

    python benchmarks/cli_startup.py --repeats 5
    python benchmarks/cli_startup.py --bin .venv/bin --bin /other/checkout/.venv/bin   # e.g. before and after
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = """
from dataclasses import dataclass, field

from transformers import HfArgumentParser, TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="google/vit-base-patch16-224-in21k", metadata={"help": "checkpoint"})
    dataset_name: str = field(default=None, metadata={"help": "data set"})


HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
"""


def timed(command: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, exit status) of one fresh run of `command`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bin", action="append", help="a bin/ folder holding the hf-vit-* commands (repeatable)")
    args = parser.parse_args()
    bins = [Path(b).absolute() for b in (args.bin or [Path(sys.executable).parent])]
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "baseline.py"
        script.write_text(BASELINE)
        baseline = "transformers' HfArgumentParser + TrainingArguments script --help"
        cases = [(baseline, [sys.executable, str(script), "--help"])]
        for bin_dir in bins:
            label, finetune = f" ({bin_dir})" if len(bins) > 1 else "", str(bin_dir / "hf-vit-finetune")
            cases.append((f"hf-vit-finetune --help{label}", [finetune, "--help"]))
            cases.append((f"hf-vit-finetune --train_dir x (argument error){label}", [finetune, "--train_dir", "x"]))
            for name in ("hf-vit-predict", "hf-vit-evaluate"):
                if (bin_dir / name).exists():
                    cases.append((f"{name} --help{label}", [str(bin_dir / name), "--help"]))
        os.chdir(folder)  # from another directory, as a user runs them
        print(f"{'command':<80} {'wall s':>8} {'CPU s':>8}  (medians of {args.repeats}, fresh processes)")
        for name, command in cases:
            walls, cpus, codes = zip(*(timed(command) for _ in range(args.repeats)))
            wall, cpu = statistics.median(walls), statistics.median(cpus)
            print(f"{name:<80} {wall:8.2f} {cpu:8.2f}  exit {sorted(set(codes))}", flush=True)


if __name__ == "__main__":
    main()
