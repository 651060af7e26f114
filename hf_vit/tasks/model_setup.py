"""The model a run trains, from its settings (`ModelSettings`, the model flags' values): a config from a preset and
flags, or a checkpoint with the flags that can change it applied (and the others refused in one line that names them).
The objectives' model builders (`objectives`, `mpp`) use it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..flags import positive_int, warn_idle
from ..model.configuration_vit import VisionTransformerConfig
from ..model.image_geometry import scaled_geometry
from ..model.image_processing_vit import VisionTransformerImageProcessor
from ..model.modeling_vit import VisionTransformerForImageClassification
from ..model.resolution import image_size_field

logger = logging.getLogger(__name__)

# The resolutions the paper trains at: 224 (pre-training), 384, 512 and 518 (fine-tuning, Table 2).
PAPER_RESOLUTIONS = (224, 384, 512, 518)
# Fields a checkpoint takes as they are given: they change how it trains, not the shapes of its weights.
TRAINING_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate")


@dataclass(frozen=True)
class ModelSettings:
    """Which model a run trains and how it is built or loaded: the values of the model flags, under their names
    (`--model_name_or_path`, `--preset`, `--image_size`, ...; see `hf_vit.train.arguments.ModelArguments`)."""

    model_name_or_path: str | None = None
    preset: str = "vit-tiny-patch16-224"
    image_size: list[int] | int | None = None
    patch_size: int | None = None
    num_channels: int | None = None
    config_overrides: str | None = None
    representation_size: int | None = None
    drop_path_rate: float | None = None
    hidden_dropout_prob: float | None = None
    interpolation: str | None = None  # None: not given (bicubic)
    keep_head: bool = False
    attn_implementation: str = "sdpa"


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
    """Parse `--config_overrides` ('a=1,b=0.5,c=gelu,resnet_layers=[3,4,9]') into typed values: each value is read
    as JSON where it is JSON (numbers, true/false/null, lists in brackets, objects in braces, quoted strings), else
    kept as the plain string. Commas inside brackets, braces or quotes belong to the value."""
    fields: dict[str, Any] = {}
    for item in _split_top_level(text or ""):
        if "=" not in item:
            raise ValueError(f"--config_overrides takes key=value pairs separated by commas, got {item!r}.")
        key, raw = (part.strip() for part in item.split("=", 1))
        if not key:
            raise ValueError(f"--config_overrides: {item!r} names no field before '='.")
        try:
            fields[key] = json.loads(raw)
        except json.JSONDecodeError as error:
            if raw and raw[0] in '[{"':  # meant as JSON
                raise ValueError(
                    f"--config_overrides {key}={raw} is not a valid JSON value ({error.msg}); write lists as "
                    "[1,2,3] and quote strings inside them."
                ) from error
            fields[key] = raw
    return fields


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets, braces and double quotes; empty items dropped."""
    items, depth, quoted, start = [], 0, False, 0
    for index, char in enumerate(text):
        if quoted:
            quoted = char != '"' or text[index - 1] == "\\"
        elif char == '"':
            quoted = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth or quoted:
        raise ValueError(f"--config_overrides {text!r} has an unclosed bracket or quote.")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def requested_fields(model: ModelSettings) -> dict[str, Any]:
    """The config fields the flags ask for: `--config_overrides`, then `--patch_size`, `--num_channels`, the dropout
    rates and `--image_size` (given flags win over the same field in the overrides)."""
    fields = parse_config_overrides(model.config_overrides)
    given = ("patch_size", "num_channels", "drop_path_rate", "hidden_dropout_prob")
    fields.update({name: value for name in given if (value := getattr(model, name)) is not None})
    if (size := parse_image_size(model.image_size)) is not None:
        fields["image_size"] = size
    return fields


