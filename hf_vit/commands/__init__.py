"""The command-line programs `pip install hf-vit` puts on the PATH (`[project.scripts]` in pyproject.toml; the
repository's `scripts/` wrap the same functions): training (`train.py`), evaluate, predict, convert, resize, export,
visualize and push, each a module whose docstring is its `--help`."""

from __future__ import annotations

import argparse
import sys


class CommandParser(argparse.ArgumentParser):
    """The non-training commands' parser: `--help` as written, a bad flag one `error:` line (exit 2)."""

    def __init__(self, prog: str, description: str | None) -> None:
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):
        print(f"error: {message} (--help lists the flags)", file=sys.stderr)
        raise SystemExit(2)
