"""Model cards: Hub metadata and an honest description rendered from the card template (`templates/model_card.md`),
for a run's folder (`write_model_card`) and for a folder the project made from another model (`write_card`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..metrics import few_images_warning, images_text
from ..model.modeling_mim import VisionTransformerForMaskedImageModeling
from ..model.modeling_mpp import VisionTransformerForMaskedPatchPrediction
from .files import CARD_TEMPLATE, remote_code_files, write_beside

HOMEPAGE = "https://github.com/hf-vit/hf-vit"
DATASET_DESCRIPTIONS = {
    "digits": "scikit-learn's bundled handwritten digits (1797 real 8x8 grayscale images of 10 classes, from the UCI "
    "optical recognition data set), split into fixed stratified train/validation/test sets of 1257/180/360 images.",
}
DIGITS_LIMITATIONS = (
    "Trained on 8x8 handwritten digits only, upsampled to the model's resolution: it recognises centred, "
    "size-normalised digits in that style and nothing else. It is a demonstration of the training pipeline, not a "
    "general-purpose image classifier."
)

# `org/name` or `name`, as the Hub spells repository ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass(frozen=True)
class CardReference:
    """What a model card may say about a model or data set the user named."""

    text: str  # for the card's body: the Hub id, the plain name, or a local path's final folder name
    hub_id: str | None  # for the card's metadata (`base_model`, `datasets`), which hold Hub ids only; None if local


# How the model card names each `classifier` (the pooling of equation 4).
POOLING_NAMES = {"token": "class-token", "gap": "global-average-pooling", "map": "multi-head-attention-pooling"}


def card_reference(reference: str | os.PathLike) -> CardReference:
    """A user's model or data set reference as a card may say it: a local path by its final name."""
    raw = os.fspath(reference)
    is_local = (
        isinstance(reference, os.PathLike)
        or os.path.isabs(raw)
        or raw.startswith(("~", "."))
        or "\\" in raw
        or not _HUB_ID.fullmatch(raw)
        or os.path.exists(raw)
    )
    if not is_local:
        return CardReference(text=raw, hub_id=raw)
    return CardReference(text=os.path.basename(os.path.abspath(os.path.expanduser(raw))) or raw, hub_id=None)


def _without_local_paths(text: str | None, references: Iterable[str | os.PathLike | None]) -> str | None:
    """`text` with every local path among `references` replaced by its final folder name."""
    if text is None:
        return None
    for reference in references:
        if reference is None:
            continue
        raw, ref = os.fspath(reference), card_reference(reference)
        # Only path-like spellings are replaced: a bare name like `.` would otherwise rewrite every full stop.
        if ref.hub_id is None and ("/" in raw or os.sep in raw):
            for spelling in sorted({raw, os.path.abspath(raw), os.path.realpath(raw)}, key=len, reverse=True):
                text = text.replace(spelling, ref.text)
    return text


# Trainer's optimizers that ignore `--optim_args`: a card naming them for these would describe an optimizer that did
# not run (e.g. the fine-tuning default "momentum=0.9" kept by a recipe that switches to AdamW).
OPTIMIZERS_IGNORING_OPTIM_ARGS = {
    "adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused", "adafactor", "lomo", "adalomo",
}  # fmt: skip


def card_value(value: Any) -> str:
    """A setting as a card spells it: an enum's value, a whole float as int, 4 significant digits."""
    value = getattr(value, "value", value)
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        text = repr(value)
        return text if len(text) <= 10 else f"{value:.4g}"
    return str(value)


def warmup_text(warmup_steps: float) -> str:
    """Trainer's `warmup_steps`, in words: below 1 it is a fraction of the training steps, from 1 a number of steps."""
    if not warmup_steps:
        return "no warmup"
    if warmup_steps < 1:
        return f"warmup over the first {100 * warmup_steps:.3g}% of the steps"
    return f"warmup over the first {int(warmup_steps)} steps"


def optimizer_text(args: Any) -> str:
    """The optimizer with the settings it ran with (Adam's betas, `--optim_args` where read)."""
    name = card_value(args.optim)
    details = []
    if "adam" in name:
        details.append(f"betas {card_value(args.adam_beta1)}, {card_value(args.adam_beta2)}")
    if args.optim_args and name not in OPTIMIZERS_IGNORING_OPTIM_ARGS:
        details.append(args.optim_args)
    return name + (f" ({'; '.join(details)})" if details else "")


