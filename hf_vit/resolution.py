"""Resolution changes: resample the learned position embeddings to a new patch grid (the paper's section 3.2).

The class token's position is kept as it is; the patch positions are treated as a 2D image of D channels and
resampled (bicubic by default, bilinear available) to the new grid, which may be non-square.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .configuration_vit import VisionTransformerConfig, _pair
from .modeling_vit import VisionTransformerPreTrainedModel, resample_patch_position_embeddings

POSITION_KEY = "embeddings.position_embedding"
MODES = ("bicubic", "bilinear")


def new_grid(config: VisionTransformerConfig, image_size: int | Sequence[int]) -> tuple[int, int]:
    """The patch grid of `config`'s model at `image_size`, with a clear error when the size cannot be tiled."""
    height, width = _pair(list(image_size) if not isinstance(image_size, int) else image_size, "image_size")
    patch = config.patch_size
    if height < patch or width < patch:
        raise ValueError(f"image_size {height}x{width} is smaller than one {patch}x{patch} patch.")
    if height % patch or width % patch:
        raise ValueError(
            f"image_size {height}x{width} is not divisible by the patch size {patch}; "
            f"the nearest sizes are {height // patch * patch}x{width // patch * patch} "
            f"and {-(-height // patch) * patch}x{-(-width // patch) * patch}."
        )
    return (height // patch, width // patch)


def resample_position_embeddings(
    position_embedding: torch.Tensor,
    old_grid: tuple[int, int],
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
) -> torch.Tensor:
    """Resample `(1, prefix + old_h * old_w, D)` position embeddings to `grid`, keeping the prefix (class) tokens."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    expected = num_prefix_tokens + old_grid[0] * old_grid[1]
    if position_embedding.ndim != 3 or position_embedding.shape[1] != expected:
        raise ValueError(
            f"Position embeddings of shape {tuple(position_embedding.shape)} do not match a {old_grid[0]}x"
            f"{old_grid[1]} grid with {num_prefix_tokens} prefix token(s) (expected (1, {expected}, D)); the "
            "checkpoint's config does not describe its weights."
        )
    prefix, patches = position_embedding[:, :num_prefix_tokens], position_embedding[:, num_prefix_tokens:]
    return torch.cat([prefix, resample_patch_position_embeddings(patches, old_grid, grid, mode)], dim=1)


def resize_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    config: VisionTransformerConfig,
    image_size: int | Sequence[int],
    mode: str = "bicubic",
) -> dict[str, torch.Tensor]:
    """Return `state_dict` (of a model built from `config`) with its position embeddings resampled for `image_size`."""
    grid = new_grid(config, image_size)
    out = dict(state_dict)
    keys = [k for k in state_dict if k == POSITION_KEY or k.endswith("." + POSITION_KEY)]
    if len(keys) != 1:
        raise ValueError(f"Expected one position embedding ({POSITION_KEY}) in the state dict, found {keys}.")
    key = keys[0]
    out[key] = resample_position_embeddings(state_dict[key], config.grid_size, grid, config.num_prefix_tokens, mode)
    return out


def resized_config(config: VisionTransformerConfig, image_size: int | Sequence[int]) -> VisionTransformerConfig:
    """A copy of `config` at `image_size` (validated)."""
    new_grid(config, image_size)
    fields = config.to_dict()
    fields["image_size"] = image_size if isinstance(image_size, int) else list(image_size)
    if fields["image_size"] != config.image_size and isinstance(fields["image_size"], list):
        height, width = fields["image_size"]
        fields["image_size"] = height if height == width else [height, width]
    return type(config).from_dict(fields)


def resize_model(
    model: VisionTransformerPreTrainedModel, image_size: int | Sequence[int], mode: str = "bicubic"
) -> VisionTransformerPreTrainedModel:
    """A new model of the same class at `image_size`, whose position embeddings are `model`'s resampled in 2D.

    The result runs at the new size without `interpolate_pos_encoding`; its config says the new size.
    """
    config = resized_config(model.config, image_size)
    state_dict = resize_state_dict(model.state_dict(), model.config, image_size, mode)
    resized = type(model)(config)
    resized.load_state_dict(state_dict, strict=True)
    return resized.to(next(model.parameters()).device).train(model.training)


def _check_checkpoint_positions(folder: Path, config: VisionTransformerConfig) -> None:
    """Fail clearly when a saved folder's position embeddings do not fit its own config."""
    from safetensors import safe_open

    weights = folder / "model.safetensors"
    if not weights.is_file():
        return  # sharded or missing weights: from_pretrained reports those itself
    with safe_open(weights, "pt") as f:
        key = next((k for k in f.keys() if k == POSITION_KEY or k.endswith("." + POSITION_KEY)), None)
        if key is None:
            raise ValueError(f"{weights} has no position embeddings ({POSITION_KEY}); is it an hf-vit checkpoint?")
        shape = tuple(f.get_slice(key).get_shape())
    expected = config.num_prefix_tokens + config.num_patches
    if len(shape) != 3 or shape[1] != expected or shape[2] != config.hidden_size:
        rows, cols = config.grid_size
        raise ValueError(
            f"The position embeddings in {weights} have shape {shape}, but its config describes a {rows}x{cols} grid "
            f"with {config.num_prefix_tokens} class token(s) and width {config.hidden_size}, i.e. "
            f"(1, {expected}, {config.hidden_size}). Fix image_size/patch_size in config.json to match the weights."
        )


def make_resolution_variant(
    source: str | os.PathLike,
    image_size: int | Sequence[int],
    output_dir: str | os.PathLike | None = None,
    mode: str = "bicubic",
    overwrite: bool = False,
    *,
    base_model: str | None = None,
    repo_id: str | None = None,
    data_args=None,
):
    """Turn the hf-vit folder `source` into a variant at `image_size`: position embeddings resampled in 2D, and the
    config and processor saying the new size, so it runs without `interpolate_pos_encoding`.

    Returns `(model, processor)`; with `output_dir`, also writes the variant there with a model card (only if
    everything succeeded; see `hf_vit.convert.common.write_converted_folder` for what `overwrite` may replace). The
    card names `base_model` (a Hub id; default: the source folder's name, never a local path) and `repo_id`. With
    `data_args` (`hf_vit.training.DataArguments`), the variant's test accuracy is measured with no further training
    and goes into the card and `all_results.json`.
    """
    import json

    from .configuration_vit import VisionTransformerConfig as Config
    from .convert.common import check_grid_size, check_output_dir, write_card, write_converted_folder
    from .image_processing_vit import VisionTransformerImageProcessor
    from .modeling_vit import VisionTransformerForImageClassification, VisionTransformerModel

    folder = Path(source)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(source)!r} is not an hf-vit model folder (no config.json there). Pass the folder that a training "
            "run or `save_pretrained` wrote; to start from a Hub model, download it first (`hf download <id> "
            "--local-dir <folder>`)."
        )
    target = check_output_dir(output_dir, overwrite, [source]) if output_dir is not None else None
    config = Config.from_pretrained(folder)
    grid = new_grid(config, image_size)  # validate before loading anything big
    check_grid_size(resized_config(config, image_size))
    _check_checkpoint_positions(folder, config)
    is_classifier = any("ForImageClassification" in name for name in (config.architectures or []))
    model_class = VisionTransformerForImageClassification if is_classifier else VisionTransformerModel
    model = resize_model(model_class.from_pretrained(folder), image_size, mode).eval()
    try:
        processor = VisionTransformerImageProcessor.from_pretrained(folder)
    except OSError:
        processor = VisionTransformerImageProcessor()
    height, width = grid[0] * config.patch_size, grid[1] * config.patch_size
    processor.size = {"height": height, "width": width}
    if target is None:
        return model, processor
    metrics = {}
    if data_args is not None:
        from .training import evaluate_model

        metrics = {f"eval_{name}": value for name, value in evaluate_model(model, processor, data_args).items()}
        metrics["eval_split"] = "test"
    base_model = base_model or folder.expanduser().resolve().name
    (old_h, old_w), (rows, cols) = config.image_hw, grid

    def save(path: Path) -> None:
        model.save_pretrained(path)
        processor.save_pretrained(path)
        write_card(
            path,
            model,
            base_model=base_model,
            repo_id=repo_id,
            output_name=target.name,
            metrics=metrics,
            dataset_name=data_args.dataset_name if data_args is not None else None,
            summary=(
                f"A resolution variant of `{base_model}`: the same weights with the position embeddings resampled "
                f"({mode}) from {old_h}x{old_w} to {height}x{width}, not trained after."
            ),
            resolution_note=(
                f"Interpolated from {old_h}x{old_w} ({config.grid_size[0]}x{config.grid_size[1]} patches) to "
                f"{height}x{width} ({rows}x{cols} patches) with {mode} resampling of the position embeddings; not "
                "fine-tuned after the interpolation."
            ),
            recipe=f"no training after the interpolation; see `{base_model}` for how its weights were trained.",
        )
        if metrics:
            (path / "all_results.json").write_text(json.dumps(metrics, indent=2) + "\n")

    write_converted_folder(save, target, overwrite=overwrite, inputs=[source])
    return model, processor