def config_from_preset(model: ModelSettings, **fields: Any) -> VisionTransformerConfig:
    """`--preset` with the flags' fields (and `fields`, e.g. the classes) for a model trained from scratch, with
    `--attn_implementation`."""
    fields = {**requested_fields(model), **fields}
    attention = model.attn_implementation or "sdpa"
    config = VisionTransformerConfig.from_preset(model.preset, attn_implementation=attention, **fields)
    resolution = int(model.preset.rsplit("-", 1)[-1])
    if "image_size" not in fields and resolution not in PAPER_RESOLUTIONS:
        logger.warning(
            "--preset %s builds the model at %dx%d, a resolution the paper does not use (%s): if that is a typo, fix "
            "it; --image_size sets a resolution without this warning.",
            model.preset, resolution, resolution, ", ".join(map(str, PAPER_RESOLUTIONS)),
        )  # fmt: skip
    return config


def load_requested(model: ModelSettings, id2label: dict[int, str] | None = None, **options: Any):
    """`load_checkpoint` of `--model_name_or_path` with the flags' fields (those it takes as given, `--image_size`,
    and those that shape its weights, refused where they differ), `--interpolation` and `--attn_implementation`."""
    requested = requested_fields(model)
    settable = {name: requested.pop(name) for name in TRAINING_FIELDS if name in requested}
    return load_checkpoint(
        model.model_name_or_path,
        id2label,
        image_size=requested.pop("image_size", None),
        interpolation=model.interpolation,
        attn_implementation=model.attn_implementation,
        refuse=requested,
        **settable,
        **options,
    )


def refuse_shape_changes(config: VisionTransformerConfig, fields: dict[str, Any], source: str) -> None:
    """Refuse, in one line naming them, the fields that differ from the checkpoint's and would change its weights."""
    changed = {name: value for name, value in fields.items() if _differs(getattr(config, name, None), value)}
    if changed:
        shown = ", ".join(
            f"{name}={value!r} (the checkpoint has {getattr(config, name, None)!r})" for name, value in changed.items()
        )
        raise ValueError(
            f"--model_name_or_path {source} cannot take {shown}: they change the shapes of its weights. Drop them to "
            "train the checkpoint as it is, or drop --model_name_or_path to train --preset with them from scratch."
        )


def _differs(current: Any, wanted: Any) -> bool:
    if isinstance(current, (list, tuple)) or isinstance(wanted, (list, tuple)):
        return list(current) != list(wanted) if isinstance(current, (list, tuple)) else True
    return current != wanted


def build_classifier(task: str, settings: ModelSettings, labels: Any) -> VisionTransformerForImageClassification:
    """The classifier a run trains: fine-tuning loads `--model_name_or_path` with a new head for the data set's
    classes (`load_checkpoint`); pretraining builds `--preset` from scratch, or continues from a checkpoint. Its
    config says the problem type (`labels.problem_type`) before anything is saved."""
    if task == "finetune":
        if not settings.model_name_or_path:
            raise ValueError("Fine-tuning needs --model_name_or_path: the pretrained hf-vit folder to start from.")
        keep = settings.keep_head
        model = load_requested(
            settings, labels.id2label, keep_head=keep, representation_size=settings.representation_size
        )
    else:
        model = build_pretraining_model(settings, labels.id2label)
    model.config.problem_type = labels.problem_type
    return model


