"""transformers' ViT (`ViTModel`, `ViTForImageClassification`, the `google/vit-*` checkpoints) <-> hf-vit.

Saved transformers ViT folders use the layout `vit.encoder.layer.{i}.attention.attention.query.weight`; transformers
v5 renames these in memory to `vit.layers.{i}.attention.q_proj.weight`. Both are accepted.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from ..model.configuration_vit import VisionTransformerConfig
from .common import ConversionError, convert_checkpoint, read_json, read_safetensors
from .sources import safetensors_files
from .transformers_families import (
    FAMILIES,
    IN_MEMORY_NAMES,
    TRANSFORMERS_LAYOUT,
    family_config,
    family_state_dict,
    transformers_processor,
)


def transformers_to_hf_vit_state_dict(
    state_dict: dict[str, torch.Tensor], config: VisionTransformerConfig | None = None
) -> dict[str, torch.Tensor]:
    """A transformers ViT state dict (saved or v5 in-memory names) under hf-vit names, `qkv` fused; one
    `ConversionError` lists every unplaced array and missing part (with `config`: every missing or misshapen
    weight)."""
    return TRANSFORMERS_LAYOUT.to_hf(FAMILIES["vit"].names(state_dict), config)


def hf_vit_to_transformers_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `transformers_to_hf_vit_state_dict`: hf-vit names to the saved transformers ViT layout."""
    return TRANSFORMERS_LAYOUT.from_hf(state_dict)


def hf_vit_to_transformers_module_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hf-vit weights under the names a transformers v5 `ViTForImageClassification` module has in memory."""
    saved = hf_vit_to_transformers_state_dict(state_dict)
    return {functools.reduce(lambda k, names: k.replace(*names), IN_MEMORY_NAMES, key): v for key, v in saved.items()}


def read_transformers_checkpoint(input_dir: str | os.PathLike):
    """`(config, state_dict, processor)` of a saved transformers ViT folder, in hf-vit's terms, without writing."""
    input_dir = Path(input_dir)
    config_path = input_dir / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{input_dir} has no config.json; pass the folder of a saved transformers ViT model.")
    config_json = read_json(config_path)
    if config_json.get("model_type") not in (None, "vit"):
        raise ConversionError(
            f"Expected a transformers ViT config (model_type 'vit'), got {config_json.get('model_type')!r}."
        )
    files = safetensors_files(str(input_dir), {})
    if files is None:
        raise ConversionError(
            f"{input_dir} has no model.safetensors (or sharded index); only safetensors weights are read."
        )
    source = read_safetensors(files, header_only=False)
    config = family_config({**config_json, "model_type": "vit"}, source, where=str(config_path))
    state_dict = family_state_dict("vit", source, config)
    return config, state_dict, transformers_processor(input_dir, config.image_hw)


def convert_transformers_checkpoint(
    input_dir: str | os.PathLike, output_dir: str | os.PathLike, overwrite: bool = False, base_model: str | None = None
):
    """Convert a saved transformers ViT folder into a complete hf-vit folder; a `ViTModel`'s pooler becomes the
    pre-logits layer of a model without classes. The card names `base_model` (default: the folder's name). Returns
    the model."""
    read, what = read_transformers_checkpoint, "transformers' ViT layout"
    return convert_checkpoint(read, input_dir, output_dir, overwrite, what, base_model, {})
