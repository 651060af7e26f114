"""What pretraining and fine-tuning share: argument dataclasses, the paper's recipes, model set-up and the run itself.

`scripts/pretrain.py` and `scripts/finetune.py` are `parse_args(task)` followed by `train(task, ...)`; both run
unchanged under `python`, `torchrun` and `accelerate launch`, because `Trainer` does the distribution.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import HfArgumentParser, Trainer, TrainingArguments

from .configuration_vit import VisionTransformerConfig
from .data import (
    apply_transforms,
    collate_fn,
    label_names,
    load_image_dataset,
    make_eval_transform,
    make_train_transform,
)
from .image_processing_vit import VisionTransformerImageProcessor
from .metrics import compute_metrics
from .modeling_vit import VisionTransformerForImageClassification
from .resolution import resize_state_dict, resized_config

logger = logging.getLogger(__name__)

TASKS = ("pretrain", "finetune")

# Section 4.1 and appendix B.1 of the paper. Every value is only a default: any Trainer flag overrides it.
RECIPES: dict[str, dict[str, Any]] = {
    # Adam (beta1 0.9, beta2 0.999), weight decay 0.1, linear warmup then linear decay, clipping at global norm 1.
    "pretrain": dict(
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.1,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=0.1,
        max_grad_norm=1.0,
    ),
    # SGD with momentum 0.9, no weight decay, cosine decay, clipping at global norm 1.
    "finetune": dict(
        optim="sgd",
        optim_args="momentum=0.9",
        weight_decay=0.0,
        learning_rate=0.01,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        max_grad_norm=1.0,
    ),
}
# Defaults the image pipeline needs, whatever the task.
COMMON_DEFAULTS: dict[str, Any] = dict(
    remove_unused_columns=False,  # the transforms read the raw `image` and `label` columns
    label_names=["labels"],
    eval_strategy="epoch",
    save_strategy="epoch",
    save_total_limit=2,
    logging_strategy="steps",
    logging_steps=10,
    report_to="none",
    # Every parameter gets a gradient in every step, so DDP need not search the graph for unused ones (Trainer would
    # otherwise ask it to, and it warns that the search found none).
    ddp_find_unused_parameters=False,
)


@dataclass
class ModelArguments:
    """Which model to train. Fine-tuning needs `model_name_or_path`; pretraining builds `preset` from scratch."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "hf-vit folder (or Hub id) to start from; required for fine-tuning."}
    )
    preset: str = field(
        default="vit-tiny-patch16-224",
        metadata={"help": "Architecture to pretrain from scratch, e.g. vit-base-patch16-224 (see PRESETS)."},
    )
    image_size: list[int] | None = field(
        default=None,
        metadata={
            "help": "Training resolution: N or H W. Fine-tuning at another size than the checkpoint's resamples "
            "its position embeddings in 2D when it is loaded.",
            "nargs": "+",
        },
    )
    patch_size: int | None = field(default=None, metadata={"help": "Patch size, overriding the preset's."})
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Config fields to override, e.g. 'hidden_size=96,num_hidden_layers=4,num_attention_heads=3'."
        },
    )
    representation_size: int | None = field(
        default=None,
        metadata={
            "help": "Size of the pre-logits (dense + tanh) layer. Default: the hidden size when pretraining (as the "
            "paper does), none when fine-tuning (the paper replaces the whole head). 0 turns it off."
        },
    )
    drop_path_rate: float | None = field(default=None, metadata={"help": "Stochastic depth rate."})
    hidden_dropout_prob: float | None = field(default=None, metadata={"help": "Dropout rate."})
    interpolation: str = field(
        default="bicubic", metadata={"help": "Resampling of position embeddings: bicubic or bilinear."}
    )
    keep_head: bool = field(
        default=False,
        metadata={"help": "Keep the checkpoint's head (same classes) instead of a new zero-initialised head."},
    )
    attn_implementation: str = field(default="sdpa", metadata={"help": "eager, sdpa, flash_attention_2, flex..."})


