"""The files this project writes, in one place (a model folder, a run's folder, a checkpoint): `--overwrite`
replaces only these, a push sends only the shareable ones, the card lists the code files shipped beside the weights."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

MODEL_CODE = Path(__file__).parents[1] / "model"  # the core: exactly the code a checkpoint carries

CONFIG_FILE = "config.json"
PROCESSOR_FILE = "preprocessor_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
CARD_FILE = "README.md"
TRAINING_ARGS_FILE = "training_args.bin"
TRAINER_STATE_FILE = "trainer_state.json"
LOCK_FILE = ".hf-vit-run.lock"
LOCAL_BASE_FILE = "lora_base_path.json"  # a LoRA run's local base folder on this machine
RUN_RECORD_FILE = "hf_vit_run.json"  # a run's record: the files it wrote, how its splits were made (`run_record`)
CARD_TEMPLATE = Path(__file__).parent / "templates" / "model_card.md"

# What a run reports beside its model: metrics, curves, the card. Shareable.
RESULT_FILES = (
    CARD_FILE, "training_curves.png", "pretraining_curves.png", "all_results.json", "train_results.json",
    "eval_results.json", "test_results.json", "main_job.json", "compute_dial.json", "compute_dial.png",
)  # fmt: skip
# What Trainer writes beside a model and a checkpoint to resume it, and the run's record. Never shared from a run's
# folder: the arguments are a pickle naming local paths, the state names checkpoint paths, the record the data set's.
TRAINER_FILES = (TRAINER_STATE_FILE, TRAINING_ARGS_FILE, LOCAL_BASE_FILE, RUN_RECORD_FILE)
# A checkpoint's resume state on top of the model files (rng_state_<rank>.pth for each process of a multi-process run;
# optimizer_0 / pytorch_model_fsdp_0 are the sharded folders of FSDP's torch.distributed.checkpoint).
# ema_state.safetensors: the weights' moving average of a run with --ema_decay (`hf_vit.train.ema.EMA_FILE`).
RESUME_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "ema_state.safetensors")
RESUME_FILE_PATTERN = re.compile(r"rng_state_\d+\.pth")
RESUME_FOLDER_PATTERN = re.compile(r"(optimizer|pytorch_model_fsdp)_\d+")
CHECKPOINT_FOLDER = re.compile(r"checkpoint-(\d+)")


@lru_cache(maxsize=1)
def remote_code_files() -> tuple[str, ...]:
    """The modules copied beside a checkpoint for `trust_remote_code=True`: `hf_vit/model/`'s."""
    return tuple(sorted(path.name for path in MODEL_CODE.glob("*.py") if path.name != "__init__.py"))


def is_model_file(name: str) -> bool:
    """Whether `name` is a file of a saved model folder: config, weights (shards too), processor, code."""
    fixed = (CONFIG_FILE, PROCESSOR_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, ADAPTER_FILE, ADAPTER_CONFIG)
    return name in fixed or name in remote_code_files() or bool(SHARD_NAME.fullmatch(name))


def is_run_file(name: str) -> bool:
    """Whether a training run, converter or variant writes a top-level file called `name` into its output folder."""
    return is_model_file(name) or name in RESULT_FILES or name in TRAINER_FILES


def is_checkpoint_entry(name: str, is_dir: bool) -> bool:
    """Whether `Trainer` writes an entry called `name` into a `checkpoint-N` folder of an hf-vit run."""
    if is_dir:
        return bool(RESUME_FOLDER_PATTERN.fullmatch(name))
    listed = name in (*TRAINER_FILES, *RESUME_FILES, CARD_FILE)  # peft writes a card beside an adapter checkpoint
    return is_model_file(name) or listed or bool(RESUME_FILE_PATTERN.fullmatch(name))


def checkpoint_foreign_entries(folder: Path) -> list[str]:
    """What in a `checkpoint-N` folder a run does not write there (all, for no run's)."""
    entries = sorted(folder.iterdir())
    foreign = [
        entry.name + ("/" if entry.is_dir() else "")
        for entry in entries
        if entry.is_symlink() or not is_checkpoint_entry(entry.name, entry.is_dir())
    ]
    state = [
        entry
        for entry in entries
        if entry.name in (TRAINER_STATE_FILE, *RESUME_FILES)
        or RESUME_FILE_PATTERN.fullmatch(entry.name)
        or (entry.is_dir() and RESUME_FOLDER_PATTERN.fullmatch(entry.name))
    ]
    if not foreign and not state:
        foreign.append("(no training state: trainer_state.json, optimizer.pt, scheduler.pt or rng_state*.pth)")
    return foreign


class LinkInTheWayError(FileExistsError):
    """A file the project writes would go through a symlink; the message names the link."""


def check_not_a_link(path: str | os.PathLike) -> Path:
    """`path` as a Path; `LinkInTheWayError` naming it where it is a symlink (a dangling one too)."""
    path = Path(path)
    if path.is_symlink():
        raise LinkInTheWayError(
            f"{path} is a symlink (to {os.readlink(path)}): hf-vit never writes through a link, which would put its "
            "file where the link points. Remove the link or choose another output."
        )
    return path


def write_beside(path: str | os.PathLike, write: Callable[[IO[bytes]], None] | str | bytes) -> Path:
    """Write `path` (`write`: text, bytes or a function of the open file) into `.<name>.partial` beside it, then
    rename it over, so a failed write leaves the old file or none. A symlink at `path` is refused by name; whatever
    lies under the partial name is replaced, never written into. Returns `path`."""
    path = check_not_a_link(path)
    partial = path.with_name(f".{path.name}.partial")
    if partial.is_symlink() or partial.is_file():
        logger.warning("Replacing %s (a link or a leftover of a killed write) with a new file.", partial)
        partial.unlink()
    # O_EXCL never follows a link; O_NOFOLLOW says so again where the platform has it.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    handle = os.fdopen(os.open(partial, flags, 0o666), "wb")
    try:
        with handle:
            if callable(write):
                write(handle)
            else:
                handle.write(write.encode() if isinstance(write, str) else write)
        os.replace(partial, path)
    finally:
        if partial.is_file() and not partial.is_symlink():
            partial.unlink()
    return path
