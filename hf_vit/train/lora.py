"""LoRA fine-tuning with peft: low-rank adapters on the encoder's linear layers, the new head trained in full.

The attention's query, key and value are one fused linear layer (`qkv`, output rows [q; k; v]). Targets:

* `qkv` (the default): one adapter on the fused layer, ΔW = B A with B of shape (3D, r). At rank r it has exactly
  the parameter count of the usual query + value recipe at rank r (r(D + 3D) = 2 r(D + D)), and it adapts the keys too.
* `query`, `key`, `value`: the parts of `qkv` to adapt, as in PEFT's ViT guide (`query,value`). The adapter sits on
  `qkv`, and the rows of B for the other parts are zero and kept at zero (their gradients are masked), so ΔW touches
  only the parts named; those parts share one A (r·D + r·2D parameters at rank r for query and value).
* any other module name of the encoder: `proj`, `fc1`, `fc2`.

Saved adapters are peft's (`adapter_model.safetensors`, `adapter_config.json`) beside the run's `config.json` (the
fine-tuning model: classes, image size, pre-logits size, problem type, and `position_interpolation` when the base's
position embeddings were resampled) and its processor. `load_lora_model(folder)` rebuilds that fine-tuning model from
the base the adapter names, applies the adapter and merges it; `save_merged_model` writes it as a plain hf-vit folder
with its processor.

The adapter names its base by what the user gave (`base_model_name`): a Hub id as it is (not the folder a foreign
layout was converted through), a local folder by its plain name only, since an absolute path in `adapter_config.json`
would publish the user's file system with the adapter. On the machine that trained it, the run also records the
base's local path in `LOCAL_BASE_FILE` (a file no push carries), so that `load_lora_model(folder)`,
`from_pretrained(folder)` and `pipeline(model=folder)` find it there; elsewhere `load_lora_model(folder, base=...)`
says where it is.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..outputs.files import (
    LOCAL_BASE_FILE,
)  # where a local base lives on this machine: written by the run, never pushed

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
    if rank <= 0:
        raise ValueError(f"--lora_rank must be a positive int, got {rank}.")
    targets = [name.strip() for name in target_modules if name.strip()]
    unknown = [name for name in targets if name not in TARGETS]
    if unknown or not targets:
        raise ValueError(
            f"--lora_target_modules {','.join(unknown) if unknown else repr(','.join(target_modules))}: "
            f"not a layer LoRA can adapt; choose from {', '.join(TARGETS)} (comma-separated)."
        )
    return targets


def check_lora_arguments(model_args: Any, task: str) -> None:
    """Everything a LoRA run (`--lora_rank`) needs, checked before anything is written: peft installed, a pretrained
    model to adapt, a positive rank and known target layers. Nothing without `--lora_rank`."""
    if not getattr(model_args, "lora_rank", 0):
        return
    if task != "finetune" or not model_args.model_name_or_path:
        raise ValueError("--lora_rank adapts a pretrained model: use finetune.py with --model_name_or_path.")
    check_lora_settings(model_args.lora_rank, model_args.lora_target_modules.split(","))
    try:
        import peft  # noqa: F401
    except ImportError as error:
        raise ValueError(PEFT_MISSING) from error


def adapt(model: nn.Module, model_args: Any, task: str, output_dir: str | os.PathLike) -> nn.Module:
    """The run's adapter stage: with `--lora_rank`, `model` (the fine-tuning model, its problem type set) wrapped
    with LoRA adapters, its config written to `output_dir` first (what `load_lora_model` rebuilds on the base, with
    the interpolation its position embeddings were resampled with), the adapter naming its base as the user did.
    Without `--lora_rank`, `model` as it is."""
    if not model_args.lora_rank:
        return model
    check_lora_arguments(model_args, task)
    model.config.position_interpolation = model_args.interpolation
    model.config.save_pretrained(output_dir)  # the fine-tuning model the adapter belongs to
    base = os.path.expanduser(model_args.model_name_or_path)
    if os.path.isdir(base):  # the adapter names it by its plain name: say where it is on this machine
        record = {"base_model_name_or_path": os.path.abspath(base)}
        (Path(output_dir) / LOCAL_BASE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    model = apply_lora(
        model,
        model_args.lora_rank,
        model_args.lora_alpha,
        model_args.lora_dropout,
        model_args.lora_target_modules.split(","),
        base_model_name_or_path=model_args.model_name_or_path,
    )
    trained, total = trainable_parameters(model)
    logger.info(
        "LoRA rank %d on %s: %d of %d parameters trained.", model_args.lora_rank, model_args.lora_target_modules,
        trained, total,
    )  # fmt: skip
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


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def base_model_name(model_name_or_path: str) -> str:
    """How an adapter names its base: a Hub id as it is; a local folder by its plain name (the last part of its
    path), so that no local path is saved or published with the adapter."""
    path = os.path.expanduser(model_name_or_path)
    if os.path.exists(path) or os.path.isabs(path) or model_name_or_path.startswith((".", "~")):
        return Path(os.path.abspath(path)).name
    return model_name_or_path


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


def load_lora_model(folder: str | os.PathLike, base: str | os.PathLike | None = None):
    """The fine-tuned model of a LoRA run's `folder`, merged, in eval mode.

    The base checkpoint (`base`, default: the one named in `adapter_config.json`) is loaded as the run's fine-tuning
    model, with the settings its `config.json` records: the classes, image size (position embeddings resampled with
    the run's interpolation), pre-logits size and problem type; then the adapter is applied and merged.
    """
    from peft import PeftModel

    from ..model.configuration_vit import VisionTransformerConfig
    from ..model.modeling_vit import VisionTransformerForImageClassification

    folder = Path(folder)
    named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    base = os.fspath(base) if base is not None else (local_base(folder) or named)
    if not base:
        raise ValueError(f"{folder / 'adapter_config.json'} names no base model: pass base=<its folder or Hub id>.")
    config = VisionTransformerConfig.from_pretrained(folder)
    try:
        model = VisionTransformerForImageClassification.from_pretrained(base)
    except OSError as error:
        raise OSError(
            f"Cannot load the base model {base!r} of the LoRA adapter in {folder} ({error}). A base that was a local "
            "folder is named by its plain name only: pass load_lora_model(folder, base=<that folder>)."
        ) from error
    settings = run_settings(config)
    if tuple(model.config.image_hw) != tuple(config.image_hw):
        model.set_input_size(config.image_size, settings["interpolation"])
    model.reset_classifier(config.id2label, config.representation_size)
    model.config.problem_type = config.problem_type
    return PeftModel.from_pretrained(model, folder).merge_and_unload().eval()


def local_base(folder: str | os.PathLike) -> str | None:
    """The local folder of a LoRA run's base, as the run recorded it on this machine (None: not recorded, or no
    longer there)."""
    path = Path(folder) / LOCAL_BASE_FILE
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text()).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, str) and os.path.isdir(recorded) else None


def is_lora_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` is a LoRA run's folder: a peft adapter beside the fine-tuning config, no model weights."""
    folder = Path(folder)
    return (
        (folder / "adapter_config.json").is_file()
        and (folder / "config.json").is_file()
        and not any((folder / name).exists() for name in ("model.safetensors", "model.safetensors.index.json"))
    )


