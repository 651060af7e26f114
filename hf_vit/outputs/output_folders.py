"""Output folders, in one place: a converter's or variant's folder is checked before any work, staged and swapped in
whole; a training run's `--output_dir` is claimed and locked, never written through a symlink. Only what hf-vit
wrote (`hf_vit.outputs.files`) is ever replaced or removed."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from ..model.configuration_vit import VisionTransformerConfig
from ..model.loading import current_umask
from .files import CHECKPOINT_FOLDER, LOCK_FILE, RUN_RECORD_FILE, checkpoint_foreign_entries, is_run_file
from .run_record import read_record, unrecorded_files_problem

logger = logging.getLogger(__name__)


# Beside a target `out`: `.out.hf-vit-staging-<pid>-<random>` (the new result) and `.out.hf-vit-old-<pid>` (the old).
_STAGING, _ASIDE = "hf-vit-staging", "hf-vit-old"
# Test-only: the name of a step at which the process kills itself (SIGKILL), to check what a crash there leaves.
CRASH_ENV = "HF_VIT_TEST_CRASH_AT"


class OutputFolderError(FileExistsError, ValueError):
    """An output folder cannot be written or replaced; the message names the path that blocks it and what to do."""


def check_replaceable(folder: Path) -> None:
    """Raise `OutputFolderError` unless hf-vit wrote `folder` (its config, its files only)."""
    config = folder / "config.json"
    hint = "Move it away, delete it yourself, or choose another --output."
    if not config.is_file() or config.is_symlink():
        raise OutputFolderError(
            f"--overwrite only replaces a folder hf-vit wrote, and {folder} has no config.json of an hf-vit model. "
            + hint
        )
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise OutputFolderError(
            f"{config} is not a readable JSON object ({error}); {folder} is left alone. {hint}"
        ) from error
    if model_type != VisionTransformerConfig.model_type:
        raise OutputFolderError(
            f"{config} has model_type {model_type!r}, not hf-vit's {VisionTransformerConfig.model_type!r}: "
            f"--overwrite only replaces a folder hf-vit wrote, so {folder} is left alone. {hint}"
        )
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or entry.is_dir() or not is_run_file(entry.name):
            kind = "symlink" if entry.is_symlink() else "folder" if entry.is_dir() else "file"
            raise OutputFolderError(
                f"{entry} is a {kind} hf-vit never writes into a model folder; --overwrite would delete it, so "
                f"{folder} is left alone. {hint}"
            )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def clean_leftovers(target: Path) -> list[str]:
    """Tidy what dead runs left beside `target` (an aside folder restored or removed); lines done."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.({_STAGING}|{_ASIDE})-(\d+)(-[A-Za-z0-9_]+)?")
    if not target.parent.is_dir():
        return []
    found = []
    for entry in target.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and not _pid_alive(int(match.group(2))):
            found.append((match.group(1), entry))
    done = []
    # Newest aside first: the one a restore should bring back.
    for kind, entry in sorted(found, key=lambda item: (item[0] != _ASIDE, -item[1].stat().st_mtime)):
        if kind == _ASIDE and not target.exists():
            os.rename(entry, target)
            done.append(f"restored {target} from {entry.name}, left by a run that was killed while replacing it")
        else:
            shutil.rmtree(entry)
            done.append(f"removed {entry}, left by a killed run")
    for line in done:
        logger.warning(line)
    return done


def _existing_ancestor(path: Path) -> Path:
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    return above


def _check_writable(target: Path) -> None:
    """Fail now, before any work, when the folder that will hold `target` cannot be written to."""
    ancestor = _existing_ancestor(target)
    if not ancestor.is_dir():
        raise OutputFolderError(f"{ancestor} is a file, so {target} cannot be created there; choose another --output.")
    # An existing empty target receives the files itself (see `_install`), so it must be writable too.
    folders = [ancestor] + ([target] if target.is_dir() and not any(target.iterdir()) else [])
    for folder in folders:
        try:  # a real probe: permissions alone do not show read-only mounts, and root ignores them
            os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.{_STAGING}-{os.getpid()}-", dir=folder))
        except OSError as error:
            raise OutputFolderError(
                f"cannot write to {folder} ({error.strerror or error}), so {target} cannot be written; choose a "
                "writable --output."
            ) from error


