"""LoRA fine-tuning with peft: low-rank adapters on the encoder's linear layers, the new head trained in full.

The attention's query, key and value are one fused linear layer (`qkv`, output rows [q; k; v]). Targets:

* `qkv` (the default): one adapter on the fused layer, ΔW = B A with B of shape (3D, r). At rank r it has exactly
  the parameter count of the usual query + value recipe at rank r (r(D + 3D) = 2 r(D + D)), and it adapts the keys too.
* `query`, `key`, `value`: the parts of `qkv` to adapt, as in PEFT's ViT guide (`query,value`). The adapter sits on
  `qkv`, and the rows of B for the other parts are zero and kept at zero (their gradients are masked), so ΔW touches
  only the parts named; those parts share one A (r·D + r·2D parameters at rank r for query and value).
* any other module name of the encoder: `proj`, `fc1`, `fc2`.

Saved adapters are peft's (`adapter_model.safetensors`, `adapter_config.json`): `PeftModel.from_pretrained(base,
folder)` on the fine-tuning model of the base checkpoint (`load_for_finetuning`), then `merge_and_unload()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

QKV_PARTS = ("query", "key", "value")


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("qkv",),
):
    """`model` wrapped by peft with LoRA adapters of `rank` on `target_modules` (see the module docstring); the
    classifier (and pre-logits layer, if any) is trained in full and saved with the adapter."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("LoRA needs peft: pip install 'hf-vit[lora]' (or pip install peft).") from error
    if rank <= 0:
        raise ValueError(f"--lora_rank must be a positive int, got {rank}.")
    targets = [name.strip() for name in target_modules if name.strip()]
    known = {"qkv", "proj", "fc1", "fc2", *QKV_PARTS}
    unknown = sorted(set(targets) - known)
    if unknown or not targets:
        raise ValueError(f"--lora_target_modules {unknown or targets}: choose from {sorted(known)}.")
    parts = [index for index, part in enumerate(QKV_PARTS) if part in targets]
    modules = sorted({"qkv" if name in QKV_PARTS else name for name in targets})
    heads = [name for name in ("classifier", "pre_logits") if getattr(model, name, None) is not None]
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


def load_lora_model(folder):
    """The fine-tuned model of a LoRA run's `folder`, merged: its base checkpoint (named in `adapter_config.json`)
    loaded as the fine-tuning model of the run's config (classes, image size), the adapter applied and merged."""
    import json
    from pathlib import Path

    from peft import PeftModel

    from .configuration_vit import VisionTransformerConfig
    from .training import load_for_finetuning

    folder = Path(folder)
    base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    config = VisionTransformerConfig.from_pretrained(folder)
    model = load_for_finetuning(base, config.id2label, image_size=config.image_size)
    return PeftModel.from_pretrained(model, folder).merge_and_unload().eval()