def build_pretraining_model(
    settings: ModelSettings, id2label: dict[int, str]
) -> VisionTransformerForImageClassification:
    """A model to pretrain: `preset` from scratch or `model_name_or_path` continued, keeping its head for the same
    classes (rows reordered by name) or as many of other names (renamed); other classes get a new head, which
    `--keep_head` refuses."""
    if settings.model_name_or_path:
        representation = settings.representation_size or None
        new_head = settings.representation_size is not None  # a new head for a new pre-logits layer
        source = settings.model_name_or_path
        checkpoint = VisionTransformerConfig.from_pretrained(source)
        own = [str(checkpoint.id2label[index]) for index in range(checkpoint.num_labels)]
        wanted = [str(id2label[index]) for index in range(len(id2label))]
        reorder = not new_head and own != wanted and sorted(own) == sorted(wanted)
        # Some names shared at other places, or another number of classes: a kept head would give a class another
        # class's row. (Other names altogether, as many: the head is continued under the data set's names.)
        other_classes = len(own) != len(wanted) or (own != wanted and not reorder and bool(set(own) & set(wanted)))
        if settings.keep_head and (new_head or sorted(own) != sorted(wanted)):
            raise ValueError(
                f"--keep_head keeps the head of {source}, whose classes are {own}, but "
                + ("--representation_size asks for a new one" if new_head else f"the data set's are {wanted}")
                + ": drop --keep_head to train a new head, or train on the checkpoint's classes."
            )
        if not new_head and other_classes:  # a head of the same form, new
            new_head, representation = True, checkpoint.representation_size
            logger.info(
                "Continuing %s, whose head has %d classes, on a data set of %d%s: its head (pre-logits and "
                "classifier) is replaced by a new one; the encoder is kept.",
                source, checkpoint.num_labels, len(id2label),
                "" if len(own) != len(wanted) else " of other classes",
            )  # fmt: skip
        model = load_requested(
            settings,
            id2label if new_head else None,
            representation_size=representation,
            # a kept head takes the data set's names (its rows reordered to them first); a new one has them
            names=None if new_head or reorder else id2label,
        )
        if reorder:
            reorder_head(model, wanted)
            logger.info(
                "Continuing %s on the same classes numbered in another order: its head's rows are reordered by "
                "class name to the data set's numbering.",
                source,
            )
        return model
    if settings.keep_head:
        warn_idle(["keep_head"], "{flags} keeps a checkpoint's head, but this run pretrains --preset from scratch (no "
                  "--model_name_or_path): it has no effect.")  # fmt: skip
    config = config_from_preset(settings, id2label=id2label, label2id={v: k for k, v in id2label.items()})
    representation = settings.representation_size
    config.representation_size = config.hidden_size if representation is None else (representation or None)
    config.validate_architecture()
    return VisionTransformerForImageClassification(config)


@torch.no_grad()
def reorder_head(model: VisionTransformerForImageClassification, names: list[str]) -> None:
    """Renumber the classes of `model`'s head to `names` (the same class names in another order): each output row of
    its classifier (and distillation classifier) moves to its name's new number, and the config's `id2label` and
    `label2id` become `names`'."""
    label2id = {str(name): int(index) for index, name in model.config.id2label.items()}
    order = torch.tensor([label2id[name] for name in names])
    for layer in (model.classifier, model.distillation_classifier):
        if layer is None:
            continue
        layer.weight.copy_(layer.weight[order])
        if layer.bias is not None:
            layer.bias.copy_(layer.bias[order])
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {name: index for index, name in enumerate(names)}


def load_checkpoint(
    path: str | os.PathLike,
    id2label: dict[int, str] | None = None,
    *,
    model_class: type = VisionTransformerForImageClassification,
    keep_head: bool = False,
    image_size: int | list[int] | None = None,
    representation_size: int | None = None,
    interpolation: str | None = None,
    attn_implementation: str = "sdpa",
    refuse: dict[str, Any] | None = None,
    names: dict[int, str] | None = None,
    **config_fields: Any,
):
    """The one way a run loads an hf-vit checkpoint: `model_class.from_pretrained(path)` with `config_fields` (those
    that are not None) and `names` (the classes' names), ready to train. With `id2label`, the head is replaced by a
    zero-initialised one for those classes, as the paper fine-tunes (`keep_head`: kept, the classes the checkpoint's);
    another `image_size` resamples the position embeddings (`interpolation`); `refuse`: fields that would change the
    weights' shapes, refused where they differ, except `patch_size`, resampled (FlexiViT's pseudo-inverse resize)."""
    fields = {k: v for k, v in config_fields.items() if v is not None}
    refuse = dict(refuse or {})
    patch_size = refuse.pop("patch_size", None)
    if "num_attention_heads" in refuse and _foreign_layout(path) == "timm":
        # A timm state dict does not record its heads (the fused qkv hides them): the conversion takes them as given.
        fields["num_attention_heads"] = refuse.pop("num_attention_heads")
    if names is not None:
        fields.update(id2label=names, label2id={name: index for index, name in names.items()})
    model = model_class.from_pretrained(path, attn_implementation=attn_implementation, **fields)
    config = model.config
    refuse_shape_changes(config, refuse, str(path))
    if id2label is not None and keep_head and config.id2label != id2label:
        raise ValueError(
            f"--keep_head needs the data set's classes to be the checkpoint's: {config.id2label} vs {id2label}."
        )
    new_size = image_size is not None and image_size_field(image_size) != image_size_field(config.image_size)
    new_patch = patch_size is not None and patch_size != config.patch_size
    if not (new_size or new_patch) and interpolation is not None:
        warn_idle(["interpolation"], f"{{flags}} resamples position embeddings to another --image_size or "
                  f"--patch_size, but this run keeps {path}'s ({'x'.join(map(str, config.image_hw))}, patch "
                  f"{config.patch_size}): it has no effect.")  # fmt: skip
    interpolation = interpolation or "bicubic"
    if new_size or new_patch:
        old_size, old_grid, old_patch = tuple(config.image_hw), config.grid_size, config.patch_size
        try:
            model.set_input_size(image_size if new_size else None, interpolation, patch_size=patch_size)
        except ValueError as error:
            raise ValueError(f"--model_name_or_path {path} at --patch_size/--image_size: {error}") from error
        logger.info(
            "Training at %dx%d (patch %d) a model saved at %dx%d (patch %d): position embeddings resampled (%s) from "
            "a %dx%d to a %dx%d grid of patches%s.",
            *config.image_hw, config.patch_size, *old_size, old_patch, interpolation, *old_grid, *config.grid_size,
            ", the patch embedding by FlexiViT's pseudo-inverse resize" if new_patch else "",
        )  # fmt: skip
    if id2label is not None and not keep_head:
        model.reset_classifier(id2label, representation_size)
        logger.info("New zero-initialised classifier for %d classes (the old head is dropped).", len(id2label))
    return model.train()


