"""A run's arguments, the edge of the run: the model, data and Trainer flags as `HfArgumentParser` dataclasses, with
the paper's recipes (`recipes.TASK_RECIPES`) as the Trainer flags' defaults for each task; `--recipe` puts a named
recipe's values in their place, and the flags are checked here, by name. Each dataclass unpacks itself into the
settings the stages take: no stage below reads the argument objects. Parsing imports no data set library: `--help`
and bad flags answer at once."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import HfArgumentParser, TrainingArguments

from hf_vit_cli import flag_hint  # an unknown flag's nearest (--dataset_name for the data-like), as the commands say
from hf_vit_cli.early import LEAST  # each flag's least value, checked there before torch loads

from ..data.augment.rand_augment import parse_rand_augment
from ..data.augment.random_erasing import check_random_erasing
from ..flags import exit_on_error, parse_sizes, warn_idle
from ..model.resolution import MAX_PATCH_POSITIONS
from ..tasks.model_setup import ModelSettings
from .ema import check_ema_decay
from .lora import LoraSettings
from .recipes import (
    NAMED_RECIPES,
    TASK_RECIPES,
    RecipeSettings,
    given_flags,
    learning_rate_for_images,
    mixing_for,
)

if TYPE_CHECKING:  # the data settings' modules load the data set libraries: not before the flags are read
    from ..data.datasets import DataSource
    from ..data.transforms import Augmentation, BatchSizes

TASKS = ("pretrain", "finetune")

logger = logging.getLogger(__name__)

# Defaults the image pipeline needs, whatever the task.
COMMON_DEFAULTS: dict[str, Any] = dict(
    remove_unused_columns=False,  # the transforms read the raw `image` and `label` columns
    label_names=["labels"],
    eval_strategy="epoch",
    save_strategy="epoch",
    save_total_limit=1,  # the last checkpoint only (a tiny data set's epochs would fill a disk); a flag asks for more
    logging_strategy="steps",
    logging_steps=10,
    report_to="none",
    do_train=True,  # --do_train False --do_eval (or --do_predict) evaluates the checkpoint as it is
    # Every parameter gets a gradient in every step, so DDP need not search the graph for unused ones (Trainer would
    # otherwise ask it to, and it warns that the search found none).
    ddp_find_unused_parameters=False,
)


def default_num_workers() -> int:
    """Data loader workers per training process: the process's share of the cores, less one for the training itself
    (at most 8). Decoding and augmenting in workers, one torch thread each, is much faster than in the training
    process (measured: docs/benchmarks.md, "Measurements behind choices in the code")."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return min(8, max(1, cores // processes - 1))


def flag(default: Any, text: str, **metadata: Any) -> Any:
    """A flag's dataclass field: its default and its help `text` (and `metadata` such as `nargs`)."""
    return field(default=default, metadata={"help": text, **metadata})


