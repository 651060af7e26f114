"""Model cards: Hub metadata and an honest description rendered from the card template."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

TEMPLATE = Path(__file__).parent / "templates" / "model_card.md"

DATASET_DESCRIPTIONS = {
    "digits": "scikit-learn's bundled handwritten digits (1797 real 8x8 grayscale images of 10 classes, from the UCI "
    "optical recognition data set), split into fixed stratified train/validation/test sets of 1257/180/360 images.",
}
DIGITS_LIMITATIONS = (
    "Trained on 8x8 handwritten digits only, upsampled to the model's resolution: it recognises centred, "
    "size-normalised digits in that style and nothing else. It is a demonstration of the training pipeline, not a "
    "general-purpose image classifier."
)


def _recipe_text(task: str, args: Any) -> str:
    if args is None:
        return "not recorded."
    schedule = f"{args.lr_scheduler_type} schedule with warmup {args.warmup_steps}"
    return (
        f"{task}: optimizer {args.optim}{f' ({args.optim_args})' if args.optim_args else ''}, learning rate "
        f"{args.learning_rate}, weight decay {args.weight_decay}, {schedule}, gradient clipping at global norm "
        f"{args.max_grad_norm}, batch {args.per_device_train_batch_size} per device, {args.num_train_epochs} epochs "
        f"(max_steps {args.max_steps}), seed {args.seed}."
    )


def render_model_card(
    model,
    metrics: dict[str, Any],
    *,
    task: str,
    dataset_name: str,
    training_args: Any = None,
    repo_id: str | None = None,
    base_model: str | None = None,
    resolution_note: str | None = None,
    summary: str | None = None,
    recipe: str | None = None,
    results_note: str = "Measured by the training run that produced these weights.",
    license: str = "apache-2.0",
) -> ModelCard:
    """A `ModelCard` for `model` with Hub metadata and the `metrics` measured for it (keys like `eval_accuracy`)."""
    config = model.config
    height, width = config.image_hw
    repo_id = repo_id or f"hf-vit/{Path(getattr(training_args, 'output_dir', None) or 'model').name}"
    split = metrics.get("eval_split", "test")
    results = [
        {"split": split, "metric": name.removeprefix("eval_"), "value": f"{value:.4f}"}
        for name, value in metrics.items()
        if name.startswith("eval_") and "accuracy" in name and isinstance(value, float)
    ]
    eval_results = [
        EvalResult(
            task_type="image-classification",
            dataset_type=dataset_name,
            dataset_name=dataset_name,
            dataset_split=split,
            metric_type=row["metric"],
            metric_name=row["metric"],
            metric_value=float(row["value"]),
        )
        for row in results
    ]
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="image-classification",
        license=license,
        tags=["hf-vit", "vision-transformer", "image-classification", "safetensors"],
        datasets=[dataset_name],
        metrics=["accuracy"],
        base_model=base_model,
        model_name=repo_id,
        eval_results=eval_results or None,
    )
    labels = list(config.id2label.values())
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        summary=summary or f"A Vision Transformer {'pretrained' if task == 'pretrain' else 'fine-tuned'} with hf-vit.",
        architecture=type(model).__name__,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        mlp_size=config.intermediate_size,
        patch_size=config.patch_size,
        classifier="class-token" if config.classifier == "token" else "global-average-pooling",
        representation_size=config.representation_size,
        num_parameters=f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M",
        resolution=f"{height}x{width}",
        resolution_note=resolution_note,
        num_labels=len(labels),
        labels=", ".join(labels[:20]) + (", ..." if len(labels) > 20 else ""),
        dataset_description=DATASET_DESCRIPTIONS.get(dataset_name, f"`{dataset_name}`."),
        recipe=recipe or _recipe_text(task, training_args),
        results=results,
        results_note=results_note,
        limitations=DIGITS_LIMITATIONS if dataset_name == "digits" else "Evaluated only on the data named above.",
    )


def write_model_card(output_dir: str | os.PathLike, model, metrics: dict[str, Any], **kwargs: Any) -> Path:
    """Render the card (see `render_model_card`) to `output_dir/README.md`."""
    path = Path(output_dir) / "README.md"
    render_model_card(model, metrics, **kwargs).save(path)
    return path


# What a published hf-vit folder holds: safetensors weights, configs, code files for trust_remote_code, the card and
# its figures. Anything else (optimizer states, pickles, checkpoints) stays local.
UPLOAD_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.py", "README.md", "*.png"]
UPLOAD_EXCLUDE = ["checkpoint-*/**", "runs/**", "training_args.bin", "*.bin", "*.pt", "*.pth", "*.pkl"]


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str | None,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload hf-vit model",
    revision: str | None = None,
) -> str:
    """Push an hf-vit folder to the Hub with huggingface_hub's own machinery; returns the commit URL.

    Only safetensors weights, JSON configs, the code files and the card (with its PNG figures) are uploaded.
    """
    from huggingface_hub import HfApi

    if not repo_id:
        raise ValueError("Pushing needs a repository id: pass --hub_model_id <user or org>/<name>.")
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: save the model there before pushing it.")
    weights = list(folder.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{folder} has no safetensors weights; hf-vit only publishes safetensors.")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        allow_patterns=UPLOAD_PATTERNS,
        ignore_patterns=UPLOAD_EXCLUDE,
        commit_message=commit_message,
        revision=revision,
        repo_type="model",
    )
    return str(getattr(commit, "commit_url", commit))
