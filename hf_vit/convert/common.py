"""What every converter shares: the error type, key checks, and writing a folder only once everything succeeded."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from ..configuration_vit import VisionTransformerConfig, _pair


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message lists what is wrong."""


def state_dict_problems(
    converted: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    leftovers: Iterable[str] = (),
    name: Callable[[str], str] = str,
) -> list[str]:
    """What keeps `converted` from having exactly the keys and shapes of `reference`, with the source arrays left
    unmapped; hf-vit keys are reported as `name(key)` (e.g. the source checkpoint's own names)."""
    problems = []
    leftovers = sorted(leftovers)
    if leftovers:
        problems.append(f"source arrays with no place in the model: {leftovers}")
    missing = sorted(name(key) for key in set(reference) - set(converted))
    if missing:
        problems.append(f"arrays the model needs but the checkpoint lacks: {missing}")
    extra = sorted(name(key) for key in set(converted) - set(reference))
    if extra:
        problems.append(f"arrays the model (as configured) has no place for: {extra}")
    for key in sorted(set(converted) & set(reference)):
        if tuple(converted[key].shape) != tuple(reference[key].shape):
            problems.append(
                f"{name(key)}: shape {tuple(converted[key].shape)} does not fit the model's "
                f"{tuple(reference[key].shape)}"
            )
    return problems


def check_state_dict(
    converted: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], leftovers: Iterable[str] = ()
) -> None:
    """Raise `ConversionError` unless `converted` has exactly the keys and shapes of `reference` and nothing was left
    unmapped in the source."""
    problems = state_dict_problems(converted, reference, leftovers)
    if problems:
        raise ConversionError("Cannot convert the checkpoint:\n- " + "\n- ".join(problems))


def load_preset(preset: str) -> VisionTransformerConfig:
    """The config of a named preset, its errors as `ConversionError`."""
    try:
        return VisionTransformerConfig.from_preset(preset)
    except ValueError as error:
        raise ConversionError(str(error)) from error


def image_size_field(image_size: int | Sequence[int]) -> int | list[int]:
    """`image_size` as a config field: an int for a square size, else `[height, width]`."""
    try:
        height, width = _pair(list(image_size) if not isinstance(image_size, int) else image_size, "image_size")
    except ValueError as error:
        raise ConversionError(str(error)) from error
    return height if height == width else [height, width]


def preset_mismatches(fields: Mapping[str, object], preset_config: VisionTransformerConfig, preset: str) -> list[str]:
    """The architecture fields read from a checkpoint that differ from the named preset's."""
    return [
        f"{name}: the checkpoint has {fields[name]}, preset {preset!r} has {getattr(preset_config, name)}"
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size")
        if name in fields and fields[name] != getattr(preset_config, name)
    ]


def build_config(
    base: Mapping[str, object], fields: Mapping[str, object], problems: Sequence[str], source: str
) -> VisionTransformerConfig:
    """The config inferred from the `source` checkpoint, or a `ConversionError` listing every problem found."""
    if problems:
        raise ConversionError(f"Cannot infer the model from the {source}:\n- " + "\n- ".join(problems))
    try:
        return VisionTransformerConfig(**base, **fields)
    except ValueError as error:
        raise ConversionError(f"The checkpoint's shapes do not make a valid model: {error}") from error


def check_output_dir(output_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """`output_dir` as a Path, unless it holds files and `overwrite` is off (checked before any work is done)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{output_dir} exists and is not empty; choose another folder or pass --overwrite (overwrite=True "
            "from Python)."
        )
    return output_dir


def write_converted_folder(save, output_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Call `save(tmp_dir)` and move the result to `output_dir` only if it returns without error.

    A failed conversion leaves `output_dir` as it was: nothing half-written is ever found there.
    """
    output_dir = check_output_dir(output_dir, overwrite)
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


def save_converted_model(
    config: VisionTransformerConfig,
    state_dict: Mapping[str, torch.Tensor],
    processor,
    output_dir: str | os.PathLike,
    overwrite: bool = False,
):
    """Build the classification model of `config`, load `state_dict` into it (exact keys and shapes, else
    `ConversionError`), and write it with `processor` to `output_dir` only if all of that succeeded. Returns the
    model, in eval mode."""
    from ..modeling_vit import VisionTransformerForImageClassification

    model = VisionTransformerForImageClassification(config)
    check_state_dict(state_dict, model.state_dict())
    model.load_state_dict(state_dict, strict=True)
    model.eval()

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        processor.save_pretrained(folder)

    write_converted_folder(save, output_dir, overwrite=overwrite)
    return model