@dataclass
class ModelArguments:
    """Which model to train. Fine-tuning needs `model_name_or_path`; pretraining builds `preset` from scratch."""

    model_name_or_path: str | None = flag(None, "hf-vit folder (or Hub id) to start from; required for fine-tuning.")
    preset: str = flag(
        "vit-tiny-patch16-224",
        "Architecture to pretrain from scratch, e.g. vit-base-patch16-224 (--list_presets lists them); "
        "pretraining with --model_name_or_path continues from that checkpoint instead.",
    )
    image_size: list[int] | None = flag(
        None,
        "Training resolution: N or H W. Fine-tuning at another size than the checkpoint's resamples "
        "its position embeddings in 2D when it is loaded.",
        nargs="+",
    )
    patch_size: int | None = flag(
        None,
        "Patch size, overriding the preset's. From a checkpoint (--model_name_or_path) its patch "
        "embedding is resampled to it (FlexiViT's pseudo-inverse resize) and the position grid follows.",
    )
    num_channels: int | None = flag(
        None,
        "Image channels of a model trained from scratch (default 3, RGB). With 1 (grey) or 4 (e.g. RGBA, "
        "RGB + infrared), images are not converted to RGB: the model sees their own channels. A checkpoint's "
        "models keep the channels they were trained with.",
    )
    config_overrides: str | None = flag(
        None, "Config fields to override, e.g. 'hidden_size=96,num_hidden_layers=4,num_attention_heads=3'."
    )
    representation_size: int | None = flag(
        None,
        "Size of the pre-logits (dense + tanh) layer. Default: the hidden size when pretraining (as the "
        "paper does), none when fine-tuning (the paper replaces the whole head). 0 turns it off.",
    )
    drop_path_rate: float | None = flag(None, "Stochastic depth rate.")
    hidden_dropout_prob: float | None = flag(None, "Dropout rate.")
    interpolation: str | None = flag(
        None, "Resampling of a checkpoint's position embeddings to another size: bicubic or bilinear (None: bicubic)."
    )
    keep_head: bool = flag(False, "Keep the checkpoint's head (same classes) instead of a new zero-initialised head.")
    attn_implementation: str = flag("sdpa", "eager, sdpa, flash_attention_2, flex...")
    problem_type: str | None = flag(
        None,
        "single_label_classification or multi_label_classification (sigmoid outputs, a list of classes "
        "per image in the label column). Default: multi-label when the label column holds lists.",
    )
    objective: str = flag(
        "classification",
        "Pretraining objective: classification (supervised, the paper's main recipe), mpp (masked patch "
        "prediction, section 4.6) or simmim (SimMIM's masked image modeling): for mpp and simmim the data set's "
        "labels are not used.",
    )
    lora_rank: int = flag(
        0, "Fine-tune LoRA adapters of this rank (peft) instead of every weight; the new head is trained in full."
    )
    lora_alpha: float | None = flag(None, "LoRA scaling alpha (default: the rank).")
    lora_dropout: float = flag(0.0, "Dropout on the LoRA adapters' input.")
    lora_target_modules: str = flag(
        "qkv",
        "Comma-separated layers to adapt: qkv (the fused query/key/value), or its parts query, key, value "
        "(e.g. query,value as in PEFT's ViT guide), proj, fc1, fc2.",
    )

    def settings(self) -> ModelSettings:
        return settings_of(ModelSettings, self)

    def lora(self) -> LoraSettings:
        """The adapter stage's settings (`--lora_rank` 0: none)."""
        lora = {name: getattr(self, f"lora_{name}") for name in ("rank", "alpha", "dropout", "target_modules")}
        return LoraSettings(**lora, base=self.model_name_or_path, interpolation=self.interpolation or "bicubic")


