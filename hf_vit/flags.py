"""Checks of flag values shared by every stage and command (`positive_int`, `parse_sizes`), the commands' one way of
ending on bad input (`error_status`, `exit_on_error`) and of saying flags have no effect (`warn_idle`). Imports
nothing of hf-vit."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def warn_idle(names: list[str], message: str) -> None:
    """Say in one warning line that `flags` have no effect on this run (`{flags}` in `message`)."""
    logger.warning(message.format(flags=", ".join(f"--{name}" for name in names)))


def positive_int(value: object, flag: str, what: str = "int") -> int:
    """`value` when it is an int of at least 1 (not a bool); else a `ValueError` naming `flag`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be a positive {what}, got {value!r}.")
    return value


def parse_sizes(text: str | None, flag: str) -> list[int] | None:
    """`"64,144,256"` as `[64, 144, 256]`; a clear error naming `flag` for anything but distinct positive ints."""
    if text is None:
        return None
    try:
        sizes = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(
            f"{flag} takes distinct positive whole numbers separated by commas (e.g. 8,16,32), got {text!r}."
        )
    return sizes


def error_status(error: Exception) -> int:
    """One `error:` line on stderr and the exit status 2 (`HF_VIT_TRACEBACK=1`: raised again)."""
    if os.environ.get("HF_VIT_TRACEBACK"):
        raise error
    print(f"error: {error_message(error)}", file=sys.stderr)
    return 2


def error_message(error: Exception) -> str:
    """`error`'s message; for a DataLoader worker's error, the worker's own message, not its traceback."""
    text = str(error)
    if not (text.startswith("Caught ") and " in DataLoader worker process " in text.split("\n", 1)[0]):
        return text
    lines = text.rstrip().splitlines()
    name = type(error).__name__
    for index in range(len(lines) - 1, 0, -1):  # the traceback's last line that is the error itself
        head, colon, message = lines[index].partition(": ")
        if colon and head.split(".")[-1] == name and not lines[index].startswith(" "):
            return " ".join([message, *(line.strip() for line in lines[index + 1 :])]).strip()
    return text


@contextlib.contextmanager
def exit_on_error(errors: tuple[type[Exception], ...] = (ValueError, OSError)) -> Iterator[None]:
    """Inside the block, `errors` end the program as `error_status` says (exit status 2)."""
    try:
        yield
    except errors as error:
        raise SystemExit(error_status(error)) from error
