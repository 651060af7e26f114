"""The command-line programs `pip install hf-vit` puts on the PATH (`[project.scripts]` in pyproject.toml); the files
in the repository's `scripts/` folder are thin wrappers over the same functions.

    hf-vit-pretrain, hf-vit-finetune   training (`train.py`: every TrainingArguments flag; torchrun, accelerate)
    hf-vit-evaluate, hf-vit-predict    a saved model's metrics on a split; its top classes for image files
    hf-vit-convert                     foreign checkpoints (.npz, timm, transformers) to hf-vit folders
    hf-vit-resize                      resolution variants (position embeddings resampled)
    hf-vit-export                      ONNX / torch.export
    hf-vit-visualize                   the section 4.5 figures
    hf-vit-push                        a folder to the Hub, exactly the files the project writes
"""

from __future__ import annotations

import argparse
import sys


class CommandParser(argparse.ArgumentParser):
    """The non-training commands' parser: `--help` as written, a bad flag one `error:` line (exit 2)."""

    def __init__(self, prog: str, description: str | None) -> None:
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):
        print(f"error: {message} (--help lists the flags)", file=sys.stderr)
        raise SystemExit(2)