@dataclass
class DataArguments:
    """Where the images come from and how they are augmented."""

    dataset_name: str = flag(
        "digits",
        "'digits' (scikit-learn's bundled handwritten digits), a local image folder (one subfolder per "
        "class, root/<class>/*.jpg, any sizes, 10%% of each class held out for validation; or root/train/<class>/ "
        "and root/test/<class>/, ... for splits of its own), a folder saved with Dataset.save_to_disk, or a Hub "
        "data set name.",
    )
    image_column_name: str = flag("image", "Column holding the images.")
    label_column_name: str = flag("label", "Column holding the labels.")
    train_split: str = flag("train", "Source split used for training.")
    validation_split: str = flag("validation", "Source split used for validation.")
    test_split: str = flag("test", "Source split for the final evaluation, if any.")
    validation_fraction: float = flag(0.1, "Share of train held out for validation when there is no validation split.")
    streaming: bool = flag(False, "Stream the data set (needs --max_steps).")
    shuffle_buffer_size: int = flag(
        1000,
        "With --streaming: examples in the buffer the training stream is shuffled through (reseeded each "
        "epoch); 0 reads it in the source's order.",
    )
    random_resized_crop: bool = flag(True, "Inception-style random resized crop.")
    crop_scale_min: float = flag(0.08, "Smallest image area fraction a crop covers.")
    hflip: bool | None = flag(None, "Random horizontal flips. Default: on, except for digits (flips change them).")
    rand_augment: str | None = flag(
        None,
        "RandAugment in timm's notation, e.g. rand-m9-mstd0.5-inc1: n (default 2) operations per image of "
        "timm's 15, each applied with probability 1/2 at magnitude m of 10 (mstd: its noise; mmax: its largest "
        "value; inc1: the variants that strengthen with m), after the crop and flip, seeded per image and epoch.",
    )
    reprob: float = flag(
        0.0,
        "Random erasing (timm's --reprob): the probability that a training image, once normalised, has "
        "rectangles erased, each of 0.02 to 1/3 of its area (divided by their count) at an aspect ratio in "
        "0.3-3.3, seeded per image and epoch. Default 0: off. Classification only: refused with --objective "
        "mpp, whose targets are the pixels it would erase.",
    )
    remode: str = flag(
        "pixel",
        "With --reprob: what fills an erased rectangle: pixel (per-pixel normal noise), rand (one normal "
        "colour per rectangle) or const (zeros, the mean colour).",
    )
    recount: int = flag(1, "With --reprob: at most this many rectangles per erased image (the count uniform in 1..N).")
    max_train_samples: int | None = flag(None, "Use only this many training images.")
    max_num_patches: int | None = flag(
        None,
        "Native aspect ratio (NaFlex): each image (each crop, in training) is resized to the largest grid "
        "of at most this many patches that keeps its aspect ratio, and batches are its patches padded to this "
        "number; the saved processor does the same at inference. Classification objectives only.",
    )
    packed_sequence_length: int | None = flag(
        None,
        "With --max_num_patches: NaViT's sequence packing, a fixed number of tokens per batch. Native-"
        "aspect images are packed whole into rows of this many patch slots (at least --max_num_patches), "
        "attention and pooling per image, instead of one image per row padded to --max_num_patches; "
        "--per_device_train_batch_size then counts rows (as TRL's packing counts packed sequences), and each "
        "batch holds as many images as fill them, a number that varies. Each epoch packs every training image "
        "once, in an order drawn from --seed and the epoch, into the same number of batches (planned from the "
        "images' sizes, read before training; a training crop gets at most its image's own grid's patches); "
        "every batch is that many rows, the epoch's last padded with empty ones where it has fewer (left out "
        "with --dataloader_drop_last). A --streaming data set's sizes are not "
        "known ahead: its batches keep --per_device_train_batch_size images, packed into as many rows as they "
        "need. The loss and metrics stay per image; the saved processor packs at inference. Not with "
        "--seq_lens, --patch_sizes, Mixup/CutMix, --objective mpp, or --streaming on several processes.",
    )
    token_drop_rate: float = flag(
        0.0,
        "With --packed_sequence_length: NaViT's token dropping. Each training image keeps a random "
        "(1 - this) of its patches (at least one), drawn per image and epoch, and only those take a row's slots "
        "(so more images fill a batch); evaluation and inference keep every patch. 0 is off.",
    )
    seq_lens: str | None = flag(
        None,
        "Native aspect ratio with a sequence length drawn per training batch (timm's NaFlex loader), e.g. "
        "64,144,256: each step's images are resized to the largest grid of at most the drawn number of patches "
        "at their own aspect ratio, and the batch holds --max_tokens_per_batch // length images per process. "
        "The draw is fixed by --seed and the step (every process trains the step at the same length; a resumed "
        "run draws what the uninterrupted one did); every epoch has the same steps, in another order. "
        "Evaluation and the saved processor use --max_num_patches (default: the longest length). Not with "
        "--streaming (accelerate deals a stream out in batches of one size).",
    )
    max_tokens_per_batch: int | None = flag(
        None,
        "With --seq_lens: the patches one process's batch may hold; its batch size at length L is this // "
        "L. Default: --per_device_train_batch_size x the longest of --seq_lens (that length trains at "
        "--per_device_train_batch_size images, shorter ones at more).",
    )
    patch_sizes: str | None = flag(
        None,
        "FlexiViT: a patch size drawn per optimisation step from these, e.g. 8,16,32 (fixed by --seed and "
        "the step: alike on every process and on resumption). The step embeds its patches with the stored patch "
        "embedding resampled by FlexiViT's pseudo-inverse resize (its gradient trains the stored kernel) and "
        "resamples the position grid to the image's grid at that size. The saved model keeps its own patch size "
        "and kernel: from_pretrained(folder, patch_size=P) gives it at P. Each size must divide --image_size; "
        "whole images only (not with --max_num_patches or --seq_lens).",
    )
    patch_size_probs: str | None = flag(
        None, "With --patch_sizes: the weight of each size, e.g. 0.2,0.3,0.5 (normalised). Default: equal."
    )

    def source(self) -> DataSource:
        from ..data.datasets import DataSource

        return settings_of(DataSource, self)

    def augmentation(self) -> Augmentation:
        """How the training images are augmented (`--hflip` resolved: on, except for digits)."""
        from ..data.transforms import Augmentation

        hflip = self.hflip if self.hflip is not None else self.dataset_name != "digits"
        return settings_of(Augmentation, self, hflip=hflip)

    def sizes(self) -> BatchSizes:
        from ..data.transforms import BatchSizes

        return settings_of(BatchSizes, self)


