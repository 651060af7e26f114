"""A training run's record in its `--output_dir` (`hf_vit_run.json`, never pushed): the files the run wrote, those
it found and left, and how its splits were made; read by `--overwrite_output_dir`, by the run's push and by evaluate
and resize ("validation" on the images the run held out)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .files import LOCK_FILE, RUN_RECORD_FILE, is_run_file, write_beside

logger = logging.getLogger(__name__)

_Signature = tuple[int, int, int]


def read_record(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The record a run left in `folder`, or None (none, or not a record hf-vit wrote)."""
    path = Path(folder) / RUN_RECORD_FILE
    if path.is_symlink() or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("files"), list):
        return None
    return record


def _project_files(folder: Path) -> dict[str, _Signature]:
    """The plain files of `folder` under names hf-vit writes, each with a signature."""
    found = {}
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.name in (LOCK_FILE, RUN_RECORD_FILE) or not is_run_file(entry.name) or entry.is_symlink():
            continue
        if entry.is_file():
            stat = entry.stat()
            found[entry.name] = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    return found


def earlier_run_files(folder: str | os.PathLike) -> list[str] | None:
    """The files of `folder` an earlier run wrote, by its record; None without a record."""
    folder = Path(folder)
    present = _project_files(folder)
    record = read_record(folder)
    if record is None:
        return sorted(present) if not present else None
    written, found = set(record["files"]), set(record.get("found", ()))
    return sorted(name for name in present if name in written or name not in found)


def unrecorded_files_problem(folder: str | os.PathLike) -> str | None:
    """Why `--overwrite_output_dir` cannot clear `folder` safely, or None."""
    folder = Path(folder)
    if earlier_run_files(folder) is not None:
        return None
    names = sorted(_project_files(folder))
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    return (
        f"--output_dir {folder} holds {shown} but no {RUN_RECORD_FILE}, the record of the hf-vit run that wrote "
        "them, so --overwrite_output_dir cannot tell whether they are an earlier run's (which it removes) or yours "
        "(which it never deletes). Move or delete them yourself, or choose another --output_dir."
    )


def remove_earlier_run_files(folder: str | os.PathLike) -> list[str]:
    """`--overwrite_output_dir`: remove what an earlier run recorded writing; their names."""
    folder = Path(folder)
    names = earlier_run_files(folder) or []
    for name in names:
        (folder / name).unlink()
    if names:
        logger.warning("--overwrite_output_dir: removed the earlier run's %s.", ", ".join(names))
    return names


class RunRecord:
    """What one run writes into its folder: `start`, `written` as it goes, then `finish`."""

    def __init__(self, folder: str | os.PathLike, splits: dict[str, Any], resuming: bool = False) -> None:
        self.folder = Path(folder)
        self.splits = splits
        earlier = read_record(self.folder) if resuming else None
        self._earlier_files = set(earlier["files"]) if earlier else set()
        self._found = set(earlier.get("found", ())) if earlier else None  # what the first run found there
        self._before: dict[str, _Signature] = {}

    def start(self) -> None:
        self._before = _project_files(self.folder)
        self._found = set(self._before) if self._found is None else self._found
        self._write(sorted(self._earlier_files), sorted(self._found))

    def written(self) -> list[str]:
        """The files (under names hf-vit writes) this run has written into its folder since `start`."""
        now = _project_files(self.folder)
        return sorted(name for name, signature in now.items() if self._before.get(name) != signature)

    def finish(self) -> list[str]:
        files = sorted(self._earlier_files | set(self.written()))
        self._write(files, sorted(self._found - set(files)))
        return files

    def _write(self, files: Iterable[str], found: Iterable[str]) -> None:
        record = {"files": list(files), "found": list(found), "splits": self.splits}
        # beside and renamed over: a run killed while writing leaves the earlier record whole, not a torn one (which
        # would read as no record, and leave the folder's files unclaimed)
        write_beside(self.folder / RUN_RECORD_FILE, json.dumps(record, indent=2) + "\n")
