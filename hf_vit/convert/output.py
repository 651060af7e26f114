"""Output folders of converted checkpoints and resolution variants: checked before any work, written to a staging
folder, swapped in whole, and carrying a model card."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ..configuration_vit import VisionTransformerConfig
from ..files import is_run_file

logger = logging.getLogger(__name__)


# Sibling folders of a target `out`: `.out.hf-vit-staging-<pid>-<random>` (the new result being written) and
# `.out.hf-vit-old-<pid>` (the old result moved aside while the new one is moved in).
_STAGING, _ASIDE = "hf-vit-staging", "hf-vit-old"
# Test-only: the name of a step at which the process kills itself (SIGKILL), to check what a crash there leaves.
CRASH_ENV = "HF_VIT_TEST_CRASH_AT"


class OutputFolderError(FileExistsError, ValueError):
    """An output folder cannot be written or replaced; the message names the path that blocks it and what to do."""


def check_replaceable(folder: Path) -> None:
    """Raise `OutputFolderError` unless `folder` is one hf-vit wrote: an hf-vit config.json and only the files hf-vit
    writes (`hf_vit.files.is_run_file`), no sub-folders, no symlinks."""
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
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_leftovers(target: Path) -> list[str]:
    """Tidy what a killed run left beside `target`; returns what was done, one line each.

    An aside folder (`.<name>.hf-vit-old-<pid>`) of a dead process is the complete old result: it is moved back when
    the target is missing (the run died between its two renames), else deleted (the new result is in place). Staging
    folders of dead processes are deleted. Folders of live processes are left to them.
    """
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


def _check_writable(target: Path) -> None:
    """Fail now, before any work, when the folder that will hold `target` cannot be written to."""
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
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


def _overlap(source: Path, target: Path) -> str | None:
    if source == target:
        return "is the input"
    if target in source.parents:
        return "contains the input"
    if source in target.parents:
        return "lies inside the input folder"
    return None


def check_output_dir(
    output_dir: str | os.PathLike, overwrite: bool = False, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """`output_dir` as an absolute Path, checked before any work is done; else `OutputFolderError`.

    It must not be, contain, or lie inside any of `inputs`; it must be a folder (or not exist yet) in a writable
    place; a non-empty folder needs `overwrite` and must be one hf-vit wrote (see `check_replaceable`). Leftovers of
    a killed earlier run beside it are cleaned first (see `clean_leftovers`).
    """
    target = Path(output_dir).expanduser().resolve()
    if target == target.parent:
        raise OutputFolderError(f"{output_dir} is the filesystem root; choose a folder for the output.")
    for source in inputs:
        problem = _overlap(Path(source).expanduser().resolve(), target)
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


def _install(staging: Path, target: Path) -> None:
    """Put the complete folder `staging` at `target` so that one complete result exists at every instant."""
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
    """Call `save(staging_dir)` and move the result to `output_dir` only if it returns without error; returns the
    absolute output path.

    The output is checked first (`check_output_dir`). The new folder is written to a staging folder beside the target;
    an existing target is renamed aside, the new one renamed in, then the old one deleted: at every instant one
    complete result is at or beside the target, and a failed conversion leaves the target as it was.
    """
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


def write_card(
    folder: str | os.PathLike,
    model,
    *,
    base_model: str,
    summary: str,
    recipe: str,
    resolution_note: str | None = None,
    repo_id: str | None = None,
    metrics: Mapping[str, object] | None = None,
    dataset_name: str | None = None,
    output_name: str | None = None,
) -> Path:
    """Write the model card of a folder the project made from `base_model` (a Hub id or a plain name, never a local
    path). Without `dataset_name` no data set is claimed in the metadata; `output_name` is the folder's final name
    (`folder` may be a staging folder), used for the repo id when none is given."""
    from ..hub import render_model_card

    unknown = "not measured"
    card = render_model_card(
        model,
        dict(metrics or {}),
        task="finetune",
        dataset_name=dataset_name or unknown,
        repo_id=repo_id or f"hf-vit/{output_name or Path(folder).name}",
        base_model=base_model,
        summary=summary,
        recipe=recipe,
        resolution_note=resolution_note,
        results_note=(
            f"Measured on the {dataset_name} {dict(metrics or {}).get('eval_split', 'test')} split by hf-vit when it "
            "wrote this folder."
            if dataset_name
            else "No metrics were measured for this folder; see the base model for its results."
        ),
    )
    if not dataset_name:
        card.data.datasets = None
        card.text = card.text.replace(f"- Data: `{unknown}`.", "- Data: as for the base model.")
    path = Path(folder) / "README.md"
    card.save(path)
    return path