class LoraFolder:
    """A LoRA run's folder as the core's loading hook sees a foreign checkpoint (`hf_vit.model.loading`): its config
    and processor are the folder's own, its model the base with the adapter merged (`load_lora_model`). This is what
    makes `AutoModelForImageClassification.from_pretrained(folder)` and `pipeline(model=folder)` load it."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def config_dict(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return json.loads((self.folder / "config.json").read_text())

    def processor(self):
        from ..model.image_processing_vit import VisionTransformerImageProcessor

        return VisionTransformerImageProcessor.from_dict(
            json.loads((self.folder / "preprocessor_config.json").read_text())
        )

    def load_model(self, load: Any, args: tuple, kwargs: dict[str, Any]):
        from ..model.modeling_vit import VisionTransformerForImageClassification

        model_class = getattr(load, "__self__", None)
        if model_class is not None and not issubclass(VisionTransformerForImageClassification, model_class):
            raise ValueError(
                f"{self.folder} is a LoRA run's image classifier: load it with AutoModelForImageClassification "
                "(or hf_vit.lora.load_lora_model), or write it merged with hf_vit.lora.save_merged_model."
            )
        model = load_lora_model(self.folder)
        info = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return model, info


def read_lora_folder(source: str, kwargs: dict[str, Any]) -> LoraFolder | None:
    """The loading hook's reader of LoRA run folders (registered when `hf_vit` is imported)."""
    if kwargs.get("subfolder") or not os.path.isdir(source) or not is_lora_folder(source):
        return None
    return LoraFolder(source)


def run_settings(config: Any) -> dict[str, Any]:
    """The settings a LoRA run's fine-tuning model was made with, from its `config.json`."""
    return {"interpolation": getattr(config, "position_interpolation", None) or "bicubic"}


def save_merged_model(
    folder: str | os.PathLike, output_dir: str | os.PathLike, base: str | os.PathLike | None = None
) -> None:
    """Write the merged model of the LoRA run in `folder` to `output_dir` as a plain hf-vit folder (weights, config,
    code) with the run's image processor, loadable with the Auto classes and without peft."""
    from ..model.image_processing_vit import VisionTransformerImageProcessor

    model = load_lora_model(folder, base)
    model.name_or_path = ""
    model.save_pretrained(output_dir)
    VisionTransformerImageProcessor.from_pretrained(folder).save_pretrained(output_dir)