def overlap(source: Path, target: Path) -> str | None:
    """How the resolved path `target` overlaps the resolved input `source` ("is the input", ...), or None."""
    if source == target:
        return "is the input"
    if target in source.parents:
        return "contains the input"
    if source in target.parents:
        return "lies inside the input folder"
    return None


def check_outside_data_set(
    output: str | os.PathLike, dataset_name: str | os.PathLike | None, flag: str = "--output_dir"
) -> None:
    """Refuse an output folder that is, or lies inside, the local data set `dataset_name`, before any work."""
    if not dataset_name or not Path(dataset_name).expanduser().is_dir():  # digits or a Hub id
        return
    data = Path(dataset_name).expanduser().resolve()
    target = Path(output).expanduser().resolve()
    if target == data or data in target.parents:
        where = "is" if target == data else "lies inside"
        raise OutputFolderError(
            f"{flag} {output} {where} the data set --dataset_name {dataset_name}: what hf-vit writes there would "
            f"be added to your data. Choose an {flag} outside {data}."
        )


def check_not_the_base(output_dir: str | os.PathLike, model_name_or_path: str | os.PathLike | None) -> None:
    """Refuse, before any work, a `--output_dir` that is the local folder of the model the run starts from."""
    if not model_name_or_path or not Path(model_name_or_path).expanduser().is_dir():
        return
    base = Path(model_name_or_path).expanduser().resolve()
    if Path(output_dir).expanduser().resolve() == base:
        raise OutputDirError(
            f"--output_dir {output_dir} is the folder of --model_name_or_path {model_name_or_path}: the run would "
            "replace the model it starts from. Choose another --output_dir."
        )


_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def _image_folder_of(image: Path, target: Path) -> Path | None:
    """The image folder (`root/<label>/<file>`) `image` belongs to, or None."""
    root = image.parent.parent
    if root == image.parent:
        return None

    def entries(folder: Path) -> list[Path]:
        return [p for p in folder.iterdir() if not p.name.startswith(".") and p != target and p not in target.parents]

    def is_class(folder: Path) -> bool:
        files = entries(folder)
        return bool(files) and all(p.is_file() and p.suffix.lower() in _IMAGE_SUFFIXES for p in files)

    try:
        if is_class(image.parent) and all(p.is_dir() and is_class(p) for p in entries(root)):
            return root
    except OSError:
        pass
    return None


def check_outside_image_folders(
    output: str | os.PathLike, images: Iterable[str | os.PathLike], flag: str = "--output"
) -> None:
    """Refuse, before any work, an output folder that is or lies inside the image folder of one of `images`."""
    target = Path(output).expanduser().resolve()
    for image in images:
        root = _image_folder_of(Path(image).expanduser().resolve(), target)
        if root is not None and (target == root or root in target.parents):
            raise OutputFolderError(
                f"{flag} {output} lies inside the image folder {root} (the classes' folders of {image}): the figures "
                f"written there would join that data set as images of another class. Choose an {flag} outside {root}."
            )