def training_recipe_text(task: str, args: Any) -> str:
    if args is None:
        return "not recorded."
    schedule = f"{card_value(args.lr_scheduler_type)} schedule with {warmup_text(args.warmup_steps)}"
    norm = args.max_grad_norm  # 0 or None: no clipping
    clipping = f"gradient clipping at global norm {card_value(norm)}" if norm else "no gradient clipping"
    steps = args.max_steps is not None and args.max_steps > 0  # then Trainer ignores the epochs
    length = f"{args.max_steps} optimisation steps" if steps else f"{card_value(args.num_train_epochs)} epochs"
    return (
        f"{task}: optimizer {optimizer_text(args)}, learning rate {card_value(args.learning_rate)}, weight decay "
        f"{card_value(args.weight_decay)}, {schedule}, {clipping}, batch {args.per_device_train_batch_size} per "
        f"device, {length}, seed {args.seed}."
    )


def saved_max_num_patches(folder: str | os.PathLike) -> int | None:
    """The `max_num_patches` of the processor saved in `folder` (None without one, or without that setting)."""
    path = Path(folder) / "preprocessor_config.json"
    try:
        value = json.loads(path.read_text()).get("max_num_patches")
    except (OSError, ValueError, AttributeError):  # no processor, or not a JSON object: the card keeps the config's
        return None
    return value if isinstance(value, int) and value > 0 else None


def resolution_text(config: Any, max_num_patches: int | None = None) -> str:
    """The card's resolution: height x width, or a native-aspect model's budget of patches."""
    height, width = config.image_hw
    if not max_num_patches:
        return f"{height}x{width}"
    patch = config.patch_size
    rows, columns = height // patch, width // patch
    return (
        f"native aspect ratio, at most {max_num_patches} patches of {patch}x{patch} pixels per image (each image "
        f"resized to the largest such grid; `max_num_patches={max_num_patches}` in the processor); position "
        f"embeddings stored for a {rows}x{columns} grid ({height}x{width} pixels) and resampled to each image's grid"
    )


def _card_data(repo_id, adapter, pretraining, base, data, split, results) -> ModelCardData:
    """The card's Hub metadata (`pretraining`: the self-supervised objective's tag, or None)."""
    mpp = pretraining is not None
    eval_results = [
        EvalResult(
            task_type="image-classification",
            # The model-index needs a data set type; a local data set is named by its plain folder name.
            dataset_type=data.hub_id or data.text if data else "unknown",
            dataset_name=data.text if data else "unknown",
            dataset_split=split,
            metric_type=row["metric"],
            metric_name=row["metric"],
            metric_value=float(row["value"]),
        )
        for row in results
        if not mpp  # the model-index names an image classification task; masked patch prediction is none
    ]
    return ModelCardData(
        library_name="peft" if adapter else "transformers",
        pipeline_tag="image-feature-extraction" if mpp else "image-classification",
        license="apache-2.0",
        tags=[
            "hf-vit",
            "vision-transformer",
            *([pretraining, "self-supervised"] if mpp else ["image-classification"]),
            "safetensors",
        ],
        datasets=[data.hub_id] if data and data.hub_id else None,
        metrics=sorted({row["metric"] for row in results}) or ["accuracy"],
        base_model=base.hub_id if base else None,
        model_name=repo_id,
        eval_results=eval_results or None,
    )


def _dataset_description(data: CardReference | None) -> str:
    if data is None:
        return "as for the base model (this folder was not trained)."
    return DATASET_DESCRIPTIONS.get(data.text, f"`{data.text}`{'' if data.hub_id else ' (a local data set)'}.")


def _limitations(data: CardReference | None, results: list) -> str:
    if data and data.text == "digits":
        return DIGITS_LIMITATIONS
    if results:
        return "Evaluated only on the data named above."
    return "Not evaluated by hf-vit: see the base model's results and limitations."


def _architecture_fields(model, max_num_patches: int | None) -> dict[str, Any]:
    """The template's fields that describe the architecture: sizes, pooling, parameters, resolution."""
    config = model.config
    return {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_attention_heads,
        "mlp_size": config.intermediate_size,
        "patch_size": config.patch_size,
        "classifier": POOLING_NAMES.get(config.classifier, config.classifier),
        "representation_size": config.representation_size,
        "num_parameters": f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M",
        "resolution": resolution_text(config, max_num_patches),
    }


