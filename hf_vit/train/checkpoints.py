"""Checkpoints a run can resume from: which `checkpoint-N` folders were written to the end, and what
`--resume_from_checkpoint` names. Trainer writes `trainer_state.json` last, so a folder without a readable one, or
with a truncated file, is what a run killed (or out of disk) while saving leaves behind."""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..outputs.output_folders import held_entries, output_dir_advice

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What keeps the `checkpoint-N` folder `path` from being resumed exactly (see the module); empty when nothing
    does."""
    path = Path(path)
    problems = []
    state = path / "trainer_state.json"
    try:
        json.loads(state.read_text())
    except FileNotFoundError:
        problems.append(f"{state} is missing")
    except (OSError, ValueError) as error:
        problems.append(f"{state} is cut off or unreadable ({error})")
    # The model files a run writes into a checkpoint: the full model's weights (one file or shards), a LoRA run's
    # adapter, or FSDP's sharded folder. Each JSON file beside them is read again when resuming.
    for name in ("config.json", "adapter_config.json", "model.safetensors.index.json"):
        if (path / name).exists():
            try:
                json.loads((path / name).read_text())
            except (OSError, ValueError) as error:
                problems.append(f"{path / name} is cut off or unreadable ({error})")
    weights = [path / name for name in ("model.safetensors", "adapter_model.safetensors") if (path / name).exists()]
    weights += sorted(path.glob("model-*-of-*.safetensors"))
    if not weights and not any(path.glob("pytorch_model_fsdp_*")):
        problems.append(
            f"{path} holds no model weights (model.safetensors, or adapter_model.safetensors for a LoRA run)"
        )
    # A run with --ema_decay writes the average first: a cut one is as unusable as cut weights.
    weights += [path / "ema_state.safetensors"] if (path / "ema_state.safetensors").exists() else []
    for file in weights:
        try:
            with safe_open(file, "pt"):
                pass
        except (OSError, SafetensorError) as error:
            problems.append(f"{file} is truncated or corrupted ({error})")
    # torch.save writes a zip archive, whose directory is at its end: a cut file has none. The random states
    # (rng_state.pth, rng_state_<rank>.pth) are read by torch.load when resuming, with a raw traceback if cut.
    states = ["optimizer.pt", "scheduler.pt", *sorted(p.name for p in path.glob("rng_state*.pth"))]
    for name in states:
        if (path / name).exists():
            try:
                zipfile.ZipFile(path / name).close()
            except (OSError, zipfile.BadZipFile) as error:
                problems.append(f"{path / name} is truncated or corrupted ({error})")
    return problems


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` folder in `output_dir` that was written to the end; incomplete ones are skipped
    (and named in a warning)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name)))
    for _, path in reversed(found):
        problems = checkpoint_problems(path)
        if not problems:
            return str(path)
        logger.warning("Skipping %s: it is incomplete (%s).", path, "; ".join(problems))
    return None


def resumable_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The checkpoint `--resume_from_checkpoint True` resumes in `output_dir`: the newest complete one, where it holds
    its optimizer's state (one saved with --save_only_model is refused, `resolve_resume`); else None."""
    checkpoint = last_complete_checkpoint(output_dir)
    return checkpoint if checkpoint is not None and _has_optimizer_state(checkpoint) else None


def _has_optimizer_state(checkpoint: str | os.PathLike) -> bool:
    return any((Path(checkpoint) / name).exists() for name in ("optimizer.pt", "optimizer_0"))


def resolve_resume(
    resume: str | bool | None, output_dir: str | os.PathLike, overwrite_output_dir: bool = False
) -> str | None:
    """The checkpoint folder `--resume_from_checkpoint` (`resume`) names in `output_dir`, checked; None for none."""
    if resume in (None, False, "False", "false", ""):
        return None
    if resume in (True, "True", "true"):
        checkpoint = last_complete_checkpoint(output_dir)
        if checkpoint is None:
            held = held_entries(output_dir)
            if held and not overwrite_output_dir:
                shown = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "")
                raise ValueError(
                    f"--resume_from_checkpoint True: --output_dir {output_dir} holds no complete checkpoint-N folder "
                    f"to resume from (it holds {shown}). {output_dir_advice(output_dir, resumable=False)}"
                )
            logger.warning("No complete checkpoint in %s: training from the start.", output_dir)
            return None
    else:
        checkpoint = str(resume)
        if not Path(checkpoint).is_dir():
            raise FileNotFoundError(f"--resume_from_checkpoint {checkpoint}: no such checkpoint folder.")
        problems = checkpoint_problems(checkpoint)
        if problems:
            raise ValueError(
                f"Cannot resume from {checkpoint}: " + "; ".join(problems) + ". It was probably cut off while saving: "
                "pass --resume_from_checkpoint True to take the last complete checkpoint."
            )
    if not _has_optimizer_state(checkpoint):
        raise ValueError(
            f"{checkpoint} holds the weights only (it was saved with --save_only_model): resuming from it would "
            "restart the optimizer state and the learning-rate schedule, which is not the run it came from. To "
            f"train on from its weights, start a new run with --model_name_or_path {checkpoint}."
        )
    return checkpoint