@dataclass
class VisionTransformerTrainingArguments(TrainingArguments):
    """Every `TrainingArguments` flag, plus what a run into an existing folder needs said."""

    overwrite_output_dir: bool = flag(
        False,
        "Train into an --output_dir that is not empty: files of the same names (the final model, "
        "results, card) are replaced and the earlier run's checkpoint-* folders removed; other files are kept.",
    )
    check_eval_images: bool = flag(
        True,
        "Decode every validation and test image once and read every training image's header before "
        "training, so that unreadable files stop the run in seconds, all named at once, instead of when their "
        "batch comes.",
    )
    recipe: str | None = flag(
        None,
        "A paper's recipe as the defaults of its flags: augreg (Steiner et al. 2021: Adam, Mixup 0.2, "
        "RandAugment 2x15, dropout and stochastic depth 0.1), deit (Touvron et al. 2021: AdamW, Mixup 0.8 / "
        "CutMix 1.0, RandAugment m9-mstd0.5-inc1, label smoothing 0.1, stochastic depth 0.1, EMA), finetune (He "
        "et al. 2021, MAE fine-tuning: AdamW, layer-wise lr decay 0.65, Mixup/CutMix, RandAugment, label "
        "smoothing, drop path 0.1). Flags given on the command line override it; deit's and finetune's learning "
        "rate scales with the global batch (from 512 and 256) unless --learning_rate is given. The card says what "
        "ran.",
    )
    layer_decay: float | None = flag(
        None,
        "Layer-wise learning-rate decay D (timm's): block i of L learns at lr * D^(L-i), the embeddings "
        "at lr * D^(L+1), the final norm and head at lr; biases, norms, position embeddings and the class token "
        "get no weight decay. E.g. 0.65 for ViT-B, 0.75 for ViT-L. 1.0: those weight-decay groups only.",
    )
    ema_decay: float | None = flag(
        None,
        "Keep an exponential moving average of the trained weights with this decay (e.g. 0.9998), updated "
        "after each optimiser step (the first copies the weights): evaluation uses it and the saved model is it; "
        "checkpoints keep the raw weights and the average. With LoRA, the adapters and head are averaged.",
    )
    ema_warmup: bool = flag(
        False,
        "Warm the EMA's decay up as timm's ModelEmaV3 does: min(--ema_decay, 1 - (1 + t)^(-2/3)) after "
        "step t + 1, so short runs average over a window that grows with them.",
    )
    mixup_alpha: float = flag(
        0.0, "Mixup: mix each training batch with itself reversed, lam ~ Beta(alpha, alpha); 0 is off."
    )
    cutmix_alpha: float = flag(
        0.0,
        "CutMix: paste a box of the reversed batch, lam ~ Beta(alpha, alpha) then corrected to the box's "
        "area; 0 is off. With --mixup_alpha, each batch does one or the other (--mixup_switch_prob).",
    )
    cutmix_minmax: list[float] | None = flag(
        None,
        "CutMix box sides drawn uniformly between these fractions of the image's (min max), instead of "
        "from lam; turns CutMix on.",
        nargs=2,
    )
    mixup_prob: float = flag(1.0, "Probability that a batch is mixed (Mixup or CutMix) at all.")
    mixup_switch_prob: float = flag(
        0.5, "With both --mixup_alpha and --cutmix_alpha: probability of CutMix for a batch."
    )
    # Not a flag: the flags the command line gave, which `parse_args` records for the run's log and card.
    recipe_flags_given: list[str] = field(default_factory=list, init=False)

    def recipe_settings(self) -> RecipeSettings:
        minmax = tuple(self.cutmix_minmax) if self.cutmix_minmax else None
        given = frozenset(self.recipe_flags_given)
        smoothing = self.label_smoothing_factor
        return settings_of(
            RecipeSettings, self, name=self.recipe, given=given, cutmix_minmax=minmax, label_smoothing=smoothing
        )


