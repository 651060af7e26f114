"""Each command's `--help`, as text saved in `hf_vit/commands/help/` so that the console commands print it without
importing the package (see `hf_vit_cli`). `python -m hf_vit.commands.help` writes the files again; the tests check that
they say what the flags say now.

A training command's help puts hf-vit's own flags (the model, the data, the recipe) and examples first; the ~110 flags
of `transformers.TrainingArguments`, which all work too, are listed by `--help_trainer`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import io
import os
import sys
import textwrap
from pathlib import Path
from unittest import mock

from hf_vit_cli import COMMANDS, PRESETS_FILE, flags_file

HELP_FOLDER = Path(__file__).parent / "help"
WIDTH = 119  # the help is saved, so its lines are wrapped at one width, not at the terminal's
COLUMNS = mock.patch.dict(os.environ, {"COLUMNS": str(WIDTH)})  # the width argparse wraps at, while help is written

TRAINING = {
    "hf-vit-pretrain": (
        "pretrain",
        "Pretrain a Vision Transformer with the paper's recipe (Adam, weight decay 0.1, linear warmup and decay, a\n"
        "pre-logits layer), or masked patch prediction (--objective mpp), on an image folder, a saved data set, the\n"
        "bundled digits or a Hub data set.",
        [
            "hf-vit-pretrain --list_presets                               # the architectures --preset names",
            "hf-vit-pretrain --preset vit-tiny-patch16-224 --image_size 64 --patch_size 8 --dataset_name images \\\n"
            "    --output_dir out/scratch --num_train_epochs 50",
            "hf-vit-pretrain --preset vit-base-patch16-224 --dataset_name images --objective mpp --output_dir out/mpp",
            "torchrun --nproc_per_node 8 $(which hf-vit-pretrain) ...     # or: accelerate launch $(which ...) ...",
        ],
    ),
    "hf-vit-finetune": (
        "finetune",
        "Fine-tune a pretrained model (an hf-vit folder, or a transformers, timm or big_vision checkpoint by folder\n"
        "or Hub id) with the paper's recipe (SGD momentum 0.9, cosine decay, clipping at 1, a new zero-initialised\n"
        "head), optionally at another resolution, at native aspect ratios, with LoRA or with a named recipe.",
        [
            "hf-vit-finetune --model_name_or_path outputs/main --dataset_name images --image_size 64 \\\n"
            "    --output_dir out/my-model --learning_rate 0.03 --num_train_epochs 20   # or outputs/quick "
            "(make train QUICK=1)",
            "hf-vit-finetune --model_name_or_path google/vit-base-patch16-224-in21k --dataset_name images \\\n"
            "    --recipe finetune --output_dir out/vit-b",
            "hf-vit-finetune --model_name_or_path out/vit-b --dataset_name images --do_train False --do_eval \\\n"
            "    --output_dir out/measured                                  # measure a checkpoint as it is",
            "torchrun --nproc_per_node 8 $(which hf-vit-finetune) ...     # or: accelerate launch $(which ...) ...",
        ],
    ),
}


def own_flags(cls: type) -> list[str]:
    """The flags a dataclass of hf-vit's adds (to `TrainingArguments`'s for its subclasses)."""
    from transformers import TrainingArguments

    inherited = (
        {f.name for f in dataclasses.fields(TrainingArguments)} if issubclass(cls, TrainingArguments) else set()
    )
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in inherited]


def _one_spelling(action: argparse.Action) -> argparse.Action:
    """`action` shown by its underscore spelling only (HfArgumentParser adds a dashed twin of each flag)."""
    shown = copy.copy(action)
    shown.option_strings = [name for name in action.option_strings if "-" not in name[2:]] or action.option_strings
    return shown


def training_help(command: str) -> str:
    """hf-vit's flags, by stage, and examples first; Trainer's flags named, with the defaults this command gives."""
    from ..train.arguments import DataArguments, ModelArguments, VisionTransformerTrainingArguments, build_parser

    task, description, examples = TRAINING[command]
    parser = build_parser(task)
    # Fine-tuning starts from --model_name_or_path: an architecture to build from scratch is pretraining's flag.
    left_out = {"preset"} if task == "finetune" else set()
    sections = (
        ("the model", ModelArguments),
        ("the data", DataArguments),
        ("the run and its recipe (beside Trainer's own flags)", VisionTransformerTrainingArguments),
    )
    with COLUMNS:
        formatter = parser.formatter_class(prog=command)
        for title, cls in sections:
            names = set(own_flags(cls)) - left_out
            formatter.start_section(f"hf-vit's flags: {title}")
            formatter.add_arguments([_one_spelling(a) for a in parser._actions if a.dest in names])
            formatter.end_section()
        text = formatter.format_help()
    defaults = {action.dest: action.default for action in parser._actions}
    trainer = (
        "learning_rate", "num_train_epochs", "per_device_train_batch_size", "weight_decay", "lr_scheduler_type",
        "warmup_steps", "max_grad_norm", "optim", "eval_strategy", "save_strategy", "save_total_limit",
    )  # fmt: skip
    shown = ", ".join(f"--{name} {getattr(defaults[name], 'value', defaults[name])}" for name in trainer)
    start = "--model_name_or_path MODEL" if task == "finetune" else "[--model_name_or_path MODEL | --preset NAME]"
    usage = f"usage: {command} {start} --dataset_name DATA --output_dir DIR ..."
    lines = [usage, "", description, "", "examples:", *(f"  {example}" for example in examples), ""]
    tail = [
        "",
        "Trainer's flags: every flag of transformers.TrainingArguments works too (about 110), with this command's "
        f"defaults for the paper's recipe: {shown}. `{command} --help_trainer` lists them all.",
        "",
    ]
    wrapped = ("\n".join(textwrap.wrap(line, WIDTH, subsequent_indent="    ")) for line in tail)
    return "\n".join(lines) + "\n" + text.rstrip("\n") + "\n" + "\n".join(wrapped)


def all_flags(command: str) -> str:
    """Every flag of a training command with its `value_kind`, one a line, for `hf_vit_cli`."""
    from ..train.arguments import build_parser

    parser = build_parser(TRAINING[command][0])
    kinds = {option: value_kind(action) for action in parser._actions for option in action.option_strings}
    return "".join(f"{option} {kinds[option]}\n".rstrip() + "\n" for option in sorted(kinds))


def value_kind(action: argparse.Action) -> str:
    """The values a flag takes: `int`, `float`, `bool`, `choice:a|b`, or nothing; `+` for several."""
    from transformers.hf_argparser import string_to_bool

    if action.nargs == 0:
        return ""
    if action.choices:
        kind = "choice:" + "|".join(str(choice) for choice in action.choices)
    else:
        kind = {int: "int", float: "float", string_to_bool: "bool"}.get(action.type, "")
    return kind + ("+" if kind and action.nargs not in (None, "?") else "")


def presets_text() -> str:
    """What `--list_presets` prints: each architecture `--preset` names, with its size."""
    from ..model.configuration_vit import VisionTransformerConfig
    from ..train.arguments import ModelArguments

    default = ModelArguments.__dataclass_fields__["preset"].default
    lines = [
        f"The architectures --preset names (hf-vit-pretrain --preset NAME builds one from scratch; default {default}):"
    ]
    for name in VisionTransformerConfig.preset_names():
        config = VisionTransformerConfig.from_preset(name)
        stem = f", ResNet stem {'-'.join(map(str, config.resnet_layers))}" if config.resnet_layers else ""
        lines.append(
            f"  {name:<28} width {config.hidden_size}, depth {config.num_hidden_layers}, heads "
            f"{config.num_attention_heads}, patch {config.patch_size}, image {config.image_size}{stem}"
        )
    return "\n".join(lines) + "\n"


def command_help(command: str) -> str:
    """What `command --help` prints: the training commands' own text, the others' argparse help."""
    if command in TRAINING:
        return training_help(command)
    module, function = COMMANDS[command]
    out = io.StringIO()
    with COLUMNS, contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        argv, sys.argv = sys.argv, [command, "--help"]
        try:
            getattr(importlib.import_module(module), function)()
        finally:
            sys.argv = argv
    return out.getvalue()


def main() -> int:
    """Write every command's help into `HELP_FOLDER`."""
    HELP_FOLDER.mkdir(exist_ok=True)
    texts = {f"{command}.txt": command_help(command) for command in COMMANDS}
    texts |= {PRESETS_FILE: presets_text()} | {flags_file(command): all_flags(command) for command in TRAINING}
    for name, text in texts.items():
        (HELP_FOLDER / name).write_text(text, encoding="utf-8")
        print(f"wrote {HELP_FOLDER / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