@dataclass
class DataArguments:
    """Where the images come from and how they are augmented."""

    dataset_name: str = field(
        default="digits",
        metadata={
            "help": "'digits' (scikit-learn's bundled handwritten digits), a local image folder, a folder saved "
            "with Dataset.save_to_disk, or a Hub data set name."
        },
    )
    image_column_name: str = field(default="image", metadata={"help": "Column holding the images."})
    label_column_name: str = field(default="label", metadata={"help": "Column holding the labels."})
    train_split: str = field(default="train", metadata={"help": "Source split used for training."})
    validation_split: str = field(default="validation", metadata={"help": "Source split used for validation."})
    test_split: str = field(default="test", metadata={"help": "Source split for the final evaluation, if any."})
    validation_fraction: float = field(
        default=0.1, metadata={"help": "Share of train held out for validation when there is no validation split."}
    )
    streaming: bool = field(default=False, metadata={"help": "Stream the data set (needs --max_steps)."})
    random_resized_crop: bool = field(default=True, metadata={"help": "Inception-style random resized crop."})
    crop_scale_min: float = field(default=0.08, metadata={"help": "Smallest image area fraction a crop covers."})
    hflip: bool | None = field(
        default=None, metadata={"help": "Random horizontal flips. Default: on, except for digits (flips change them)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only this many training images."})


def parse_args(task: str, argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, TrainingArguments]:
    """Parse command-line flags for `task`, with the paper's recipe as defaults for the Trainer flags."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    # Without an accelerator, Trainer only forms a multi-process (gloo) group under torchrun when told it runs on CPU.
    parser.set_defaults(**COMMON_DEFAULTS, **RECIPES[task], use_cpu=not torch.accelerator.is_available())
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size != launched:
        raise RuntimeError(
            f"Launched as {launched} processes but Trainer sees {training_args.world_size}: each would train alone on "
            "the whole data set. On machines without GPUs pass --use_cpu True (the default there)."
        )
    return model_args, data_args, training_args


def _image_size(value: list[int] | None) -> int | list[int] | None:
    if not value:
        return None
    if len(value) not in (1, 2):
        raise ValueError(f"--image_size takes N or H W, got {value}.")
    return value[0] if len(value) == 1 or value[0] == value[1] else list(value)


def _overrides(text: str | None) -> dict[str, Any]:
    """Parse 'a=1,b=0.5,c=gelu' into typed values."""
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


def build_pretraining_model(
    model_args: ModelArguments, id2label: dict[int, str]
) -> VisionTransformerForImageClassification:
    """A model to pretrain: `preset` from scratch (the paper's initialisation) or `model_name_or_path` to continue."""
    labels = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}
    if model_args.model_name_or_path:
        return VisionTransformerForImageClassification.from_pretrained(
            model_args.model_name_or_path, attn_implementation=model_args.attn_implementation, **labels
        )
    fields: dict[str, Any] = {**_overrides(model_args.config_overrides), **labels}
    for name in ("patch_size", "drop_path_rate", "hidden_dropout_prob"):
        if getattr(model_args, name) is not None:
            fields[name] = getattr(model_args, name)
    if (size := _image_size(model_args.image_size)) is not None:
        fields["image_size"] = size
    config = VisionTransformerConfig.from_preset(model_args.preset, **fields)
    representation = model_args.representation_size
    config.representation_size = config.hidden_size if representation is None else (representation or None)
    config.validate()
    config._attn_implementation = model_args.attn_implementation
    return VisionTransformerForImageClassification(config)


