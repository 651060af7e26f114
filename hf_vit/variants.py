"""Resolution variants of a saved model (the paper's section 3.2): the same weights at another image size, written as
a folder ready to share (model, processor, model card, and the accuracy measured right after the interpolation)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .convert.common import read_safetensors
from .flags import positive_int
from .infer.loading import serving_processor
from .model.configuration_vit import VisionTransformerConfig
from .model.image_geometry import scaled_geometry
from .model.image_processing_vit import VisionTransformerImageProcessor
from .model.modeling_vit import VisionTransformerForImageClassification, VisionTransformerModel
from .model.resolution import grid_for
from .outputs.cards import write_card
from .outputs.files import write_beside
from .outputs.output_folders import check_output_dir, check_outside_data_set, write_converted_folder
from .outputs.run_record import RunRecord, read_record

if TYPE_CHECKING:  # the data set libraries load only when a variant is measured
    from .data.datasets import DataSource

POSITION_KEY = "embeddings.position_embedding"


def _check_checkpoint_positions(folder: Path, config: VisionTransformerConfig) -> None:
    """Fail clearly when a saved folder's position embeddings do not fit its own config."""
    weights = folder / "model.safetensors"
    if not weights.is_file():
        return  # sharded or missing weights: from_pretrained reports those itself
    shapes = read_safetensors([weights])  # the header's shapes
    key = next((k for k in shapes if k == POSITION_KEY or k.endswith("." + POSITION_KEY)), None)
    if key is None:
        raise ValueError(f"{weights} has no position embeddings ({POSITION_KEY}); is it an hf-vit checkpoint?")
    shape = tuple(shapes[key].shape)
    expected = config.num_position_prefix_tokens + config.num_patches
    if len(shape) != 3 or shape[1] != expected or shape[2] != config.hidden_size:
        rows, cols = config.grid_size
        raise ValueError(
            f"The position embeddings in {weights} have shape {shape}, but its config describes a {rows}x{cols} grid "
            f"with {config.num_position_prefix_tokens} class token(s) and width {config.hidden_size}, i.e. "
            f"(1, {expected}, {config.hidden_size}). Fix image_size/patch_size in config.json to match the weights."
        )


def make_resolution_variant(
    source: str | os.PathLike,
    image_size: int | Sequence[int] | None,
    output_dir: str | os.PathLike | None = None,
    mode: str = "bicubic",
    overwrite: bool = False,
    *,
    base_model: str | None = None,
    repo_id: str | None = None,
    data_source: DataSource | None = None,
    patch_size: int | None = None,
    max_num_patches: int | None = None,
):
    """The hf-vit folder `source` at `image_size` and `patch_size` (None: the source's), positions and patch
    embedding resampled, config and processor set to the new sizes (`max_num_patches`: native-aspect batches).
    Returns `(model, processor)`; with `output_dir`, writes the variant with a card and the source run's splits, and
    with `data_source` its accuracy measured untrained."""
    folder = Path(source)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(source)!r} is not an hf-vit model folder (no config.json there). Pass the folder that a training "
            "run or `save_pretrained` wrote; to start from a Hub model, download it first (`hf download <id> "
            "--local-dir <folder>`)."
        )
    if output_dir is not None and data_source is not None:
        check_outside_data_set(output_dir, data_source.dataset_name, "--output")
    target = check_output_dir(output_dir, overwrite, [source]) if output_dir is not None else None
    config = VisionTransformerConfig.from_pretrained(folder)
    try:
        processor = VisionTransformerImageProcessor.from_pretrained(folder)
    except OSError:
        processor = VisionTransformerImageProcessor()
    _check_sizes(folder, config, processor, image_size, patch_size, max_num_patches)
    before = (config.image_hw, config.grid_size, config.patch_size, processor.max_num_patches)
    model = _resized_model(folder, config, image_size, mode, patch_size)
    processor = _resized_processor(processor, model.config, max_num_patches)
    if target is None:
        return model, processor
    metrics = _measured(folder, model, processor, data_source) if data_source is not None else {}
    base_model = base_model or folder.expanduser().resolve().name
    what, note = _changes(before, model.config, processor, mode)
    splits = (read_record(folder) or {}).get("splits")

    def save(path: Path) -> None:
        record = RunRecord(path, splits) if splits else None  # the source run's splits travel with its variants
        if record is not None:
            record.start()
        model.save_pretrained(path)
        processor.save_pretrained(path)
        write_card(
            path, model, base_model=base_model, repo_id=repo_id, output_name=target.name, metrics=metrics,
            dataset_name=data_source.dataset_name if data_source is not None else None,
            summary=f"A resolution variant of `{base_model}`: the same weights with the {what}, not trained after.",
            resolution_note=note,
            recipe=f"no training after the interpolation; see `{base_model}` for how its weights were trained.",
        )  # fmt: skip
        if metrics:
            write_beside(path / "all_results.json", json.dumps(metrics, indent=2) + "\n")
        if record is not None:
            record.finish()

    write_converted_folder(save, target, overwrite=overwrite, inputs=[source])
    return model, processor


