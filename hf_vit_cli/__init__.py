"""The console commands' entry points (`[project.scripts]` in pyproject.toml), outside the `hf_vit` package.

Importing `hf_vit` registers its classes with transformers' Auto classes, which imports torch and transformers:
seconds on a quiet machine, tens under load. `--help` needs none of it: each command's help is saved as text beside
`hf_vit/commands/` (written by `python -m hf_vit.commands.help`, compared with the flags by the tests) and printed from
here, found without importing the package. Anything else goes on to the command in `hf_vit.commands`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import re
import sys
from functools import partial
from pathlib import Path

from . import early

TRAINING = ("hf-vit-pretrain", "hf-vit-finetune")
# Command name -> (module of hf_vit.commands, function): the same table as [project.scripts].
COMMANDS = {f"hf-vit-{task}": ("hf_vit.commands.train", task) for task in ("pretrain", "finetune")} | {
    f"hf-vit-{name}": (f"hf_vit.commands.{name}", "main")
    for name in ("convert", "resize", "export", "visualize", "push", "evaluate", "predict")
}
HELP_FLAGS = ("-h", "--help")
PRESETS_FILE = "presets.txt"  # what `--list_presets` prints, saved beside the help texts
# Flags a user guesses for the data, all of them `--dataset_name` here.
DATA_LIKE_FLAGS = ("train_dir", "data_dir", "dataset", "data", "dataset_dir", "image_dir", "images", "train_data",
                   "data_path", "dataset_path", "train_folder", "folder", "root")  # fmt: skip
RUN_FILES = ("config.json", "hf_vit_run.json")  # a model's folder, a run's folder
# Flags naming a local folder or a Hub id: a local-looking path that does not exist is a typo, told at once.
PATH_FLAGS = {
    "--model": "no such folder (and not a Hugging Face Hub id)",
    "--model_name_or_path": "no such folder (and not a Hugging Face Hub id)",
    "--dataset_name": "no such folder (and not a Hub data set name or 'digits')",
}


def saved_help(command: str, name: str | None = None) -> str | None:
    """The help text saved for `command` (or the saved file `name`), read without importing `hf_vit` (None when the
    file is missing)."""
    spec = importlib.util.find_spec("hf_vit")  # a top-level package is located, not imported
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "commands" / "help" / (name or f"{command}.txt")
    return path.read_text(encoding="utf-8") if path.is_file() else None


def run(command: str, argv: list[str] | None = None) -> int:
    """`command` with `argv` (default: the process's): its saved help for `-h`/`--help`, else the command itself."""
    argv = sys.argv[1:] if argv is None else argv
    if any(flag in HELP_FLAGS for flag in argv) or (command in TRAINING and "--list_presets" in argv):
        text = saved_help(command, PRESETS_FILE if "--list_presets" in argv and command in TRAINING else None)
        if text is not None:
            sys.stdout.write(text)
            return 0
    problem = early_problem(command, argv)
    if problem is not None:  # told before torch loads (seconds, not tens of seconds)
        print(f"error: {problem}", file=sys.stderr)
        return 2
    module, function = COMMANDS[command]
    try:
        code = getattr(importlib.import_module(module), function)()
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever the run was
        print(f"\ninterrupted. {early.resume_hint(argv) if command in TRAINING else ''}".rstrip(), file=sys.stderr)
        return 130
    return 0 if code is None else code


def flags_file(command: str) -> str:
    """The saved file of every flag `command` takes (a training command's help shows only hf-vit's own)."""
    return f"{command}-flags.txt"


def known_flags(command: str) -> set[str] | None:
    """Every flag `command` takes, from its saved files (None when they are missing: nothing is checked)."""
    listed = saved_help(command, flags_file(command)) if command in TRAINING else saved_help(command)
    if listed is None:
        return None
    return set(re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", listed)) | {"--help", "--list_presets", "--help_trainer"}


def flag_hint(flag: str, known: list[str]) -> str:
    """What an unknown `flag` (`--name[=value]`) may mean among `known` (names without dashes): `--dataset_name` for
    the data-like names users guess, where it is known, else the nearest name."""
    name = flag.lstrip("-").split("=", 1)[0].replace("-", "_")
    if name in DATA_LIKE_FLAGS and "dataset_name" in known:
        return (f"{flag}: the data set is --dataset_name (an image folder root/<label>/*.png, a save_to_disk folder, "
                "a Hub data set or 'digits')")  # fmt: skip
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"{flag}: did you mean --{close[0]}?" if close else f"{flag}: no such flag"


def early_problem(command: str, argv: list[str]) -> str | None:
    """What can be told of `argv` without importing the package: a flag `command` does not take (with the nearest
    one), a local-looking path given to a path flag that does not exist, and what `early` checks (values, presets,
    sizes, output folders, image files). None when nothing is wrong here."""
    known = known_flags(command)
    if known is not None:
        hints = []
        for word in argv:
            if word == "--":
                break
            flag = word.split("=", 1)[0]
            if not flag.startswith("--") or flag in known:
                continue
            if command not in TRAINING and sum(name.startswith(flag) for name in known) == 1:
                continue  # argparse takes an unambiguous abbreviation there (the training commands take none)
            hints.append(flag_hint(flag, [name[2:] for name in known]))
        if hints:
            more = ", --help_trainer every flag" if command in TRAINING else ""
            return f"Unknown flag(s): {'; '.join(hints)} (--help lists {command}'s flags{more})"
    for index, word in enumerate(argv[:-1]):
        if word in PATH_FLAGS and word in (known or PATH_FLAGS):
            value = argv[index + 1]
            local = value.startswith((".", "/", "~")) or value.count("/") > 1
            # below a model's or a run's folder (run/checkpoint-9), not a Hub id whose owner is a folder here too
            above = value.split("/")[0]
            local = local or ("/" in value and any(os.path.isfile(os.path.join(above, name)) for name in RUN_FILES))
            if local and not os.path.exists(os.path.expanduser(value)):
                return f"{word} {value}: {PATH_FLAGS[word]}."
    if command in TRAINING and known is not None:
        return early.training_problem(
            argv, saved_help(command, flags_file(command)), saved_help(command, PRESETS_FILE)
        )
    return early.predict_problem(argv) if command == "hf-vit-predict" else None


# One function per command: `hf_vit_cli:finetune` and the others are what [project.scripts] names.
for _command in COMMANDS:
    globals()[_command.removeprefix("hf-vit-")] = partial(run, _command)
del _command
