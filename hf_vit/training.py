"""What pretraining and fine-tuning share: argument dataclasses, the paper's recipes, model set-up and the run itself.

`scripts/pretrain.py` and `scripts/finetune.py` are `parse_args(task)` followed by `train(task, ...)`; both run
unchanged under `python`, `torchrun` and `accelerate launch`, because `Trainer` does the distribution.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

from .configuration_vit import VisionTransformerConfig
from .data import (
    apply_transforms,
    collate_fn,
    decode_rgb,
    is_multi_label,
    label_names,
    load_image_dataset,
    make_eval_transform,
    make_train_transform,
    to_multi_hot,
)
from .hub import PlannedHubPushes
from .image_processing_vit import VisionTransformerImageProcessor
from .metrics import compute_metrics
from .modeling_vit import VisionTransformerForImageClassification
from .run_folders import claim_output_dir, release, remove_earlier_checkpoints

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


def default_num_workers() -> int:
    """Data loader workers per training process: the process's share of the cores, less one for the training itself
    (at most 8). Decoding and augmenting in a worker, one torch thread each, was 6x faster than in the training
    process at its 2 torch threads (2-core Xeon, 640x427 JPEGs, batch 32: 308 against 48 images/s)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return min(8, max(1, cores // processes - 1))


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
    problem_type: str | None = field(
        default=None,
        metadata={
            "help": "single_label_classification or multi_label_classification (sigmoid outputs, a list of classes "
            "per image in the label column). Default: multi-label when the label column holds lists."
        },
    )
    objective: str = field(
        default="classification",
        metadata={
            "help": "Pretraining objective: classification (supervised, the paper's main recipe) or mpp (masked patch "
            "prediction, section 4.6: the data set's labels are not used)."
        },
    )
    lora_rank: int = field(
        default=0,
        metadata={
            "help": "Fine-tune LoRA adapters of this rank (peft) instead of every weight; the new head is trained in "
            "full."
        },
    )
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA scaling alpha (default: the rank)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA adapters' input."})
    lora_target_modules: str = field(
        default="qkv",
        metadata={
            "help": "Comma-separated layers to adapt: qkv (the fused query/key/value), or its parts query, key, value "
            "(e.g. query,value as in PEFT's ViT guide), proj, fc1, fc2."
        },
    )


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


@dataclass
class VisionTransformerTrainingArguments(TrainingArguments):
    """Every `TrainingArguments` flag, plus what a run into an existing folder needs said."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train into an --output_dir that is not empty: files of the same names (the final model, "
            "results, card) are replaced and the earlier run's checkpoint-* folders removed; other files are kept."
        },
    )
    check_eval_images: bool = field(
        default=True,
        metadata={
            "help": "Decode every validation and test image once before training, so that a corrupt one stops the "
            "run in seconds instead of at the first evaluation."
        },
    )


def parse_args(
    task: str, argv: list[str] | None = None
) -> tuple[ModelArguments, DataArguments, VisionTransformerTrainingArguments]:
    """Parse command-line flags for `task`, with the paper's recipe as defaults for the Trainer flags."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
    parser = HfArgumentParser((ModelArguments, DataArguments, VisionTransformerTrainingArguments))
    # Without an accelerator, Trainer only forms a multi-process (gloo) group under torchrun when told it runs on CPU.
    workers = default_num_workers()
    parser.set_defaults(
        **COMMON_DEFAULTS,
        **RECIPES[task],
        use_cpu=not torch.accelerator.is_available(),
        dataloader_num_workers=workers,
        dataloader_persistent_workers=workers > 0,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if training_args.dataloader_num_workers == 0:
        training_args.dataloader_persistent_workers = False  # the default, meaningful with workers only
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size != launched:
        raise RuntimeError(
            f"Launched as {launched} processes but Trainer sees {training_args.world_size}: each would train alone on "
            "the whole data set. On machines without GPUs pass --use_cpu True (the default there)."
        )
    if training_args.fsdp and training_args.use_cpu:
        # accelerate's AcceleratorState turns an FSDP plugin into DistributedType.FSDP only for GPU-like process
        # groups (MULTI_GPU, MULTI_NPU, MULTI_XPU, ...), not MULTI_CPU: Trainer would silently train with DDP.
        raise ValueError(
            "--fsdp was given, but this run is on CPU processes (gloo), where accelerate does not enable FSDP: "
            "Trainer would train with DistributedDataParallel, every process holding the whole model. torch's own "
            "FSDP2 (fully_shard) does shard hf-vit on CPU (tests/test_distributed.py checks it), but not through "
            "Trainer. Run FSDP on GPUs (configs/accelerate/fsdp.yaml), or drop --fsdp to train with DDP."
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
    config.validate_architecture()
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
    fields = {k: v for k, v in config_fields.items() if v is not None}
    model = VisionTransformerForImageClassification.from_pretrained(
        path, attn_implementation=attn_implementation, **fields
    )
    if keep_head and model.config.id2label != id2label:
        raise ValueError(
            f"--keep_head needs the data set's classes to be the checkpoint's: {model.config.id2label} vs {id2label}."
        )
    (old_h, old_w), old_grid = model.config.image_hw, model.config.grid_size
    if image_size is not None:
        model.set_input_size(image_size, interpolation)
        if model.config.grid_size != old_grid:
            logger.info(
                "Fine-tuning at %dx%d a model trained at %dx%d: position embeddings resampled (%s) from a %dx%d to a "
                "%dx%d grid of patches.",
                *model.config.image_hw, old_h, old_w, interpolation, *old_grid, *model.config.grid_size,
            )  # fmt: skip
    if not keep_head:
        model.reset_classifier(id2label, representation_size)
        logger.info("New zero-initialised classifier for %d classes (the old head is dropped).", len(id2label))
    return model.train()


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What keeps the `checkpoint-N` folder `path` from being resumed exactly; empty when nothing does.

    `Trainer` writes `trainer_state.json` last, so a folder without a readable one, or with truncated weights or
    optimizer state, is what a run killed (or out of disk) while saving leaves behind.
    """
    path = Path(path)
    problems = []
    state = path / "trainer_state.json"
    try:
        json.loads(state.read_text())
    except FileNotFoundError:
        problems.append(f"{state} is missing")
    except (OSError, ValueError) as error:
        problems.append(f"{state} is cut off or unreadable ({error})")
    weights = path / "model.safetensors"
    try:
        with safe_open(weights, "pt"):
            pass
    except FileNotFoundError:
        problems.append(f"{weights} is missing")
    except (OSError, SafetensorError) as error:
        problems.append(f"{weights} is truncated or corrupted ({error})")
    for name in ("optimizer.pt", "scheduler.pt"):
        if (path / name).exists():
            try:
                zipfile.ZipFile(path / name).close()  # torch.save writes a zip archive; a cut one has no directory
            except (OSError, zipfile.BadZipFile) as error:
                problems.append(f"{path / name} is truncated or corrupted ({error})")
    return problems


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` folder in `output_dir` that was written to the end; incomplete ones are skipped
    (and named in a warning)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name)))
    for _, path in reversed(found):
        problems = checkpoint_problems(path)
        if not problems:
            return str(path)
        logger.warning("Skipping %s: it is incomplete (%s).", path, "; ".join(problems))
    return None


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    return not checkpoint_problems(path)


def _resolve_resume(training_args: TrainingArguments) -> str | None:
    resume = training_args.resume_from_checkpoint
    if resume in (None, False, "False", "false", ""):
        return None
    if resume in (True, "True", "true"):
        checkpoint = last_complete_checkpoint(training_args.output_dir)
        if checkpoint is None:
            logger.warning("No complete checkpoint in %s: training from the start.", training_args.output_dir)
            return None
    else:
        checkpoint = str(resume)
        if not Path(checkpoint).is_dir():
            raise FileNotFoundError(f"--resume_from_checkpoint {checkpoint}: no such checkpoint folder.")
        problems = checkpoint_problems(checkpoint)
        if problems:
            raise ValueError(
                f"Cannot resume from {checkpoint}: " + "; ".join(problems) + ". It was probably cut off while saving: "
                "pass --resume_from_checkpoint True to take the last complete checkpoint."
            )
    if not any((Path(checkpoint) / name).exists() for name in ("optimizer.pt", "optimizer_0")):
        raise ValueError(
            f"{checkpoint} holds the weights only (it was saved with --save_only_model): resuming from it would "
            "restart the optimizer state and the learning-rate schedule, which is not the run it came from. To "
            f"train on from its weights, start a new run with --model_name_or_path {checkpoint}."
        )
    return checkpoint


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


def default_hflip(data_args: DataArguments) -> bool:
    """`--hflip`, or by default on, except for digits (a flipped digit is another shape)."""
    return data_args.hflip if data_args.hflip is not None else data_args.dataset_name != "digits"


def with_transforms(ds, data_args: DataArguments, processor: VisionTransformerImageProcessor):
    """`ds` with on-the-fly augmentation on train and the processor's resizing on the other splits."""
    hflip = default_hflip(data_args)
    train_transform = make_train_transform(
        processor,
        random_resized_crop=data_args.random_resized_crop,
        scale=(data_args.crop_scale_min, 1.0),
        hflip=hflip,
    )
    return apply_transforms(ds, train_transform, make_eval_transform(processor))


class SeededAugmentation(torch.utils.data.Dataset):
    """A training split whose random augmentation of example `i` in epoch `e` is drawn from a generator seeded by
    `(seed, e, i)`, not from the global random stream at the moment the example is fetched.

    This is what makes resuming exact: the data loader fetches batches ahead (accelerate one batch, workers
    several), so with the global stream an interrupted and an uninterrupted run augment the batches after the
    checkpoint with different numbers. The epoch lives in shared memory so that persistent workers see it change.
    """

    def __init__(self, data, seed: int) -> None:
        self.data = data
        self.seed = seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        key = hashlib.blake2b(f"{self.seed}:{int(self.epoch)}:{index}".encode(), digest_size=8).digest()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(key, "little"))
            return self.data[index]


class _EpochToDataset(TrainerCallback):
    """Tells a `SeededAugmentation` which epoch starts (accelerate forwards it only to samplers)."""

    def __init__(self, dataset: SeededAugmentation) -> None:
        self.dataset = dataset

    def on_epoch_begin(self, args: TrainingArguments, state, control, **kwargs: Any) -> None:
        # At an epoch's start `state.epoch` is the number of epochs done, fractional when resuming mid-epoch.
        self.dataset.set_epoch(math.floor(state.epoch + 1e-6))


class VisionTransformerTrainer(PlannedHubPushes, Trainer):
    """`Trainer` with the guarantees the scripts promise.

    - Every push sends exactly the files the project's upload plan lists, and the token never reaches disk
      (`hf_vit.hub.PlannedHubPushes`).

    - Evaluation does not consume the training's random numbers (its data loader draws a seed), so a checkpoint saved
      right before an evaluation resumes to the same weights (with `SeededAugmentation` for the training split).
    - A checkpoint that cannot be written (a full disk) stops the run with the folder and the free space named.
    """

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        python_state, numpy_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                random.setstate(python_state)
                np.random.set_state(numpy_state)

    def _save_checkpoint(self, model, trial) -> None:
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as error:
            raise _save_error(self.args.output_dir, f"checkpoint {self.state.global_step}", error) from error

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        try:
            super().save_model(output_dir, _internal_call)
        except (OSError, RuntimeError) as error:
            raise _save_error(output_dir or self.args.output_dir, "model", error) from error


def _save_error(folder: str | os.PathLike, what: str, error: Exception) -> OSError:
    try:
        free = f"{shutil.disk_usage(folder).free / 2**30:.1f} GiB free there"
    except OSError:
        free = "its free space could not be read"
    return OSError(
        f"Writing the {what} in {folder} failed ({error}); {free}. Is the disk full? Free space (or choose another "
        "--output_dir) and resume with --resume_from_checkpoint True: incomplete checkpoints are skipped."
    )


class RunSetupCallback(TrainerCallback):
    """Logs the run's set-up once it is known, as transformers' example scripts do: how a user checks a launch."""

    def __init__(self, num_examples: int | None) -> None:
        self.num_examples = num_examples

    def on_train_begin(self, args: TrainingArguments, state, control, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        per_device = args.per_device_train_batch_size
        accumulation = args.gradient_accumulation_steps
        logger.info(
            "Run set-up: %s training examples, %s epochs, batch %d per device x %d process(es) x %d accumulation "
            "step(s) = global batch %d, %d optimisation steps.",
            "unknown (streamed)" if self.num_examples is None else self.num_examples,
            f"{state.num_train_epochs:g}",
            per_device,
            args.world_size,
            accumulation,
            per_device * args.world_size * accumulation,
            state.max_steps,
        )


def check_labels(raw, id2label: dict[int, str]) -> None:
    """Refuse a data set a classifier cannot learn from, and name classes that have no training images."""
    if len(id2label) < 2:
        raise ValueError(
            f"The data set has {len(id2label)} class(es) ({list(id2label.values())}): classification needs at least "
            "two (with one, the model would fit a constant). Check --dataset_name and --label_column_name."
        )
    train = raw["train"]
    if isinstance(train, datasets.IterableDataset):
        return
    labels = train["label"]
    if labels and isinstance(labels[0], list):  # multi-hot vectors (multi-label classification)
        sums = np.asarray(labels).sum(axis=0)
        counts = Counter({index: int(total) for index, total in enumerate(sums)})
    else:
        counts = Counter(labels)
    empty = [name for index, name in id2label.items() if counts[index] == 0]
    if empty:
        logger.warning(
            "Class(es) %s have no training images (they appear only in other splits, or nowhere): the model cannot "
            "learn them.",
            empty,
        )


def _problem_type(requested: str | None, lists: bool, dataset_name: str) -> str:
    """The classification problem: what the user asked for, checked against the label column (lists of classes make
    a multi-label data set), or what the labels say."""
    choices = ("single_label_classification", "multi_label_classification")
    if requested is not None and requested not in choices:
        raise ValueError(f"--problem_type must be one of {choices}, got {requested!r}.")
    found = "multi_label_classification" if lists else "single_label_classification"
    if requested is not None and requested != found:
        holds = "a list of classes" if lists else "one class"
        raise ValueError(
            f"--problem_type {requested}, but the label column of {dataset_name!r} holds {holds} per image. For "
            "multi-label classification the label column must hold a list of classes per image."
        )
    return found


def check_eval_images(raw) -> None:
    """Decode every image of the evaluation splits once, so a corrupt file stops the run before training."""
    for split in ("validation", "test"):
        data = raw.get(split)
        if data is None or isinstance(data, datasets.IterableDataset):
            continue
        undecoded = data.cast_column("image", datasets.Image(decode=False))
        for start in range(0, len(undecoded), 256):
            for offset, image in enumerate(undecoded[start : start + 256]["image"]):
                decode_rgb(image, start + offset)


def train(
    task: str,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: TrainingArguments,
    callbacks: list | None = None,
) -> dict[str, float]:
    """Pretrain or fine-tune, save the model, evaluate it, and save the metrics, curves and model card.

    The final metrics (`eval_*` in `all_results.json`) are measured on the test split when the data set has one,
    on the validation split otherwise; validation metrics during training are in `trainer_state.json`. The model is
    saved before that final evaluation, so an error there loses no training.
    """
    transformers.set_seed(training_args.seed)
    if data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming data sets have no length: set --max_steps to say how long to train.")
    resume = _resolve_resume(training_args)
    lock = claim_output_dir(
        training_args.output_dir,
        resuming=resume is not None,
        overwrite=training_args.overwrite_output_dir,
        main_process=training_args.process_index == 0,
    )
    try:
        return _train(task, model_args, data_args, training_args, callbacks, resume)
    finally:
        release(lock)


def _train(task, model_args, data_args, training_args, callbacks, resume) -> dict[str, float]:
    if model_args.objective not in ("classification", "mpp"):
        raise ValueError(f"--objective must be classification or mpp, got {model_args.objective!r}.")
    mpp = model_args.objective == "mpp"
    if mpp and task != "pretrain":
        raise ValueError("--objective mpp is a pretraining objective: use it with pretrain.py.")
    raw = load_datasets(data_args, training_args.seed)
    id2label = dict(enumerate(label_names(raw))) if not mpp else {}
    problem_type = None
    if not mpp:
        problem_type = _problem_type(model_args.problem_type, is_multi_label(raw), data_args.dataset_name)
        if problem_type == "multi_label_classification":
            if data_args.streaming:
                raise ValueError("Multi-label data sets are supported without --streaming only.")
            raw = to_multi_hot(raw, len(id2label))
        check_labels(raw, id2label)
    if getattr(training_args, "check_eval_images", True):
        check_eval_images(raw)

    collator, metrics_function, preprocess_logits = collate_fn, compute_metrics, None
    if mpp:
        from .pretraining import (
            build_mpp_model,
            mpp_collate_fn,
            mpp_compute_metrics,
            mpp_preprocess_logits,
            with_mpp_transforms,
        )

        model = build_mpp_model(model_args)
        processor = VisionTransformerImageProcessor(size=model.config.image_hw)
        collator, metrics_function, preprocess_logits = mpp_collate_fn, mpp_compute_metrics, mpp_preprocess_logits
    elif task == "pretrain":
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
    if model_args.lora_rank:
        if task != "finetune":
            raise ValueError("--lora_rank adapts a pretrained model: use finetune.py with --model_name_or_path.")
        from .lora import apply_lora

        model.config.save_pretrained(training_args.output_dir)  # the fine-tuning model the adapter belongs to
        if os.path.isdir(model_args.model_name_or_path):  # the adapter names its base: a folder by its full path
            model.name_or_path = os.path.abspath(model_args.model_name_or_path)
        model = apply_lora(
            model,
            model_args.lora_rank,
            model_args.lora_alpha,
            model_args.lora_dropout,
            model_args.lora_target_modules.split(","),
        )
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info(
            "LoRA rank %d on %s: %d of %d parameters trained.",
            model_args.lora_rank, model_args.lora_target_modules, trained, sum(p.numel() for p in model.parameters()),
        )  # fmt: skip

    if problem_type is not None:
        model.config.problem_type = problem_type
    ds = (
        with_mpp_transforms(raw, data_args, processor, model.config)
        if mpp
        else with_transforms(raw, data_args, processor)
    )
    callbacks = [*(callbacks or [])]
    num_examples = None
    if not isinstance(ds["train"], datasets.IterableDataset):
        ds["train"] = SeededAugmentation(ds["train"], training_args.seed)
        callbacks.append(_EpochToDataset(ds["train"]))
        num_examples = len(ds["train"])
    trainer = VisionTransformerTrainer(
        model=model,
        args=training_args,
        train_dataset=ds["train"],
        eval_dataset=ds["validation"],
        data_collator=collator,
        compute_metrics=metrics_function,
        preprocess_logits_for_metrics=preprocess_logits,
        processing_class=processor,
        callbacks=[RunSetupCallback(num_examples), *callbacks],
    )
    if getattr(training_args, "overwrite_output_dir", False) and resume is None and trainer.is_world_process_zero():
        remove_earlier_checkpoints(training_args.output_dir, keep=model_args.model_name_or_path)
    train_result = trainer.train(resume_from_checkpoint=resume)
    # Weights (safetensors), config, processor and code files first, so nothing trained is lost; the push waits for
    # the card and the final metrics.
    trainer.save_model(_internal_call=True)
    trainer.save_state()
    metrics = dict(train_result.metrics)
    final_split = "test" if "test" in ds else "validation"
    # Logged as `test_*` (so the curves keep validation and test apart), reported as `eval_*` in all_results.json.
    final = trainer.evaluate(ds[final_split], metric_key_prefix=final_split)
    metrics.update(final)
    metrics.update({"eval_" + k.removeprefix(f"{final_split}_"): v for k, v in final.items()})
    metrics["eval_split"] = final_split
    metrics["train_task"] = task
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
            repo_id=trainer.hub_model_id or training_args.hub_model_id,
            base_model=model_args.model_name_or_path if task == "finetune" else None,
            summary=_lora_summary(model_args) if model_args.lora_rank else None,
        )
        if training_args.push_to_hub:
            trainer.push_output_dir(f"hf-vit {task}: final model, card and metrics")
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
    raw = load_datasets(data_args, seed=0)
    classes = label_names(raw)
    if len(classes) > model.config.num_labels:
        raise ValueError(
            f"The data set {data_args.dataset_name!r} has {len(classes)} classes but the model predicts "
            f"{model.config.num_labels}: evaluate it on the data set it was trained for, or fine-tune it first."
        )
    ds = with_transforms(raw, data_args, processor)[split]
    model.eval()
    logits, labels = [], []
    for start in range(0, len(ds), batch_size):
        batch = ds[start : start + batch_size]
        logits.append(model(pixel_values=batch["pixel_values"]).logits.float())
        labels.append(batch["labels"])
    return compute_metrics((torch.cat(logits).numpy(), torch.cat(labels).numpy()))


def _lora_summary(model_args: ModelArguments) -> str:
    return (
        f"A LoRA adapter (peft; rank {model_args.lora_rank} on {model_args.lora_target_modules}, new head trained in "
        f"full) for the base model named below. Load it with `hf_vit.lora.load_lora_model(<this folder>)`, or "
        "`PeftModel.from_pretrained` on `hf_vit.training.load_for_finetuning(<base>, id2label)`."
    )


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
    """The scripts' entry point: bad input ends in one `error:` line and exit status 2 (set HF_VIT_TRACEBACK=1 for
    the whole traceback)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    torch.set_float32_matmul_precision("high")
    try:
        return train(task, *parse_args(task, argv))
    except (ValueError, OSError) as error:
        if os.environ.get("HF_VIT_TRACEBACK"):
            raise
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from error
