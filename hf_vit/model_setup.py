"""The model a run trains, from its arguments: a config from a preset and flags, or a checkpoint with the flags that
can change it applied (and the others refused in one line that names them).

`model_args` is `hf_vit.arguments.ModelArguments` (or anything with its fields). Nothing here imports the modules
that build the run, so the objectives' model builders (`hf_vit.objectives`, `hf_vit.pretraining`) can use it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .configuration_vit import VisionTransformerConfig, image_size_field

logger = logging.getLogger(__name__)

# Fields a checkpoint takes as they are given: they change how it trains, not the shapes of its weights.
TRAINING_FIELDS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "drop_path_rate",
    "mpp_corrupt_ratio",
    "mpp_mask_ratio",
    "mpp_random_ratio",
)


def parse_image_size(value: list[int] | int | None) -> int | list[int] | None:
    """`--image_size` (N, or H W) as the config stores it; None when not given."""
    if value is None or value == []:
        return None
    if isinstance(value, int):
        return value
    if len(value) not in (1, 2):
        raise ValueError(f"--image_size takes N or H W, got {value}.")
    return value[0] if len(value) == 1 or value[0] == value[1] else list(value)


def parse_config_overrides(text: str | None) -> dict[str, Any]:
    """Parse `--config_overrides` ('a=1,b=0.5,c=gelu') into typed values."""
    fields: dict[str, Any] = {}
    for item in filter(None, (text or "").split(",")):
        if "=" not in item:
            raise ValueError(f"--config_overrides takes key=value pairs separated by commas, got {item!r}.")
        key, raw = (part.strip() for part in item.split("=", 1))
        try:
            fields[key] = json.loads(raw)
        except json.JSONDecodeError:
            fields[key] = raw
    return fields


def requested_fields(model_args: Any) -> dict[str, Any]:
    """The config fields the flags ask for: `--config_overrides`, then `--patch_size`, `--num_channels`, the dropout
    rates and `--image_size` (given flags win over the same field in the overrides)."""
    fields = parse_config_overrides(getattr(model_args, "config_overrides", None))
    for name in ("patch_size", "num_channels", "drop_path_rate", "hidden_dropout_prob"):
        if getattr(model_args, name, None) is not None:
            fields[name] = getattr(model_args, name)
    if (size := parse_image_size(getattr(model_args, "image_size", None))) is not None:
        fields["image_size"] = size
    return fields


def config_from_preset(model_args: Any, **fields: Any) -> VisionTransformerConfig:
    """`--preset` with the flags' fields (and `fields`, e.g. the classes) for a model trained from scratch, with
    `--attn_implementation`."""
    fields = {**requested_fields(model_args), **fields}
    attention = getattr(model_args, "attn_implementation", None) or "sdpa"
    config = VisionTransformerConfig.from_preset(model_args.preset, attn_implementation=attention, **fields)
    config.validate_architecture()
    return config


def load_checkpoint(model_class: type, model_args: Any, interpolation: str = "bicubic", **fields: Any):
    """`model_class.from_pretrained(--model_name_or_path)` with the flags applied: dropout rates (and masked patch
    prediction's corruption ratios) as given, `--image_size` by resampling the position embeddings in 2D; a flag that
    would change the shape of the checkpoint's weights (`--patch_size`, a width, a depth...) is refused in one line
    that names it, rather than ignored. `fields` go to `from_pretrained` (e.g. the classes)."""
    requested = requested_fields(model_args)
    settable = {name: requested.pop(name) for name in TRAINING_FIELDS if name in requested}
    image_size = requested.pop("image_size", None)
    model = model_class.from_pretrained(
        model_args.model_name_or_path, attn_implementation=model_args.attn_implementation, **settable, **fields
    )
    config = model.config
    changed = {name: value for name, value in requested.items() if _differs(getattr(config, name, None), value)}
    if changed:
        shown = ", ".join(
            f"{name}={value!r} (the checkpoint has {getattr(config, name, None)!r})" for name, value in changed.items()
        )
        raise ValueError(
            f"--model_name_or_path {model_args.model_name_or_path} cannot take {shown}: they change the shapes of its "
            "weights. Drop them to train the checkpoint as it is, or drop --model_name_or_path to train --preset "
            "with them from scratch."
        )
    if image_size is not None and image_size_field(image_size) != image_size_field(config.image_size):
        old_size, old_grid = tuple(config.image_hw), config.grid_size
        model.set_input_size(image_size, interpolation)
        logger.info(
            "Training at %dx%d a model saved at %dx%d: position embeddings resampled (%s) from a %dx%d to a %dx%d "
            "grid of patches.",
            *config.image_hw, *old_size, interpolation, *old_grid, *config.grid_size,
        )  # fmt: skip
    return model


def _differs(current: Any, wanted: Any) -> bool:
    if isinstance(current, (list, tuple)) or isinstance(wanted, (list, tuple)):
        return list(current) != list(wanted) if isinstance(current, (list, tuple)) else True
    return current != wanted
