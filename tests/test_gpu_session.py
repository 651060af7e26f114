"""benchmarks/gpu_session.sh's smoke part: the folder SMOKE_KEEP names (pytest's --basetemp, which pytest empties)."""

import os
import stat
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
# What pytest does with --basetemp: deletes the folder, then makes it anew with the checks' scratch folder in it.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1 $2" = "-m pytest" ]; then
    while [ $# -gt 0 ]; do [ "$1" = --basetemp ] && base=$2; shift; done
    [ -z "${base:-}" ] || { rm -rf "$base" && mkdir -p "$base/smoke" && echo run >"$base/smoke/check.log"; }
fi
"""


def smoke(tmp_path: Path, keep: Path) -> subprocess.CompletedProcess:
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PY": str(python), "OUT": str(tmp_path / "out"), "SMOKE_KEEP": str(keep)}
    return subprocess.run(["bash", str(SCRIPT), "smoke"], cwd=tmp_path, env=env, capture_output=True, text=True)


def test_smoke_keep_never_empties_a_folder_of_the_users(tmp_path):
    folder = tmp_path / "mine"
    (folder / "smoke").mkdir(parents=True)  # a folder of its own named as the checks' scratch is
    (folder / "notes.txt").write_text("precious")
    run = smoke(tmp_path, folder)
    assert run.returncode == 2 and f"SMOKE_KEEP={folder} holds files the smoke checks did not write" in run.stderr
    assert (folder / "notes.txt").read_text() == "precious"
    assert sorted(path.name for path in folder.iterdir()) == ["notes.txt", "smoke"]


def test_smoke_keep_takes_a_new_or_empty_folder_and_its_own_again(tmp_path):
    for folder in (tmp_path / "new", tmp_path / "empty"):
        if folder.name == "empty":
            folder.mkdir()
        for _ in range(2):  # the second run empties what the first left (marked as the checks' own)
            run = smoke(tmp_path, folder)
            assert run.returncode == 0, run.stderr
            assert sorted(path.name for path in folder.iterdir()) == [".hf-vit-smoke", "smoke"]
            assert (folder / "smoke" / "check.log").read_text() == "run\n"