def check_output_dir(
    output_dir: str | os.PathLike, overwrite: bool = False, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """`output_dir` as an absolute Path, checked before any work (else `OutputFolderError`): not overlapping any of
    `inputs`, a folder or nothing in a writable place, non-empty only with `overwrite` and if hf-vit wrote it; a
    killed run's leftovers beside it are cleaned first."""
    target = Path(output_dir).expanduser().resolve()
    if target == target.parent:
        raise OutputFolderError(f"{output_dir} is the filesystem root; choose a folder for the output.")
    for source in inputs:
        problem = overlap(Path(source).expanduser().resolve(), target)
        if problem:
            raise OutputFolderError(
                f"The output folder {target} {problem} ({source}); writing there could destroy the input. Choose an "
                "--output outside the input."
            )
    clean_leftovers(target)
    if target.exists() and not target.is_dir():
        raise OutputFolderError(f"{target} is a file, not a folder; --output names the folder to write the model to.")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise OutputFolderError(
                f"{target} exists and is not empty; choose another folder or pass --overwrite (overwrite=True from "
                "Python) to replace a folder hf-vit wrote."
            )
        check_replaceable(target)
    _check_writable(target)
    return target


def _crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def give_umask_modes(folder: Path) -> None:
    """Give `folder` and what it holds the modes the user's umask gives (a staging folder is made private)."""
    mask = current_umask()
    for path in (folder, *folder.rglob("*")):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _install(staging: Path, target: Path) -> None:
    """Put the complete folder `staging` at `target` so that one complete result exists at every instant."""
    give_umask_modes(staging)
    if not target.exists():
        os.rename(staging, target)
        return
    if not any(target.iterdir()):
        # An empty folder stays (it may be the user's working directory); config.json last, so an interrupted move
        # leaves no folder that looks like a complete model.
        for entry in sorted(staging.iterdir(), key=lambda path: path.name == "config.json"):
            os.rename(entry, target / entry.name)
        return
    check_replaceable(target)  # again: it may have changed while the conversion ran
    # Replacing the working directory (`--output . --overwrite`) moves it aside; this process follows the path to the
    # new folder (a shell sitting there needs `cd .`).
    in_target = Path.cwd() == target
    aside = target.parent / f".{target.name}.{_ASIDE}-{os.getpid()}"
    os.rename(target, aside)
    _crash_point("aside")
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(aside, target)
        raise
    if in_target:
        os.chdir(target)
    _crash_point("replaced")
    shutil.rmtree(aside)


def write_converted_folder(
    save: Callable[[Path], None],
    output_dir: str | os.PathLike,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
) -> Path:
    """Call `save(staging_dir)` and move the result to `output_dir` (checked first) only if it succeeds; returns the
    absolute path. An existing target is renamed aside, the new one renamed in, the old one deleted: one complete
    result exists at every instant."""
    inputs = list(inputs)
    target = check_output_dir(output_dir, overwrite, inputs)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{_STAGING}-{os.getpid()}-", dir=target.parent))
    try:
        save(staging)
        _crash_point("staged")
        _install(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


class OutputDirError(FileExistsError):
    """A run's `--output_dir` (written in place by Trainer, so claimed, not staged) cannot be used as it is."""


def _blocking_entries(folder: Path) -> list[str]:
    """Entries a run would write through or delete unwritten: symlinks, foreign `checkpoint-N`."""
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


def check_no_file_in_the_way(folder: str | os.PathLike, flag: str = "--output_dir") -> None:
    """Refuse, naming it, a file where the output folder `folder` (or a folder above it) would have to be."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputDirError(f"{flag} {folder} is a file; pass a folder.")
    above = _existing_ancestor(folder)
    if above.exists() and not above.is_dir():
        raise OutputDirError(f"{flag} {folder}: {above} is a file, so no folder can be made there; pass a folder.")


def held_entries(output_dir: str | os.PathLike) -> list[str]:
    """What `output_dir` holds that a run must not write over unasked (its lock and lone record aside)."""
    folder, own = Path(output_dir), (LOCK_FILE, f".{RUN_RECORD_FILE}.partial")
    entries = sorted(p.name for p in folder.iterdir() if p.name not in own) if folder.is_dir() else []
    return [] if entries == [RUN_RECORD_FILE] and read_record(folder) is not None else entries


def resumes_in_place(output_dir: str | os.PathLike, checkpoint: str | os.PathLike | None) -> bool:
    """Whether `checkpoint` (`--resume_from_checkpoint`) lies in `output_dir`, so the run continues there."""
    return checkpoint is not None and Path(output_dir).resolve() in Path(checkpoint).resolve().parents


def output_dir_advice(folder: str | os.PathLike, resumable: bool) -> str:
    """What lets a run use the non-empty `folder` (`resumable`: it holds a complete checkpoint)."""
    ways = ["pass --resume_from_checkpoint True to continue the run whose checkpoints it holds"] if resumable else []
    if not _blocking_entries(Path(folder)) and unrecorded_files_problem(folder) is None:
        ways.append(
            "pass --overwrite_output_dir True to train a new model there (it removes only what an earlier hf-vit run "
            "recorded writing)"
        )
    advice = "; or ".join([*ways, "choose another --output_dir"]) + "."
    return advice[0].upper() + advice[1:]


def claim_output_dir(
    output_dir: str | os.PathLike,
    *,
    resume_from: str | os.PathLike | None,
    overwrite: bool,
    main_process: bool,
    latest_checkpoint: Callable[[str | os.PathLike], str | None] | None = None,
) -> IO[Any] | None:
    """Check that a run may write into `output_dir` and lock it (the lock's file, see `release`; None off the main
    process): files in it need a resume of its own checkpoint or `overwrite` (of recorded files only), and symlinks
    or foreign `checkpoint-N` folders are refused by name."""
    folder = Path(output_dir)
    if folder.is_symlink() and not folder.is_dir():
        raise OutputDirError(f"--output_dir {folder} is a broken symlink; pass a folder.")
    check_no_file_in_the_way(folder)
    if not main_process:
        return None
    entries, in_place = held_entries(folder), resumes_in_place(folder, resume_from)
    if entries and (problems := _blocking_entries(folder)):
        raise OutputDirError(
            f"--output_dir {folder} cannot be written safely: " + "; ".join(problems) + ". Move it away, or choose "
            "another folder."
        )
    if entries and not in_place and not overwrite:
        shown = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
        elsewhere = (
            f"; the checkpoint --resume_from_checkpoint {resume_from} is another folder's, so this is a new run there"
            if resume_from is not None
            else ""
        )
        resumable = latest_checkpoint is not None and latest_checkpoint(folder) is not None
        advice = output_dir_advice(folder, resumable)
        raise OutputDirError(f"--output_dir {folder} is not empty (it holds {shown}){elsewhere}. {advice}")
    if entries and overwrite and not in_place and (problem := unrecorded_files_problem(folder)):
        raise OutputDirError(problem)
    folder.mkdir(parents=True, exist_ok=True)
    return _lock(folder)


def _lock(folder: Path) -> IO[Any]:
    """The run's lock in `folder`, held: opened without following a link planted under its name."""
    path = folder / LOCK_FILE
    try:
        lock = open(path, "a", opener=lambda name, flags: os.open(name, flags | getattr(os, "O_NOFOLLOW", 0), 0o666))
    except OSError as error:
        if not path.is_symlink():
            raise
        raise OutputDirError(f"--output_dir {folder}: {path} is a symlink; the run would write through it.") from error
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
    _held_locks.add(lock)
    return lock


def release(lock: IO[Any] | None) -> None:
    """Remove and unlock what `claim_output_dir` returned."""
    if lock is not None:
        _held_locks.discard(lock)
        Path(lock.name).unlink(missing_ok=True)
        lock.close()


# A `flock` lasts while any process holds its file open, forked data loader workers too: a run killed while they
# exit would keep its folder locked. Only the run's own process holds it.
_held_locks: set[IO[Any]] = set()


def _close_inherited_locks() -> None:
    for lock in _held_locks:
        lock.close()
    _held_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def remove_earlier_checkpoints(output_dir: str | os.PathLike, keep: str | os.PathLike | None = None) -> None:
    """`--overwrite_output_dir`: remove an earlier run's real checkpoints (but `keep`)."""
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
