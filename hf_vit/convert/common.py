"""What every converter shares: the error type, key checks, and writing a folder only once everything succeeded."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message lists what is wrong."""


def check_state_dict(
    converted: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], leftovers: Iterable[str] = ()
) -> None:
    """Raise `ConversionError` unless `converted` has exactly the keys and shapes of `reference` and nothing was left
    unmapped in the source."""
    problems = []
    leftovers = sorted(leftovers)
    if leftovers:
        problems.append(f"source arrays with no place in the model: {leftovers}")
    missing = sorted(set(reference) - set(converted))
    if missing:
        problems.append(f"model weights the source does not provide: {missing}")
    extra = sorted(set(converted) - set(reference))
    if extra:
        problems.append(f"converted weights the model does not have: {extra}")
    for key in sorted(set(converted) & set(reference)):
        if tuple(converted[key].shape) != tuple(reference[key].shape):
            problems.append(
                f"{key}: shape {tuple(converted[key].shape)} does not fit the model's {tuple(reference[key].shape)}"
            )
    if problems:
        raise ConversionError("Cannot convert the checkpoint:\n- " + "\n- ".join(problems))


def write_converted_folder(save, output_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Call `save(tmp_dir)` and move the result to `output_dir` only if it returns without error.

    A failed conversion leaves `output_dir` as it was: nothing half-written is ever found there.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{output_dir} exists and is not empty; choose another folder or pass --overwrite (overwrite=True "
            "from Python)."
        )
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        save(staging)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(staging, output_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return output_dir
