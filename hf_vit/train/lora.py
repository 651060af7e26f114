"""LoRA fine-tuning with peft: low-rank adapters on the encoder's linear layers, the new head trained in full.

The attention's query, key and value are one fused linear layer (`qkv`, output rows [q; k; v]). Targets:

* `qkv` (the default): one adapter on the fused layer, ΔW = B A with B of shape (3D, r). At rank r it has exactly
  the parameter count of the usual query + value recipe at rank r (r(D + 3D) = 2 r(D + D)), and it adapts the keys too.
* `query`, `key`, `value`: the parts of `qkv` to adapt, as in PEFT's ViT guide (`query,value`). The adapter sits on
  `qkv`, and the rows of B for the other parts are zero and kept at zero (their gradients are masked), so ΔW touches
  only the parts named; those parts share one A (r·D + r·2D parameters at rank r for query and value).
* any other module name of the encoder: `proj`, `fc1`, `fc2`.

Saved adapters are peft's beside the run's `config.json` and processor; `hf_vit.lora` loads such a folder (merged)
and names the base as the user gave it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..flags import positive_int
from ..lora import base_model_name
from ..outputs.files import (
    LOCAL_BASE_FILE,  # where a local base lives on this machine: written by the run, never pushed
    write_beside,
)

logger = logging.getLogger(__name__)

QKV_PARTS = ("query", "key", "value")


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("qkv",),
    base_model_name_or_path: str | None = None,
):
    """`model` wrapped by peft with LoRA adapters of `rank` on `target_modules` (see the module docstring); the
    classifier (and pre-logits layer and DeiT's distillation head, if any) is trained in full and saved with the
    adapter. The saved adapter names `base_model_name(base_model_name_or_path)` as its base (by default the model's
    own `name_or_path`)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError(PEFT_MISSING) from error
    targets = check_lora_settings(rank, target_modules)
    parts = [index for index, part in enumerate(QKV_PARTS) if part in targets]
    modules = sorted({"qkv" if name in QKV_PARTS else name for name in targets})
    heads = [
        name
        for name in ("classifier", "pre_logits", "distillation_classifier")
        if getattr(model, name, None) is not None
    ]
    if base_model_name_or_path is not None:
        model.name_or_path = base_model_name(base_model_name_or_path)  # what peft writes as the adapter's base
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        lora_dropout=dropout,
        target_modules=modules,
        modules_to_save=heads,
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    if parts and "qkv" not in targets:
        _restrict_to_parts(peft_model, parts)
    return peft_model


PEFT_MISSING = (
    'LoRA (--lora_rank) needs peft, which is not installed: pip install "hf-vit[lora]" (or pip install peft).'
)
TARGETS = ("qkv", *QKV_PARTS, "proj", "fc1", "fc2")


def check_lora_settings(rank: int, target_modules: Sequence[str]) -> list[str]:
    """The adapted layers' names, checked: a positive `rank` and names from `TARGETS`; else a `ValueError` naming
    the flag."""
    positive_int(rank, "--lora_rank")
    targets = [name.strip() for name in target_modules if name.strip()]
    unknown = [name for name in targets if name not in TARGETS]
    if unknown or not targets:
        raise ValueError(
            f"--lora_target_modules {','.join(unknown) if unknown else repr(','.join(target_modules))}: "
            f"not a layer LoRA can adapt; choose from {', '.join(TARGETS)} (comma-separated)."
        )
    return targets


@dataclass(frozen=True)
class LoraSettings:
    """A run's LoRA flags (`--lora_rank`, 0: no adapters; `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`)
    with the model it adapts (`--model_name_or_path`) and the interpolation its position embeddings were resampled
    with (`--interpolation`)."""

    rank: int = 0
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: str = "qkv"
    base: str | None = None
    interpolation: str = "bicubic"


def check_lora_arguments(lora: LoraSettings, task: str) -> None:
    """Everything a LoRA run (`--lora_rank`) needs, checked before anything is written: peft installed, a pretrained
    model to adapt, a positive rank and known target layers. Nothing without `--lora_rank`."""
    if not lora.rank:
        return
    if task != "finetune" or not lora.base:
        raise ValueError("--lora_rank adapts a pretrained model: use finetune.py with --model_name_or_path.")
    check_lora_settings(lora.rank, lora.target_modules.split(","))
    try:
        import peft  # noqa: F401
    except ImportError as error:
        raise ValueError(PEFT_MISSING) from error


def adapt(model: nn.Module, lora: LoraSettings, output_dir: str | os.PathLike) -> nn.Module:
    """With `--lora_rank` (checked by `check_lora_arguments`), `model` wrapped with LoRA adapters, its config written
    to `output_dir` first (what `load_lora_model` rebuilds on the base); else `model` as it is."""
    if not lora.rank:
        return model
    model.config.position_interpolation = lora.interpolation
    model.config.save_pretrained(output_dir)  # the fine-tuning model the adapter belongs to
    base = os.path.expanduser(lora.base)
    if os.path.isdir(base):  # the adapter names it by its plain name: say where it is on this machine
        record = {"base_model_name_or_path": os.path.abspath(base)}
        write_beside(Path(output_dir) / LOCAL_BASE_FILE, json.dumps(record, indent=2) + "\n")
    model = apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules.split(","), lora.base)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA rank %d on %s: %d of %d parameters trained.", lora.rank, lora.target_modules, trained, total)
    return model


def _restrict_to_parts(peft_model: nn.Module, parts: list[int]) -> None:
    """Keep the rows of every `qkv` adapter's B outside `parts` at zero: ΔW then changes only those parts."""
    for name, module in peft_model.named_modules():
        if not name.endswith("attention.qkv") or not hasattr(module, "lora_B"):
            continue
        for layer in module.lora_B.values():
            weight = layer.weight
            dim = weight.shape[0] // len(QKV_PARTS)
            keep = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
            for part in parts:
                keep[part * dim : (part + 1) * dim] = 1
            with torch.no_grad():
                weight.mul_(keep)
            weight.register_hook(lambda grad, keep=keep: grad * keep)


def lora_summary(rank: int, target_modules: str, model_name_or_path: str) -> str:
    """The model card's summary of a LoRA run on `model_name_or_path`: what the folder holds and how to load it."""
    base = base_model_name(model_name_or_path)
    local = os.path.exists(os.path.expanduser(model_name_or_path))
    where = f"the local model `{base}` (pass its path as `base=`)" if local else f"the Hub model `{base}`"
    return (
        f"A LoRA adapter (peft; rank {rank} on {target_modules}, new head trained in full) for {where}. Load the "
        "fine-tuned model with `hf_vit.lora.load_lora_model(<this folder>)`; "
        "`hf_vit.lora.save_merged_model(<this folder>, <new folder>)` writes it merged, with its processor."
    )