def _foreign_layout(path: str | os.PathLike) -> str | None:
    """ "timm", "transformers" or "jax" for a checkpoint the converters read while loading; None for hf-vit's."""
    from ..convert.sources import read_source

    foreign = read_source(os.fspath(path), {})
    return foreign.layout if foreign is not None else None


def processor_for(
    model_name_or_path: str | None,
    config: VisionTransformerConfig,
    max_num_patches: int | None = None,
    packed_sequence_length: int | None = None,
) -> VisionTransformerImageProcessor:
    """The image processor of a run: the checkpoint's (its normalisation and geometry, scaled to the model's size by
    `image_geometry.scaled_geometry`: DINOv2 at 448 resizes the shorter side to 512, then crops 448) or the default;
    RGB only for 3-channel models (the others get their images' own channels, the mean and standard deviation
    repeated per channel); native aspect ratio with `max_num_patches` patches (packed into rows of
    `packed_sequence_length` slots, when given: the folder then serves packed batches)."""
    processor = None
    if model_name_or_path:
        with contextlib.suppress(OSError):
            processor = VisionTransformerImageProcessor.from_pretrained(model_name_or_path)
    processor = processor or VisionTransformerImageProcessor()
    sizes = dict(max_num_patches=max_num_patches, patch_size=config.patch_size)
    if max_num_patches is not None:  # a native-aspect image is kept whole
        positive_int(max_num_patches, "--max_num_patches", "number of patches per image")
        sizes.update(do_center_crop=False, size=dict(zip(("height", "width"), config.image_hw)))
    processor = processor.with_options(**sizes, packed_sequence_length=packed_sequence_length)
    if max_num_patches is None:
        try:
            processor.size, processor.crop_size = scaled_geometry(
                processor.size, processor.crop_size, processor.do_center_crop, config.image_hw
            )
        except ValueError as error:
            raise ValueError(f"The processor of {model_name_or_path}: {error}") from error
    channels = config.num_channels
    processor.do_convert_rgb = channels == 3
    for name in ("image_mean", "image_std"):
        value = getattr(processor, name)
        if isinstance(value, (list, tuple)) and len(value) != channels:
            if len(set(value)) != 1:
                raise ValueError(
                    f"The model takes {channels} channel(s) but its processor's {name} has {len(value)} different "
                    f"values ({value}); save a processor with one {name} per channel beside the checkpoint."
                )
            setattr(processor, name, [value[0]] * channels)
    return processor