def settings_of(settings: type, parsed: Any, **values: Any) -> Any:
    """The settings dataclass `settings` with each field the parsed flags' dataclass `parsed` has of the same name,
    and `values` for the others."""
    names = {item.name for item in dataclasses.fields(settings)} - set(values)
    return settings(**{name: getattr(parsed, name) for name in names if hasattr(parsed, name)}, **values)


def build_parser(task: str) -> HfArgumentParser:
    """The parser of `task`'s flags, with the paper's recipe for it as the Trainer flags' defaults."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
    parser = HfArgumentParser((ModelArguments, DataArguments, VisionTransformerTrainingArguments))
    # Without an accelerator, Trainer only forms a multi-process (gloo) group under torchrun when told it runs on CPU.
    workers = default_num_workers()
    parser.set_defaults(
        **COMMON_DEFAULTS,
        **TASK_RECIPES[task].flags,
        use_cpu=not torch.accelerator.is_available(),
        dataloader_num_workers=workers,
        dataloader_persistent_workers=workers > 0,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    refuse_unknown_flags(parser)
    describe_negations(parser)
    return parser


def parse_args(
    task: str, argv: list[str] | None = None
) -> tuple[ModelArguments, DataArguments, VisionTransformerTrainingArguments]:
    """Parse command-line flags for `task`, with the paper's recipe as defaults for the Trainer flags."""
    parser = build_parser(task)
    argv = sys.argv[1:] if argv is None else list(argv)
    given = given_flags(parser, argv)
    # A named recipe's values become the flags' defaults before the one parse: what the command line gives still
    # wins. An unknown name is refused after it, as any other bad value.
    if given.get("recipe") in NAMED_RECIPES:
        parser.set_defaults(**NAMED_RECIPES[given["recipe"]].flags)
    model_args, data_args, training_args, unknown = parser.parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True
    )
    if unknown:
        raise ValueError(unknown_flags_message(parser, unknown))
    for name, least in LEAST.items():
        value = next(getattr(part, name) for part in (model_args, data_args, training_args) if hasattr(part, name))
        values = value if isinstance(value, list) else [] if value is None else [value]
        low = [number for number in values if number < least]
        if low:
            raise ValueError(f"--{name} {low[0]:g}: must be at least {least}.")
    passed = set(given)
    training_args.recipe_flags_given = sorted(passed)
    batch = training_args.per_device_train_batch_size * training_args.world_size
    batch *= training_args.gradient_accumulation_steps
    recipe = training_args.recipe_settings()
    training_args.learning_rate = learning_rate_for_images(recipe, batch, training_args.learning_rate, log=False)
    check_recipe_flags(model_args, data_args, training_args, passed)
    check_model_flags(task, model_args, passed)
    check_packing_flags(model_args.objective, data_args, training_args)
    check_flexible_flags(data_args, training_args)
    if not training_args.do_train:
        check_evaluation_flags(passed)
    else:
        check_idle_flags(model_args, data_args, passed)
        if training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
            raise ValueError(
                f"--num_train_epochs {training_args.num_train_epochs:g} trains nothing: give a positive number of "
                "epochs (or --max_steps N)."
            )
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


# What `--do_train False` reads: the checkpoint, the data set and its splits, which splits to measure, where the
# results go, the batch and the seed (the validation split drawn from training data); the rest shapes training only.
EVALUATION_FLAGS = frozenset(
    {
        "model_name_or_path", "dataset_name", "image_column_name", "label_column_name", "streaming",
        "shuffle_buffer_size", "train_split", "validation_split", "test_split", "validation_fraction",
        "do_train", "do_eval", "do_predict", "eval_strategy", "output_dir", "per_device_eval_batch_size", "seed",
        "report_to", "disable_tqdm", "dataloader_num_workers", "use_cpu",
    }
)  # fmt: skip