def render_model_card(
    model,
    metrics: dict[str, Any],
    *,
    task: str,
    dataset_name: str | None,
    training_args: Any = None,
    repo_id: str | None = None,
    base_model: str | None = None,
    resolution_note: str | None = None,
    summary: str | None = None,
    recipe: str | None = None,
    results_note: str = "Measured by the training run that produced these weights.",
    compute_dial: str | None = None,
    max_num_patches: int | None = None,
) -> ModelCard:
    """A `ModelCard` for `model` with Hub metadata and its `metrics` (`eval_accuracy`, ...): named by `repo_id`,
    else by the folder's plain name; local paths in `base_model` and `dataset_name` shown by their final name and
    left out of the metadata; no data set claimed without one; an adapter's card for a peft model; `compute_dial`:
    the PNG beside the card."""
    adapter = hasattr(model, "peft_config")
    architecture = type(model.get_base_model() if adapter else model).__name__
    # Masked patch prediction and SimMIM have no classes and no pipeline: the card says how to fine-tune or embed.
    mpp = isinstance(model, (VisionTransformerForMaskedPatchPrediction, VisionTransformerForMaskedImageModeling))
    simmim = isinstance(model, VisionTransformerForMaskedImageModeling)
    config = model.config
    output_dir = training_args.output_dir if training_args is not None else None
    repo_id = repo_id or (card_reference(Path(output_dir)).text if output_dir else "model")
    base = card_reference(base_model) if base_model else None
    data = card_reference(dataset_name) if dataset_name else None
    local_refs = [base_model, dataset_name, output_dir]
    split, count = metrics.get("eval_split", "test"), metrics.get("eval_samples")
    results = [
        {"split": split, "metric": name.removeprefix("eval_"), "value": f"{value:.4f}", "images": images_text(count)}
        for name, value in metrics.items()
        # the qualities a card reports (accuracy, mAP, F1), not the loss or the speed
        if name.startswith("eval_")
        and isinstance(value, float)
        and any(key in name for key in ("accuracy", "mean_average_precision", "f1_"))
    ]
    pretraining = "simmim" if simmim else "masked-patch-prediction" if mpp else None
    card_data = _card_data(repo_id, adapter, pretraining, base, data, split, results)
    labels = list(config.id2label.values())
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        summary=_without_local_paths(summary, local_refs)
        or f"A Vision Transformer {'pretrained' if task == 'pretrain' else 'fine-tuned'} with hf-vit.",
        architecture=architecture + (" with a LoRA adapter" if adapter else ""),
        adapter=adapter,
        masked_patch_prediction=mpp,
        simmim=simmim,
        color_bits=getattr(config, "mpp_color_bits", None),
        base_model_note=(
            "a local model when the adapter was trained: pass where it is"
            if adapter and base and not base.hub_id
            else None
        ),
        homepage=HOMEPAGE,
        code_files=", ".join(f"`{name}`" for name in remote_code_files()),
        **_architecture_fields(model, max_num_patches),
        resolution_note=_without_local_paths(resolution_note, local_refs),
        num_labels=len(labels),
        labels=", ".join(labels[:20]) + (", ..." if len(labels) > 20 else ""),
        base_model=base.text if base else None,
        dataset_description=_dataset_description(data),
        recipe=_without_local_paths(recipe, local_refs) or training_recipe_text(task, training_args),
        results=results,
        few_images=few_images_warning(count) if results else None,
        results_note=_without_local_paths(results_note, local_refs),
        compute_dial=compute_dial,
        compute_dial_data=Path(compute_dial).with_suffix(".json").name if compute_dial else None,
        limitations=_limitations(data, results),
    )


def write_model_card(output_dir: str | os.PathLike, model, metrics: dict[str, Any], **kwargs: Any) -> Path:
    """Render the card (`render_model_card`) to `output_dir/README.md`."""
    path = Path(output_dir) / "README.md"
    if not kwargs.get("repo_id"):
        kwargs["repo_id"] = card_reference(Path(output_dir)).text
    if kwargs.get("max_num_patches") is None:
        kwargs["max_num_patches"] = saved_max_num_patches(output_dir)
    return write_beside(path, str(render_model_card(model, metrics, **kwargs)))


def write_card(
    folder: str | os.PathLike,
    model,
    *,
    base_model: str,
    summary: str,
    recipe: str,
    resolution_note: str | None = None,
    repo_id: str | None = None,
    metrics: Mapping[str, object] | None = None,
    dataset_name: str | None = None,
    output_name: str | None = None,
) -> Path:
    """Write the card of a folder the project made from `base_model` (`output_name`: its final name)."""
    measured = dict(metrics or {})
    return write_model_card(
        folder,
        model,
        measured,
        task="finetune",
        dataset_name=dataset_name,
        repo_id=repo_id or output_name or Path(folder).name,
        base_model=base_model,
        summary=summary,
        recipe=recipe,
        resolution_note=resolution_note,
        results_note=(
            f"Measured on the {dataset_name} {measured.get('eval_split', 'test')} split by hf-vit when it wrote this "
            "folder."
            if dataset_name
            else "No metrics were measured for this folder; see the base model for its results."
        ),
    )
