"""The training commands, `hf-vit-pretrain` and `hf-vit-finetune`: the flags first (`--help` and a bad flag answer at
once), then the run's imports. Apart from the other commands, so that serving's (predict, evaluate) never reach
training."""

from __future__ import annotations

import sys


def pretrain() -> int:
    """`hf-vit-pretrain`: the paper's pretraining recipe (see `hf_vit.train.training.main`)."""
    return _train("pretrain")


def finetune() -> int:
    """`hf-vit-finetune`: the paper's fine-tuning recipe (see `hf_vit.train.training.main`)."""
    return _train("finetune")


def _train(task: str) -> int:
    from ..train.arguments import build_parser, parse_args_or_exit

    if "--list_presets" in sys.argv[1:]:
        from .help import presets_text

        print(presets_text(), end="")
        return 0
    if "--help_trainer" in sys.argv[1:]:  # every flag, Trainer's ~110 included, as argparse lists them
        build_parser(task).print_help()
        return 0
    if any(flag in ("-h", "--help") for flag in sys.argv[1:]):  # hf-vit's own flags and examples first
        from .help import command_help

        print(command_help(f"hf-vit-{task}"), end="")
        return 0
    parsed = parse_args_or_exit(task)
    from ..train.training import main

    main(task, parsed=parsed)
    return 0