def check_evaluation_flags(passed: set[str]) -> None:
    """`--do_train False` with the other flags given: the model's flags are refused by name, those that shape
    training only get one warning line, so that a training command re-run with --do_train False evaluates."""
    ignored = sorted(passed - EVALUATION_FLAGS)
    model_flags = {item.name for item in dataclasses.fields(ModelArguments)}
    changing = [name for name in ignored if name in model_flags]
    if changing:
        named = ", ".join(f"--{name}" for name in changing)
        raise ValueError(
            f"--do_train False measures the checkpoint as it is, so {named} would change the model measured "
            "(nothing is trained, resized or adapted). Drop them, or fine-tune with them (without --do_train "
            "False); hf-vit-evaluate measures a saved model too (--max_num_patches, --patch_size)."
        )
    if ignored:
        warn_idle(ignored, "--do_train False: {flags} shape training only and have no effect here.")


def check_idle_flags(model_args: ModelArguments, data_args: DataArguments, passed: set[str]) -> None:
    """Warn, one line each, about the flags given that this run's other flags leave without effect (said, not refused:
    a command line reused with one flag changed still runs)."""
    for idle, names, message in (
        (
            not model_args.lora_rank,
            {"lora_alpha", "lora_dropout", "lora_target_modules"},
            "{flags} shape LoRA adapters, but --lora_rank is 0 (none): every weight is trained and the full model "
            "saved; these have no effect (pass --lora_rank, e.g. 8, to train adapters).",
        ),
        (
            not data_args.streaming,
            {"shuffle_buffer_size"},
            "{flags} shuffles a streamed data set (--streaming); this run loads it and shuffles it whole, so it has "
            "no effect.",
        ),
        (
            not data_args.random_resized_crop,
            {"crop_scale_min"},
            "{flags} sets the smallest area of a random resized crop, which --no_random_resized_crop turns off: it "
            "has no effect.",
        ),
    ):
        if idle and (given := sorted(names & passed)):
            warn_idle(given, message)


def check_model_flags(task: str, model_args: ModelArguments, passed: set[str]) -> None:
    """Refuse, by name, model flags a run cannot honour; warn (one line) about those without effect on it. (A
    checkpoint's size, where `--interpolation` matters, is known when it loads: `load_checkpoint` says it there.)"""
    checkpoint = model_args.model_name_or_path
    if task == "finetune" and "preset" in passed:
        raise ValueError(
            f"--preset {model_args.preset} names an architecture to pretrain from scratch (hf-vit-pretrain); "
            "fine-tuning keeps --model_name_or_path's architecture. Drop --preset (--image_size and --patch_size "
            "resample a checkpoint)."
        )
    if task == "finetune" and model_args.keep_head and "representation_size" in passed:
        raise ValueError(
            "--keep_head keeps the checkpoint's head, but --representation_size asks for a new one: drop --keep_head "
            "to train a new head, or drop --representation_size."
        )
    if checkpoint and "preset" in passed:
        warn_idle(["preset"], f"{{flags}}: this run continues --model_name_or_path {checkpoint} (its architecture), "
                  "so it has no effect.")  # fmt: skip
    if not checkpoint and "interpolation" in passed:
        warn_idle(["interpolation"], "{flags} resamples a checkpoint's position embeddings, but this run builds "
                  "--preset from scratch: it has no effect.")  # fmt: skip


