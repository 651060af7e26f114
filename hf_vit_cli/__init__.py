"""The console commands' entry points (`[project.scripts]` in pyproject.toml), outside the `hf_vit` package.

Importing `hf_vit` registers its classes with transformers' Auto classes, which imports torch and transformers:
seconds on a quiet machine, tens under load. `--help` needs none of it: each command's help is saved as text beside
`hf_vit/commands/` (written by `python -m hf_vit.commands.help`, compared with the flags by the tests) and printed from
here, found without importing the package. Anything else goes on to the command in `hf_vit.commands`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import partial
from pathlib import Path

TRAINING = ("hf-vit-pretrain", "hf-vit-finetune")
# Command name -> (module of hf_vit.commands, function): the same table as [project.scripts].
COMMANDS = {
    "hf-vit-pretrain": ("hf_vit.commands.train", "pretrain"),
    "hf-vit-finetune": ("hf_vit.commands.train", "finetune"),
    "hf-vit-convert": ("hf_vit.commands.convert", "main"),
    "hf-vit-resize": ("hf_vit.commands.resize", "main"),
    "hf-vit-export": ("hf_vit.commands.export", "main"),
    "hf-vit-visualize": ("hf_vit.commands.visualize", "main"),
    "hf-vit-push": ("hf_vit.commands.push", "main"),
    "hf-vit-evaluate": ("hf_vit.commands.evaluate", "main"),
    "hf-vit-predict": ("hf_vit.commands.predict", "main"),
}
HELP_FLAGS = ("-h", "--help")
PRESETS_FILE = "presets.txt"  # what `--list_presets` prints, saved beside the help texts


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
    module, function = COMMANDS[command]
    code = getattr(importlib.import_module(module), function)()
    return 0 if code is None else code


# One function per command: `hf_vit_cli:finetune` and the others are what [project.scripts] names.
pretrain = partial(run, "hf-vit-pretrain")
finetune = partial(run, "hf-vit-finetune")
convert = partial(run, "hf-vit-convert")
resize = partial(run, "hf-vit-resize")
export = partial(run, "hf-vit-export")
visualize = partial(run, "hf-vit-visualize")
push = partial(run, "hf-vit-push")
evaluate = partial(run, "hf-vit-evaluate")
predict = partial(run, "hf-vit-predict")