def load_for_finetuning(
    path: str,
    id2label: dict[int, str],
    image_size: int | list[int] | None = None,
    representation_size: int | None = None,
    interpolation: str = "bicubic",
    attn_implementation: str = "sdpa",
    keep_head: bool = False,
    **config_fields: Any,
) -> VisionTransformerForImageClassification:
    """Load a pretrained hf-vit model for fine-tuning, as the paper does: the head (pre-logits and classifier) is
    replaced by one zero-initialised linear layer for `id2label`, and at another `image_size` the position embeddings
    are resampled in 2D from the checkpoint's.

    `keep_head=True` keeps the checkpoint's head instead, to continue training on the same classes (e.g. a short
    fine-tune of a resolution variant); the classes must then be the checkpoint's.
    """
    source = VisionTransformerForImageClassification.from_pretrained(path)
    fields = {k: v for k, v in config_fields.items() if v is not None}
    config = resized_config(source.config, image_size) if image_size is not None else source.config
    if keep_head and source.config.id2label != id2label:
        raise ValueError(
            f"--keep_head needs the data set's classes to be the checkpoint's: {source.config.id2label} vs {id2label}."
        )
    head = (
        {"representation_size": source.config.representation_size}
        if keep_head
        else {"representation_size": representation_size or None, "zero_init_head": True}
    )
    config = VisionTransformerConfig.from_dict(
        {
            **config.to_dict(),
            **fields,
            **head,
            "id2label": id2label,
            "label2id": {v: k for k, v in id2label.items()},
            "problem_type": None,
        }
    )
    keep = ("vit.", "classifier.", "pre_logits.") if keep_head else ("vit.",)
    backbone = {k: v for k, v in source.state_dict().items() if k.startswith(keep)}
    if image_size is not None:
        backbone = resize_state_dict(backbone, source.config, image_size, interpolation)
        (old_h, old_w), (new_h, new_w) = source.config.image_hw, config.image_hw
        if (old_h, old_w) != (new_h, new_w):
            logger.info(
                "Fine-tuning at %dx%d a model trained at %dx%d: position embeddings resampled (%s) from a %dx%d to a "
                "%dx%d grid of patches.",
                new_h, new_w, old_h, old_w, interpolation, *source.config.grid_size, *config.grid_size,
            )  # fmt: skip
    if not keep_head:
        logger.info(
            "New zero-initialised classifier for %d classes (the checkpoint's head is dropped).", len(id2label)
        )
    config._attn_implementation = attn_implementation
    model = VisionTransformerForImageClassification(config)
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    new_head = [k for k in missing if not k.startswith(("classifier.", "pre_logits."))]
    if new_head or unexpected:
        raise ValueError(f"{path} does not fit the fine-tuning model: missing {new_head}, unexpected {unexpected}.")
    return model


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` folder in `output_dir` that was written to the end.

    `Trainer` writes `trainer_state.json` last, after the weights, optimizer, scheduler and RNG states, so a folder
    without it is what a run killed while saving leaves behind: it is skipped (and named in a warning).
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name)))
    for _, path in reversed(found):
        if is_complete_checkpoint(path):
            return str(path)
        logger.warning("Skipping %s: it is incomplete (the run stopped while saving it).", path)
    return None


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / "trainer_state.json").is_file() and (path / "model.safetensors").is_file()


def _resolve_resume(training_args: TrainingArguments) -> str | None:
    resume = training_args.resume_from_checkpoint
    if resume in (None, False, "False", "false", ""):
        return None
    if resume in (True, "True", "true"):
        checkpoint = last_complete_checkpoint(training_args.output_dir)
        if checkpoint is None:
            logger.warning("No complete checkpoint in %s: training from the start.", training_args.output_dir)
        return checkpoint
    if not is_complete_checkpoint(resume):
        raise ValueError(
            f"{resume} is not a complete checkpoint (no trainer_state.json or model.safetensors): it was probably "
            "cut off while saving. Pass --resume_from_checkpoint True to take the last complete one."
        )
    return str(resume)


def load_datasets(data_args: DataArguments, seed: int):
    """The raw splits named by `data_args` (columns `image` and `label`)."""
    ds = load_image_dataset(
        data_args.dataset_name,
        image_column=data_args.image_column_name,
        label_column=data_args.label_column_name,
        streaming=data_args.streaming,
        train_split=data_args.train_split,
        validation_split=data_args.validation_split,
        test_split=data_args.test_split,
        validation_fraction=data_args.validation_fraction,
        seed=seed,
    )
    if data_args.max_train_samples is not None and not data_args.streaming:
        ds["train"] = ds["train"].select(range(min(data_args.max_train_samples, len(ds["train"]))))
    return ds


def with_transforms(ds, data_args: DataArguments, processor: VisionTransformerImageProcessor):
    """`ds` with on-the-fly augmentation on train and the processor's resizing on the other splits."""
    hflip = data_args.hflip if data_args.hflip is not None else data_args.dataset_name != "digits"
    train_transform = make_train_transform(
        processor,
        random_resized_crop=data_args.random_resized_crop,
        scale=(data_args.crop_scale_min, 1.0),
        hflip=hflip,
    )
    return apply_transforms(ds, train_transform, make_eval_transform(processor))


def train(
    task: str,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: TrainingArguments,
    callbacks: list | None = None,
) -> dict[str, float]:
    """Pretrain or fine-tune, evaluate, and save the model, processor, metrics, curves and model card.

    The final metrics (`eval_*` in `all_results.json`) are measured on the test split when the data set has one,
    on the validation split otherwise; validation metrics during training are in `trainer_state.json`.
    """
    transformers.set_seed(training_args.seed)
    if data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming data sets have no length: set --max_steps to say how long to train.")
    raw = load_datasets(data_args, training_args.seed)
    id2label = dict(enumerate(label_names(raw)))

    if task == "pretrain":
        model = build_pretraining_model(model_args, id2label)
        processor = VisionTransformerImageProcessor(size=model.config.image_hw)
    else:
        if not model_args.model_name_or_path:
            raise ValueError("Fine-tuning needs --model_name_or_path: the pretrained hf-vit folder to start from.")
        model = load_for_finetuning(
            model_args.model_name_or_path,
            id2label,
            image_size=_image_size(model_args.image_size),
            representation_size=model_args.representation_size,
            interpolation=model_args.interpolation,
            attn_implementation=model_args.attn_implementation,
            keep_head=model_args.keep_head,
            drop_path_rate=model_args.drop_path_rate,
            hidden_dropout_prob=model_args.hidden_dropout_prob,
        )
        processor = _processor_for(model_args.model_name_or_path, model.config)

    ds = with_transforms(raw, data_args, processor)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=ds["train"],
        eval_dataset=ds["validation"],
        data_collator=collate_fn,
        compute_metrics=compute_metrics,
        processing_class=processor,
        callbacks=callbacks,
    )
    train_result = trainer.train(resume_from_checkpoint=_resolve_resume(training_args))
    metrics = dict(train_result.metrics)
    final_split = "test" if "test" in ds else "validation"
    # Logged as `test_*` (so the curves keep validation and test apart), reported as `eval_*` in all_results.json.
    final = trainer.evaluate(ds[final_split], metric_key_prefix=final_split)
    metrics.update(final)
    metrics.update({"eval_" + k.removeprefix(f"{final_split}_"): v for k, v in final.items()})
    metrics["eval_split"] = final_split
    metrics["train_task"] = task
    trainer.save_model()  # weights (safetensors), config, processor and code files
    trainer.log_metrics("all", {k: v for k, v in metrics.items() if not isinstance(v, str)})
    trainer.save_metrics("all", metrics, combined=False)
    trainer.save_state()
    if trainer.is_world_process_zero():
        from .hub import write_model_card
        from .plotting import plot_training_curves

        plot_training_curves(trainer.state.log_history, Path(training_args.output_dir) / "training_curves.png")
        write_model_card(
            training_args.output_dir,
            model=trainer.model,
            metrics=metrics,
            task=task,
            dataset_name=data_args.dataset_name,
            training_args=training_args,
            base_model=model_args.model_name_or_path if task == "finetune" else None,
        )
        if training_args.push_to_hub:
            from .hub import push_folder_to_hub

            push_folder_to_hub(
                training_args.output_dir,
                training_args.hub_model_id or Path(training_args.output_dir).name,
                private=training_args.hub_private_repo,
                token=training_args.hub_token,
                commit_message=f"hf-vit {task}: final model, card and metrics",
            )
    return metrics


@torch.no_grad()
def evaluate_model(
    model: VisionTransformerForImageClassification,
    processor: VisionTransformerImageProcessor,
    data_args: DataArguments | None = None,
    split: str = "test",
    batch_size: int = 256,
) -> dict[str, float]:
    """Top-1/top-5 accuracy of `model` on a split of `data_args`' data set (digits by default), no training."""
    data_args = data_args or DataArguments()
    ds = with_transforms(load_datasets(data_args, seed=0), data_args, processor)[split]
    model.eval()
    logits, labels = [], []
    for start in range(0, len(ds), batch_size):
        batch = ds[start : start + batch_size]
        logits.append(model(pixel_values=batch["pixel_values"]).logits.float())
        labels.append(batch["labels"])
    return compute_metrics((torch.cat(logits).numpy(), torch.cat(labels).numpy()))


def _processor_for(path: str, config: VisionTransformerConfig) -> VisionTransformerImageProcessor:
    """The checkpoint's processor (its normalisation) at the fine-tuning resolution."""
    try:
        processor = VisionTransformerImageProcessor.from_pretrained(path)
    except OSError:
        processor = VisionTransformerImageProcessor()
    height, width = config.image_hw
    processor.size = {"height": height, "width": width}
    return processor


def main(task: str, argv: list[str] | None = None) -> dict[str, float]:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    torch.set_float32_matmul_precision("high")
    return train(task, *parse_args(task, argv))


def make_evaluated_variant(
    source: str | os.PathLike,
    image_size: int | list[int],
    output_dir: str | os.PathLike,
    data_args: DataArguments | None = None,
    repo_id: str | None = None,
    base_model: str | None = None,
    mode: str = "bicubic",
    overwrite: bool = False,
) -> dict[str, float]:
    """Write a resolution variant of the folder `source` to `output_dir`, measure its test accuracy with no further
    training, and give it a model card that says so. Returns the measured metrics (`eval_*`)."""
    from .hub import write_model_card
    from .resolution import make_resolution_variant

    data_args = data_args or DataArguments()
    model, processor = make_resolution_variant(source, image_size, output_dir, mode, overwrite=overwrite)
    measured = evaluate_model(model, processor, data_args)
    metrics = {f"eval_{k}": v for k, v in measured.items()}
    metrics["eval_split"] = "test"
    old = VisionTransformerConfig.from_pretrained(source)
    (height, width), (old_h, old_w) = model.config.image_hw, old.image_hw
    write_model_card(
        output_dir,
        model=model,
        metrics=metrics,
        task="finetune",
        dataset_name=data_args.dataset_name,
        repo_id=repo_id,
        base_model=base_model or str(source),
        summary=(
            f"A resolution variant of `{base_model or source}`: the same weights with the position embeddings "
            f"resampled ({mode}) from {old_h}x{old_w} to {height}x{width}, not trained after."
        ),
        resolution_note=(
            f"Interpolated from {old_h}x{old_w} ({old.grid_size[0]}x{old.grid_size[1]} patches) to {height}x{width} "
            f"({model.config.grid_size[0]}x{model.config.grid_size[1]} patches) with {mode} resampling of the "
            "position embeddings; not fine-tuned after the interpolation."
        ),
        recipe=f"no training after the interpolation; see `{base_model or source}` for how its weights were trained.",
        results_note=f"Measured on the {data_args.dataset_name} test split right after the interpolation.",
    )
    (Path(output_dir) / "all_results.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