def check_packing_flags(objective: str, data_args: DataArguments, training_args: TrainingArguments) -> None:
    """Refuse, by name, `--packed_sequence_length` where packed batches cannot be trained."""
    length = data_args.packed_sequence_length
    rate = data_args.token_drop_rate
    if not 0 <= rate < 1:
        raise ValueError(f"--token_drop_rate is the share of each image's patches dropped, in [0, 1); got {rate}.")
    if length is None:
        if rate:
            raise ValueError(
                "--token_drop_rate drops patches of packed images: give --packed_sequence_length (with "
                "--max_num_patches), or drop it."
            )
        return
    if data_args.seq_lens is not None:
        raise ValueError(
            "--packed_sequence_length with --seq_lens: packing keeps one --max_num_patches per run, a length drawn "
            "per step would change it. Drop one of them."
        )
    if data_args.patch_sizes is not None:
        raise ValueError(
            "--packed_sequence_length with --patch_sizes: packed batches are native-aspect patches of one size. Drop "
            "one of them."
        )
    if data_args.max_num_patches is None:
        raise ValueError(
            "--packed_sequence_length packs native-aspect images: give --max_num_patches (the most patches of one "
            "image, at most --packed_sequence_length)."
        )
    if length < data_args.max_num_patches:
        raise ValueError(
            f"--packed_sequence_length {length} is below --max_num_patches {data_args.max_num_patches}: a row must "
            "hold the largest image. Raise it."
        )
    if objective in ("mpp", "simmim"):
        raise ValueError(
            f"--packed_sequence_length with --objective {objective}: it pretrains on whole images of "
            "--image_size. Drop --packed_sequence_length, or use --objective classification."
        )
    if data_args.streaming and training_args.world_size > 1:
        raise ValueError(
            "--packed_sequence_length with --streaming on several processes: accelerate deals a stream's batches out "
            "from the first process, cut along their first dimension, and a packed batch's rows are not its images. "
            "Load the data set (drop --streaming), or train on one process."
        )
    mixing = {
        "--mixup_alpha": training_args.mixup_alpha > 0,
        "--cutmix_alpha": training_args.cutmix_alpha > 0,
        "--cutmix_minmax": bool(training_args.cutmix_minmax),  # turns CutMix on by itself
    }
    if any(mixing.values()):
        flag = ", ".join(name for name, on in mixing.items() if on)
        recipe = training_args.recipe
        given = f" (set by --recipe {recipe}; --mixup_alpha 0 --cutmix_alpha 0 keep the rest of it)" if recipe else ""
        raise ValueError(
            f"--packed_sequence_length with {flag}{given}: Mixup and CutMix mix whole images of one size, not packed "
            "rows of images. Drop them, or drop --packed_sequence_length."
        )


def check_flexible_flags(data_args: DataArguments, training_args: TrainingArguments) -> None:
    """Refuse, by name, sizes drawn per batch that cannot be trained or would be ignored; `--seq_lens` without
    `--max_num_patches` evaluates (and saves its processor) at its longest length."""
    seq_lens = parse_sizes(data_args.seq_lens, "--seq_lens")
    for flag, counts in (("--max_num_patches", [data_args.max_num_patches or 0]), ("--seq_lens", seq_lens or [0])):
        if max(counts) > MAX_PATCH_POSITIONS:  # a step at 100,000 patches took minutes before failing for memory
            raise ValueError(
                f"{flag} {max(counts)} is over the {MAX_PATCH_POSITIONS} patch positions hf-vit takes (a 256x256 "
                "grid); native-aspect images are usually trained at 256 to 1024 patches."
            )
    if data_args.max_tokens_per_batch is not None and seq_lens is None:
        raise ValueError("--max_tokens_per_batch sizes the batches of --seq_lens: give --seq_lens, or drop it.")
    if seq_lens is not None:
        if data_args.streaming:
            raise ValueError(
                "--seq_lens with --streaming: accelerate deals a stream out in batches of one size, so a batch size "
                "per drawn length cannot reach it. Drop --streaming (load the data set), or use --max_num_patches."
            )
        if data_args.max_num_patches is None:
            data_args.max_num_patches = max(seq_lens)
        if data_args.max_tokens_per_batch is not None and data_args.max_tokens_per_batch < max(seq_lens):
            raise ValueError(
                f"--max_tokens_per_batch {data_args.max_tokens_per_batch} is below the longest of --seq_lens "
                f"({max(seq_lens)}): one image of that length would not fit a batch. Raise it."
            )
    patch_sizes = parse_sizes(data_args.patch_sizes, "--patch_sizes")
    if data_args.patch_size_probs is not None:
        if patch_sizes is None:
            raise ValueError("--patch_size_probs weighs the sizes of --patch_sizes: give --patch_sizes, or drop it.")
        try:
            weights = [float(part) for part in data_args.patch_size_probs.split(",")]
        except ValueError:
            weights = []
        if len(weights) != len(patch_sizes) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"--patch_size_probs {data_args.patch_size_probs!r} must give one non-negative weight per size of "
                f"--patch_sizes {data_args.patch_sizes!r}, not all zero."
            )
    if patch_sizes is not None and data_args.max_num_patches is not None:
        flag = "--seq_lens" if seq_lens is not None else "--max_num_patches"
        raise ValueError(
            f"--patch_sizes with {flag}: native-aspect batches are cut into patches of one size by the image "
            "processor before the step draws its patch size. Train --patch_sizes on whole images, or drop it."
        )


