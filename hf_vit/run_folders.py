"""A training run's `--output_dir`: claimed (checked and locked) before any work, never written through a symlink,
and cleared of an earlier run's checkpoints only where they are checkpoints hf-vit wrote."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import IO, Any

from .files import CHECKPOINT_FOLDER, LOCK_FILE, checkpoint_foreign_entries, is_run_file

logger = logging.getLogger(__name__)


class OutputDirError(FileExistsError):
    """`--output_dir` cannot be used as it is; the message names the entry that blocks it and what to do."""


def _blocking_entries(folder: Path) -> list[str]:
    """Entries a run would write through or delete without having written them: a symlink under a name the run
    writes (the card, results, model files: the bytes would land in the link's target), and a `checkpoint-N`
    entry that is a symlink or holds anything a checkpoint does not (Trainer's rotation deletes old checkpoints)."""
    problems = []
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() and (is_run_file(entry.name) or CHECKPOINT_FOLDER.fullmatch(entry.name)):
            problems.append(
                f"{entry} is a symlink (to {os.readlink(entry)}); the run would write through it into that file"
            )
        elif CHECKPOINT_FOLDER.fullmatch(entry.name):
            if not entry.is_dir():
                problems.append(f"{entry} is a file, not a checkpoint folder")
            elif foreign := checkpoint_foreign_entries(entry):
                problems.append(
                    f"{entry} is not a checkpoint of a run (it holds {', '.join(foreign[:4])}); the run would delete "
                    "it when it rotates or replaces its checkpoints"
                )
    return problems


def claim_output_dir(
    output_dir: str | os.PathLike, *, resuming: bool, overwrite: bool, main_process: bool
) -> IO[Any] | None:
    """Check that a run may write into `output_dir` and lock it against a second run; returns the lock's file
    (close it and remove it to release, see `release`) or None on processes other than the main one.

    A folder holding files is refused unless resuming or `overwrite` says what to do with them, as transformers'
    example scripts refuse it; even then, symlinks the run would write through and `checkpoint-N` folders that are not
    checkpoints are refused by name.
    """
    folder = Path(output_dir)
    if folder.is_symlink() and not folder.is_dir():
        raise OutputDirError(f"--output_dir {folder} is a broken symlink; pass a folder.")
    if folder.exists() and not folder.is_dir():
        raise OutputDirError(f"--output_dir {folder} is a file; pass a folder.")
    if not main_process:
        return None
    entries = sorted(p.name for p in folder.iterdir() if p.name != LOCK_FILE) if folder.is_dir() else []
    if entries and not resuming and not overwrite:
        shown = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
        raise OutputDirError(
            f"--output_dir {folder} is not empty (it holds {shown}). Pass --resume_from_checkpoint True to continue "
            "the run whose checkpoints it holds, --overwrite_output_dir True to train a new model there (replacing "
            "the files of the same names), or choose another folder."
        )
    if entries and (problems := _blocking_entries(folder)):
        raise OutputDirError(
            f"--output_dir {folder} cannot be written safely: " + "; ".join(problems) + ". Move it away, or choose "
            "another folder."
        )
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / LOCK_FILE, "a")
    try:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # no advisory locks on this platform: the emptiness check above is all there is
        pass
    except OSError as error:
        lock.close()
        raise OutputDirError(
            f"Another run is writing to --output_dir {folder} right now; wait for it or choose another folder."
        ) from error
    return lock


def release(lock: IO[Any] | None) -> None:
    """Remove and unlock what `claim_output_dir` returned."""
    if lock is not None:
        Path(lock.name).unlink(missing_ok=True)
        lock.close()


def remove_earlier_checkpoints(output_dir: str | os.PathLike, keep: str | os.PathLike | None = None) -> None:
    """`--overwrite_output_dir`: remove the earlier run's `checkpoint-N` folders (left there, a later one would be
    what `--resume_from_checkpoint True` picks), once the new run has loaded its data and model, so that a run that
    fails to start deletes nothing. Only real checkpoints are removed (see `claim_output_dir`); the checkpoint the
    model was loaded from (`keep`) stays."""
    keep = Path(keep).resolve() if keep is not None and Path(keep).exists() else None
    for path in Path(output_dir).iterdir():
        if not CHECKPOINT_FOLDER.fullmatch(path.name) or path.is_symlink() or not path.is_dir():
            continue
        if keep is not None and (keep == path.resolve() or path.resolve() in keep.parents):
            logger.warning("--overwrite_output_dir: keeping %s, the checkpoint this run starts from.", path)
            continue
        if foreign := checkpoint_foreign_entries(path):
            logger.warning("--overwrite_output_dir: keeping %s: it holds %s, which no run writes.", path, foreign)
            continue
        logger.warning("--overwrite_output_dir: removing %s of the earlier run.", path)
        shutil.rmtree(path)
