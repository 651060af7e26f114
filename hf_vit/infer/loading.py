"""A saved model ready to serve (`load_model`), and the model inputs of a processed batch."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers.utils import logging as transformers_logging

from ..flags import positive_int
from ..lora import is_lora_folder, load_lora_model
from ..model.image_processing_vit import VisionTransformerImageProcessor
from ..model.layout import BATCH_FIELDS
from ..model.modeling_vit import VisionTransformerForImageClassification
from ..model.resolution import MAX_PATCH_POSITIONS


def load_model(
    model: str | os.PathLike, patch_size: int | None = None, max_num_patches: int | None = None
) -> tuple[VisionTransformerForImageClassification, Any]:
    """The classifier and image processor saved at `model` (an hf-vit folder, a foreign checkpoint by Hub id or
    folder, converted, or a LoRA run's folder, merged), in eval mode, at another `patch_size` (FlexiViT's resize) and
    on native-aspect batches of at most `max_num_patches` patches (`serving_processor`) when given."""
    check_serving_sizes(patch_size, max_num_patches)
    source = model_source(model)
    try:
        if is_lora_folder(source):
            classifier = load_lora_model(source)
            if patch_size is not None:
                classifier.set_input_size(patch_size=patch_size)
        else:
            resize = {} if patch_size is None else {"patch_size": patch_size}
            verbosity = transformers_logging.get_verbosity()
            transformers_logging.set_verbosity_error()  # a missing head is refused below, in one line
            try:
                classifier, loading = VisionTransformerForImageClassification.from_pretrained(
                    source, output_loading_info=True, **resize
                )
            finally:
                transformers_logging.set_verbosity(verbosity)
            # without a head a classifier gets a fresh random one (or, with no classes, gives its features as
            # "logits"): its scores and metrics would mean nothing
            if classifier.config.num_labels < 1 or any(
                key.startswith("classifier.") for key in loading["missing_keys"]
            ):
                raise ValueError(
                    f"--model {model} has no classification head (an encoder or backbone checkpoint): predicting or "
                    "measuring classes needs a model trained to classify. Fine-tune it on your classes first: "
                    f"hf-vit-finetune --model_name_or_path {model} --dataset_name YOUR_IMAGES --output_dir ..."
                )
    except ValueError as error:
        if patch_size is None:
            raise
        raise ValueError(f"--patch_size {patch_size}: {error}") from error
    processor = VisionTransformerImageProcessor.from_pretrained(source)
    return classifier.eval(), serving_processor(processor, classifier.config, max_num_patches)


def check_serving_sizes(patch_size: int | None = None, max_num_patches: int | None = None) -> None:
    """Refuse, by flag, a patch size or a number of patches that is not a positive int."""
    for flag, value in (("--patch_size", patch_size), ("--max_num_patches", max_num_patches)):
        if value is not None:
            positive_int(value, flag)
    if max_num_patches is not None and max_num_patches > MAX_PATCH_POSITIONS:
        raise ValueError(
            f"--max_num_patches {max_num_patches} is over the {MAX_PATCH_POSITIONS} patch positions hf-vit takes."
        )


def check_native_model(config: Any) -> None:
    """Refuse, naming `--max_num_patches`, a model that cannot take native-aspect batches."""
    if config.resnet_layers is not None:
        raise ValueError(
            "--max_num_patches: native-aspect batches need a model without a ResNet stem; this one has "
            f"resnet_layers={config.resnet_layers}. Leave --max_num_patches out: its images are resized to the "
            "model's size."
        )


def serving_processor(processor: Any, config: Any, max_num_patches: int | None = None) -> Any:
    """A copy of `processor` that serves `config`'s model: with `max_num_patches` (or the processor's own saved
    field), native-aspect batches of at most that many patches of the model's patch size, each image kept whole (no
    centre crop; packed into rows of at least that many slots when the processor packs); else the processor as
    saved."""
    changes = {}
    if max_num_patches is not None:
        changes = dict(max_num_patches=max_num_patches, do_center_crop=False)
        packed = processor.packed_sequence_length
        if packed is not None:  # a packed processor's rows hold the largest image
            changes["packed_sequence_length"] = max(packed, max_num_patches)
    if changes.get("max_num_patches", processor.max_num_patches) is not None:
        check_native_model(config)
        changes["patch_size"] = config.patch_size
    return processor.with_options(**changes)


def model_inputs(batch: dict[str, Any], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The model's inputs in a processed batch: `pixel_values` and a native-aspect batch's fields (its mask and
    grids; a packed batch's packing: `BATCH_FIELDS`, see `hf_vit.model.layout`)."""
    inputs = {key: batch[key] for key in ("pixel_values", *BATCH_FIELDS) if key in batch}
    return {key: value.to(device) for key, value in inputs.items()} if device is not None else inputs


def tokens_per_image(inputs: dict[str, torch.Tensor], patch_size: int) -> torch.Tensor:
    """The patches each image of a batch is seen as: its grid's in a native-aspect batch, else the image's."""
    if "spatial_shapes" in inputs:
        return inputs["spatial_shapes"].prod(-1).float().cpu()
    height, width = inputs["pixel_values"].shape[-2:]
    return torch.full((len(inputs["pixel_values"]),), float((height // patch_size) * (width // patch_size)))


def model_source(model: str | os.PathLike) -> str:
    """`model` as a local folder or a Hub id; a path that is neither is refused before anything loads."""
    source = os.fspath(model)
    local = os.path.expanduser(source)
    if os.path.exists(local):
        if not os.path.isdir(local):
            raise ValueError(f"--model {model}: a file, not a model folder (pass the folder holding config.json).")
        return local
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ValueError(f"--model {model}: no such folder (and not a Hugging Face Hub id).")
    return source