def check_recipe_flags(model_args, data_args, training_args, passed: set[str]) -> None:
    """Refuse, by name, recipe flags out of range or that would be ignored."""
    if training_args.layer_decay is not None and not 0 < training_args.layer_decay <= 1:
        raise ValueError(f"--layer_decay must be in (0, 1] (e.g. 0.65 for ViT-B), got {training_args.layer_decay}.")
    check_ema_decay(training_args.ema_decay, training_args.ema_warmup)
    if training_args.ema_decay is not None:
        if training_args.load_best_model_at_end:
            raise ValueError(
                "--ema_decay with --load_best_model_at_end: the best checkpoint's weights are the raw ones, not their "
                "average. Drop one of them."
            )
        if training_args.fsdp:
            raise ValueError("--ema_decay averages whole parameters: it is not supported with --fsdp (use DDP).")
    mixing = mixing_for(training_args.recipe_settings(), enabled_only=False)
    if not mixing.enabled:
        idle = sorted({"mixup_prob", "mixup_switch_prob"} & passed)
        if idle and mixing.prob > 0:
            raise ValueError(
                f"--{idle[0]} says how batches are mixed, but neither --mixup_alpha nor --cutmix_alpha is set: pass "
                "one of them (e.g. --mixup_alpha 0.8) or drop it."
            )
    elif mixing.mixup_alpha == 0 or not mixing.uses_cutmix:
        if "mixup_switch_prob" in passed:
            raise ValueError(
                "--mixup_switch_prob chooses between Mixup and CutMix: it needs both --mixup_alpha and --cutmix_alpha."
            )
    if data_args.rand_augment is not None:
        parse_rand_augment(data_args.rand_augment)
    check_random_erasing(data_args.reprob, data_args.remode, data_args.recount)
    idle = sorted({"remode", "recount"} & passed)
    if idle and data_args.reprob == 0:
        raise ValueError(
            f"--{idle[0]} says how images are erased, but --reprob is 0 (off): pass --reprob (e.g. 0.25) or drop it."
        )


def refuse_unknown_flags(parser: HfArgumentParser) -> None:
    """Make `parser` say its errors as one `ValueError` (one `error:` line from the scripts), and take no
    abbreviation of a flag as the flag (`--data` is a guess to answer, not `--data_seed`)."""
    parser.allow_abbrev = False

    def error(message: str):
        raise ValueError(f"{message} (--help lists hf-vit's flags, --help_trainer every flag).")

    parser.error = error


def describe_negations(parser: HfArgumentParser) -> None:
    """HfArgumentParser gives each flag that defaults to True a `--no_` twin with the flag's own help and
    "(default: False)", which reads as if the flag were off: say what the twin does instead."""
    for action in parser._actions:
        negations = [option for option in action.option_strings if option.startswith(("--no_", "--no-"))]
        if negations and action.const is False:
            action.help = f"Turn --{action.dest} off (it is on by default)."
            action.default = argparse.SUPPRESS  # the flag's own action sets the default; no "(default: False)"


def unknown_flags_message(parser: HfArgumentParser, unknown: list[str]) -> str:
    """What the unknown command-line words are, each flag with the nearest known flag (or `--dataset_name` for the
    data-like names users guess)."""
    known = sorted(
        {option[2:] for action in parser._actions for option in action.option_strings if option[:2] == "--"}
    )
    flags = [word for word in unknown if word.startswith("-")]
    hints = [flag_hint(flag, known) for flag in flags]
    if not flags:
        return f"Unexpected argument(s) {' '.join(unknown)}: every value follows its flag (--flag value)."
    return f"Unknown flag(s): {'; '.join(hints)}. --help lists hf-vit's flags, --help_trainer every flag."


def parse_args_or_exit(task: str, argv: list[str] | None = None):
    """`parse_args`, a bad flag ending in one `error:` line and exit status 2 (HF_VIT_TRACEBACK=1: the traceback).
    Imports nothing of the run beyond the flags', so that `--help` and argument errors come before the heavy part."""
    with exit_on_error((ValueError,)):
        return parse_args(task, argv)


def flag_values(*arguments: Any) -> dict[str, Any]:
    """Every flag's value in the parsed dataclasses `arguments`, by name: what a named recipe's summary reports."""
    return {name: getattr(parsed, name) for parsed in arguments for name in parsed.__dataclass_fields__}