def _measured(folder: Path, model, processor, data_source: DataSource) -> dict:
    """The variant's metrics as `eval_*`, as hf-vit-evaluate measures them."""
    from .infer import evaluate  # loads the data set libraries: only to measure

    prepared = evaluate.evaluation_split(model.config, evaluate.recorded_source(folder, data_source))
    measured, _ = evaluate.measure_split(model.eval(), processor, prepared)
    split = next(key for key in measured if key.endswith("_samples")).removesuffix("_samples")
    return {**{f"eval_{key.removeprefix(split + '_')}": value for key, value in measured.items()}, "eval_split": split}


def _check_sizes(folder: Path, config, processor, image_size, patch_size, max_num_patches) -> None:
    """Refuse sizes the variant cannot honour before anything big loads."""
    if patch_size is not None:
        positive_int(patch_size, "--patch_size", "number of pixels")
    if max_num_patches is not None:
        positive_int(max_num_patches, "--max_num_patches", "number of patches")
    budget = processor.max_num_patches
    if image_size is not None and budget is not None:
        size = "x".join(map(str, image_size)) if isinstance(image_size, Sequence) else image_size
        raise ValueError(
            f"--image_size {size}: {folder} serves native-aspect batches (its processor's max_num_patches is "
            f"{budget}): each image is resized to the largest grid of at most {budget} patches whatever the image "
            f"size, so --image_size would change nothing it sees. Resize it by its patch budget: --max_num_patches N "
            f"(e.g. {4 * budget} for images seen at twice the side)."
        )
    grid_for(config.image_hw if image_size is None else image_size, patch_size or config.patch_size)
    _check_checkpoint_positions(folder, config)


def _resized_model(folder: Path, config, image_size, mode: str, patch_size: int | None):
    """The model of `folder` with its position grid (and patch embedding) resampled to the new sizes."""
    is_classifier = any("ForImageClassification" in name for name in (config.architectures or []))
    model_class = VisionTransformerForImageClassification if is_classifier else VisionTransformerModel
    model = model_class.from_pretrained(folder)
    new_patch = config.patch_size if patch_size is None else patch_size
    model.set_input_size(config.image_hw if image_size is None else image_size, mode, patch_size=new_patch)
    return model


def _resized_processor(processor, config, max_num_patches: int | None):
    """`processor` serving the resized model (its geometry scaled, or native-aspect)."""
    height, width = config.image_hw
    if processor.max_num_patches is None and max_num_patches is None:  # the source's resize and crop, scaled
        size, crop_size = scaled_geometry(
            processor.size, processor.crop_size, processor.do_center_crop, (height, width)
        )
        return processor.with_options(size=size, crop_size=crop_size, patch_size=config.patch_size)
    return serving_processor(processor.with_options(size={"height": height, "width": width}), config, max_num_patches)


def _changes(before, config, processor, mode: str) -> tuple[str, str]:
    """What the variant changed, for its card's summary and its resolution note (only what changed)."""
    (old_h, old_w), (old_rows, old_cols), old_patch, old_budget = before
    (height, width), (rows, cols), patch = config.image_hw, config.grid_size, config.patch_size
    what, notes = [], []
    if patch != old_patch:
        what.append(
            f"patch embedding resampled from {old_patch}x{old_patch} to {patch}x{patch} pixels (FlexiViT's "
            "pseudo-inverse resize)"
        )
        notes.append(
            f" The patch size changed from {old_patch} to {patch}: the patch embedding kernel was resampled by "
            "FlexiViT's pseudo-inverse resize (a patch resized up is embedded as before; shrunk, the least-squares "
            "fit)."
        )
    if (rows, cols) != (old_rows, old_cols) or (height, width) != (old_h, old_w):
        what.append(f"position embeddings resampled ({mode}) from {old_h}x{old_w} to {height}x{width}")
        notes.insert(
            0,
            f"Interpolated from {old_h}x{old_w} ({old_rows}x{old_cols} patches of {old_patch}x{old_patch}) to "
            f"{height}x{width} ({rows}x{cols} patches of {patch}x{patch}) with {mode} resampling of the position "
            "embeddings; not fine-tuned after the interpolation.",
        )
    budget = processor.max_num_patches
    if budget != old_budget:
        was = f"{old_budget} patches" if old_budget else f"whole images at {old_h}x{old_w}"
        what.append(f"images served at their native aspect ratio, at most {budget} patches each (was: {was})")
        notes.append(
            f" Each image is resized to the largest grid of at most {budget} patches of {patch}x{patch} (was: "
            f"{was}); the weights are not fine-tuned for it."
        )
    if not what:
        what, notes = ["sizes unchanged"], ["The sizes are the base model's; not fine-tuned after."]
    return " and the ".join(what), "".join(notes).strip()


def make_evaluated_variant(
    source: str | os.PathLike,
    image_size: int | list[int],
    output_dir: str | os.PathLike,
    data_source: DataSource | None = None,
    repo_id: str | None = None,
    base_model: str | None = None,
    mode: str = "bicubic",
    overwrite: bool = False,
) -> dict[str, float]:
    """`make_resolution_variant` with its accuracy measured; returns the metrics."""
    from .data.datasets import DataSource

    make_resolution_variant(
        source,
        image_size,
        output_dir,
        mode,
        overwrite,
        base_model=base_model,
        repo_id=repo_id,
        data_source=data_source or DataSource(),
    )
    return json.loads((Path(output_dir) / "all_results.json").read_text())
