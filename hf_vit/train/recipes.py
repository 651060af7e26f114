"""The training recipes that make ViTs learn from mid-sized data: layer-wise learning-rate decay (as parameter groups,
numbered as timm's `param_groups_layer_decay` numbers a ViT's: `layer_of`) and the named recipes (`--recipe`), each a
table of flags from its paper. The parameters' names are matched inside any wrapper (peft's `base_model.model.`,
DDP's `module.`), so the same groups serve the plain model, a LoRA-wrapped model and the masked patch prediction
model; frozen parameters are left out.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from ..data.augment.mixing import Mixing
from ..outputs.cards import card_value, training_recipe_text

if TYPE_CHECKING:  # the settings' modules load the data set libraries, which parsing the flags does without
    from ..data.transforms import Augmentation, BatchSizes
    from ..tasks.model_setup import ModelSettings

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"(?:^|\.)vit\.layers\.(\d+)\.|(?:^|\.)layers\.(\d+)\.")
_EMBEDDINGS = re.compile(r"(?:^|\.)embeddings\.")
# Parameters of more than one dimension that still get no weight decay (timm's `no_weight_decay` of a ViT).
NO_WEIGHT_DECAY_NAMES = frozenset(
    {"position_embedding", "cls_token", "mask_token", "register_tokens", "distillation_token"}
)


def layer_of(name: str, num_blocks: int) -> int:
    """The layer number of parameter `name` in a ViT of `num_blocks` blocks: 0 embeddings, `i + 1` block `i`,
    `num_blocks + 1` the rest (final norm, head)."""
    block = _BLOCK.search(name)
    if block is not None:
        return int(block.group(1) or block.group(2)) + 1
    if _EMBEDDINGS.search(name):
        return 0
    return num_blocks + 1


def takes_weight_decay(name: str, parameter: nn.Parameter) -> bool:
    """Whether weight decay applies: not to biases, norms (one dimension), position embeddings or special tokens."""
    return parameter.ndim > 1 and not name.endswith(".bias") and name.rsplit(".", 1)[-1] not in NO_WEIGHT_DECAY_NAMES


def layer_decay_param_groups(
    model: nn.Module, learning_rate: float, weight_decay: float, layer_decay: float
) -> list[dict[str, Any]]:
    """The optimiser's parameter groups of `model`'s trained parameters: one per (layer, weight decay or not), each
    with its `lr` (`learning_rate * layer_decay ** (L + 1 - layer)`), `weight_decay`, and for the record `layer`,
    `lr_scale` and `param_names`. In layer order, so that an optimiser's saved state matches on resume."""
    if not 0 < layer_decay <= 1:
        raise ValueError(f"--layer_decay must be in (0, 1] (e.g. 0.65 for ViT-B), got {layer_decay}.")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    blocks = [int(m.group(1) or m.group(2)) for name, _ in model.named_parameters() if (m := _BLOCK.search(name))]
    num_blocks = max(blocks, default=-1) + 1
    top = num_blocks + 1
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, parameter in named:
        layer = layer_of(name, num_blocks)
        decays = takes_weight_decay(name, parameter)
        scale = layer_decay ** (top - layer)
        group = groups.setdefault(
            (layer, decays),
            {
                "params": [],
                "param_names": [],
                "lr": learning_rate * scale,
                "weight_decay": weight_decay if decays else 0.0,
                "layer": layer,
                "lr_scale": scale,
            },
        )
        group["params"].append(parameter)
        group["param_names"].append(name)
    return [groups[key] for key in sorted(groups, key=lambda key: (key[0], not key[1]))]


def describe_param_groups(groups: list[dict[str, Any]]) -> str:
    """One line per group for the run's set-up: layer, lr scale, weight decay, parameter count."""
    return "; ".join(
        f"layer {group['layer']}: lr x {group['lr_scale']:.4g}, weight decay {group['weight_decay']:g}, "
        f"{len(group['params'])} tensors ({sum(p.numel() for p in group['params']):,} values)"
        for group in groups
    )


# ---------------------------------------------------------------------------------------------------------------------
# Named recipes


@dataclass(frozen=True)
class Recipe:
    """A paper's training recipe as flag values. `base_batch`: the learning rate is the paper's for that global
    batch and scales linearly with the run's (as the paper says), unless `--learning_rate` is given."""

    name: str
    source: str
    flags: dict[str, Any] = field(default_factory=dict)
    base_batch: int | None = None
    left_out: str = ""
    selectable: bool = True  # chosen with --recipe; the paper's own two are the tasks' defaults (`TASK_RECIPES`)


_ADAMW = dict(optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999)
# DeiT's regularisation and augmentation, which MAE's fine-tuning takes over.
_DEIT_REGULARISATION = dict(
    max_grad_norm=0.0,
    label_smoothing_factor=0.1,
    hidden_dropout_prob=0.0,
    drop_path_rate=0.1,
    mixup_alpha=0.8,
    cutmix_alpha=1.0,
    mixup_prob=1.0,
    mixup_switch_prob=0.5,
    rand_augment="rand-m9-mstd0.5-inc1",
    reprob=0.25,
    remode="pixel",
    recount=1,
)
RECIPES: dict[str, Recipe] = {
    # Every value is only a default: any Trainer flag overrides it.
    "vit-pretrain": Recipe(
        name="vit-pretrain",
        source="Dosovitskiy et al. 2021, An Image is Worth 16x16 Words, section 4.1 and appendix B.1 (pretraining)",
        flags=dict(
            **_ADAMW,
            weight_decay=0.1,
            learning_rate=1e-3,
            lr_scheduler_type="linear",
            warmup_steps=0.1,
            max_grad_norm=1.0,
        ),
        selectable=False,
    ),
    "vit-finetune": Recipe(
        name="vit-finetune",
        source="Dosovitskiy et al. 2021, An Image is Worth 16x16 Words, appendix B.1.1 (fine-tuning)",
        flags=dict(
            optim="sgd",
            optim_args="momentum=0.9",
            weight_decay=0.0,
            learning_rate=0.01,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            max_grad_norm=1.0,
        ),
        selectable=False,
    ),
    # AugReg: lr 1e-3 at batch 4096 (not scaled), 10k of ~94k steps warmup.
    "augreg": Recipe(
        name="augreg",
        source="Steiner et al. 2021, How to train your ViT? (AugReg), medium1 augmentation with regularisation 0.1",
        flags=dict(
            **_ADAMW,
            learning_rate=1e-3,
            weight_decay=0.1,
            lr_scheduler_type="cosine",
            warmup_steps=0.1,
            max_grad_norm=1.0,
            label_smoothing_factor=0.0,
            hidden_dropout_prob=0.1,
            drop_path_rate=0.1,
            mixup_alpha=0.2,
            cutmix_alpha=0.0,
            rand_augment="rand-m15-n2-mmax15",
        ),
    ),
    # DeiT: warmup 5 of 300 epochs.
    "deit": Recipe(
        name="deit",
        source="Touvron et al. 2021, Training data-efficient image transformers (DeiT), table 9",
        flags=dict(
            **_ADAMW,
            learning_rate=5e-4,
            weight_decay=0.05,
            lr_scheduler_type="cosine",
            warmup_steps=5 / 300,
            **_DEIT_REGULARISATION,
            ema_decay=0.99996,
            ema_warmup=True,
        ),
        base_batch=512,
        left_out="repeated augmentation is not implemented; the EMA warms up (timm's "
        "ModelEmaV3 warmup) so that short runs do not average over their first steps",
    ),
    # MAE's end-to-end fine-tuning (after BEiT): warmup 5 of 100 epochs.
    "finetune": Recipe(
        name="finetune",
        source="He et al. 2021, Masked Autoencoders Are Scalable Vision Learners, appendix A.2 (fine-tuning, ViT-B)",
        flags=dict(
            **_ADAMW,
            learning_rate=5e-4,
            weight_decay=0.05,
            layer_decay=0.65,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            **_DEIT_REGULARISATION,
        ),
        base_batch=256,
    ),
}


# The recipe whose values are each task's flags' defaults; `--recipe` puts a named one's values in their place.
TASK_RECIPES = {"pretrain": RECIPES["vit-pretrain"], "finetune": RECIPES["vit-finetune"]}
# The recipes `--recipe` names (a view of the one table).
NAMED_RECIPES = {name: recipe for name, recipe in RECIPES.items() if recipe.selectable}


def get_recipe(name: str) -> Recipe:
    if name not in NAMED_RECIPES:
        raise ValueError(f"--recipe must be one of {sorted(NAMED_RECIPES)}, got {name!r}.")
    return NAMED_RECIPES[name]


def scaled_learning_rate(recipe: Recipe, global_batch: int) -> float:
    """The recipe's learning rate for a run's global batch (linear scaling from `base_batch`, as its paper does)."""
    lr = recipe.flags["learning_rate"]
    return lr if recipe.base_batch is None else lr * global_batch / recipe.base_batch


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, Any]:
    """The flags `argv` gives explicitly (however spelled: `--x v`, `--x=v`, `--no_x`), by destination, with their
    values."""
    # argparse fills in defaults (the actions' and set_defaults') for flags not given: suppress them for one parse.
    saved = [(action, action.default, action.required) for action in parser._actions], parser._defaults
    parser._defaults = {}
    try:
        for action, _, _ in saved[0]:
            action.default, action.required = argparse.SUPPRESS, False
        namespace, _ = parser.parse_known_args(argv)
    finally:
        for action, default, required in saved[0]:
            action.default, action.required = default, required
        parser._defaults = saved[1]
    return vars(namespace)


def recipe_summary(recipe: Recipe, values: dict[str, Any], passed: set[str]) -> str:
    """What a recipe ran with, for the run's log and its card: the paper, each of its flags' values, and which of
    them the command line overrode."""
    shown = []
    for name in recipe.flags:
        value = values.get(name, recipe.flags[name])
        note = " (given on the command line)" if name in passed else ""
        shown.append(f"{name}={card_value(value)}{note}")
    if recipe.base_batch is not None and "learning_rate" not in passed:
        shown.append(f"learning rate scaled from {recipe.flags['learning_rate']:g} at batch {recipe.base_batch}")
    text = f"recipe {recipe.name} ({recipe.source}): " + ", ".join(shown)
    return text + (f". Left out: {recipe.left_out}." if recipe.left_out else ".")


# ---------------------------------------------------------------------------------------------------------------------
# A run's recipe, from its settings


@dataclass(frozen=True)
class RecipeSettings:
    """The recipe flags' values a run's Trainer, log and card need (`name`: `--recipe`; `given`: the flags the command
    line gave)."""

    name: str | None = None
    given: frozenset[str] = frozenset()
    layer_decay: float | None = None
    ema_decay: float | None = None
    ema_warmup: bool = False
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    cutmix_minmax: tuple[float, float] | None = None
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    label_smoothing: float = 0.0


def learning_rate_for_images(recipe: RecipeSettings, images: float, rate: float, log: bool = True) -> float:
    """A named recipe's learning rate for a global batch of `images` images (packed batches: the mean a global batch
    holds, not its rows); `rate` where the run's rate is not the recipe's scaled one (no named recipe, one without
    scaling, or `--learning_rate` given). `log`: say so."""
    named = get_recipe(recipe.name) if recipe.name is not None else None
    if named is None or named.base_batch is None or "learning_rate" in recipe.given:
        return rate
    rate = scaled_learning_rate(named, images)
    if log:
        logger.info(
            "Learning rate %.4g: the %s recipe's %g at a global batch of %d images, scaled to this run's %.1f images "
            "on average (packed batches: the images their rows hold, not the rows).",
            rate, named.name, named.flags["learning_rate"], named.base_batch, images,
        )  # fmt: skip
    return rate


def mixing_for(recipe: RecipeSettings, config: Any = None, enabled_only: bool = True) -> Mixing | None:
    """The run's `Mixing` of its training batches for a classifier with `config` (None when off, with
    `enabled_only`)."""
    named = ("mixup_alpha", "cutmix_alpha", "cutmix_minmax", "label_smoothing")  # the same names in Mixing
    mixing = Mixing(
        num_classes=max(int(getattr(config, "num_labels", 0)), 2),
        prob=recipe.mixup_prob,
        switch_prob=recipe.mixup_switch_prob,
        multi_label=getattr(config, "problem_type", None) == "multi_label_classification",
        **{name: getattr(recipe, name) for name in named},
    )
    return mixing if mixing.enabled or not enabled_only else None


def log_recipe(recipe: RecipeSettings, values: dict[str, Any]) -> None:
    """The run's set-up: the named recipe and the values (`values`: every flag's) it ran with."""
    if recipe.name is not None:
        logger.info("Training with the %s", recipe_summary(get_recipe(recipe.name), values, set(recipe.given)))


def regularisation_text(recipe: RecipeSettings, augmentation: Augmentation, model: ModelSettings) -> str:
    """The augmentation and regularisation a run used, in one sentence (empty when none of them)."""
    parts = []
    if recipe.layer_decay is not None:
        parts.append(f"layer-wise learning-rate decay {recipe.layer_decay}")
    if recipe.ema_decay is not None:
        warmup = " with warmup" if recipe.ema_warmup else ""
        parts.append(f"EMA of the weights (decay {recipe.ema_decay}{warmup}; the saved weights are the EMA)")
    mixup = recipe.mixup_alpha > 0
    cutmix = recipe.cutmix_alpha > 0 or bool(recipe.cutmix_minmax)
    if mixup:
        parts.append(f"Mixup alpha {recipe.mixup_alpha}")
    if cutmix:
        minmax = f" (box sides {list(recipe.cutmix_minmax)} of the image's)" if recipe.cutmix_minmax else ""
        parts.append(f"CutMix alpha {recipe.cutmix_alpha}{minmax}")
    if mixup or cutmix:
        share = f", CutMix for {recipe.mixup_switch_prob} of them" if mixup and cutmix else ""
        parts.append(f"batches mixed with probability {recipe.mixup_prob}{share}")
    if augmentation.rand_augment:
        parts.append(f"RandAugment {augmentation.rand_augment}")
    if augmentation.reprob:
        count = f", up to {augmentation.recount} rectangles" if augmentation.recount > 1 else ""
        parts.append(f"random erasing {augmentation.reprob} ({augmentation.remode} fill{count})")
    if recipe.label_smoothing:
        parts.append(f"label smoothing {recipe.label_smoothing}")
    for value, text in ((model.drop_path_rate, "stochastic depth"), (model.hidden_dropout_prob, "dropout")):
        if value:
            parts.append(f"{text} {value}")
    return ("Regularisation and augmentation: " + ", ".join(parts) + ".") if parts else ""


def recipe_card_text(run: Any, training_args: Any) -> str:
    """The card's recipe line of `run` (a `training.Run`): the optimiser and schedule (`training_recipe_text`), the
    regularisation, the sizes drawn per step, and the named recipe with the values it ran with, if any."""
    recipe, augmentation = run.recipe, run.augmentation
    optimiser_text = training_recipe_text(run.task, training_args)
    text = " ".join(filter(None, [optimiser_text, regularisation_text(recipe, augmentation, run.model)]))
    text += drawn_sizes_text(run.sizes, training_args.per_device_train_batch_size, run.source.streaming)
    if augmentation.token_drop_rate:
        text += (
            f" NaViT token dropping: each training image kept a random {1 - augmentation.token_drop_rate:g} of its "
            "patches (drawn per image and epoch); evaluation kept all."
        )
    if recipe.name is not None:
        text += " Named " + recipe_summary(get_recipe(recipe.name), run.values, set(recipe.given))
    return text


def drawn_sizes_text(sizes: BatchSizes, per_device_batch: int, streaming: bool = False) -> str:
    """The card's words for packed sequences (`--packed_sequence_length`: a fixed number of rows per batch, or on a
    stream of images) and sizes drawn per step (`--seq_lens`, `--patch_sizes`), or nothing."""
    text = ""
    if sizes.packed_sequence_length and streaming:
        text += (
            f" NaViT sequence packing: each batch's {per_device_batch} images per device (a stream), at their own "
            f"aspect ratio on at most {sizes.max_num_patches} patches each, packed whole into rows of "
            f"{sizes.packed_sequence_length} patch slots (attention and pooling per image)."
        )
    elif sizes.packed_sequence_length:
        text += (
            f" NaViT sequence packing: each batch {per_device_batch} rows of {sizes.packed_sequence_length} patch "
            f"slots per device, filled with as many whole images as they hold (a number that varies per batch), at "
            f"their own aspect ratio on at most {sizes.max_num_patches} patches each (attention and pooling per "
            "image)."
        )
    if sizes.seq_lens:
        longest = max(int(length) for length in sizes.seq_lens.split(","))
        budget = sizes.max_tokens_per_batch or per_device_batch * longest
        text += (
            f" Native aspect ratio with a sequence length drawn per step from {sizes.seq_lens} patches, each device's "
            f"batch holding {budget} // length images."
        )
    if sizes.patch_sizes:
        weights = sizes.patch_size_probs
        text += (
            f" FlexiViT training: a patch size drawn per step from {sizes.patch_sizes}"
            + (f" (weights {weights})" if weights else "")
            + ", the patch embedding resampled from the saved one by the pseudo-inverse resize."
        )
    return text


def refuse_augmentation(objective: str, augmentable: bool, augmentation: Augmentation, recipe: RecipeSettings) -> None:
    """Refuse Mixup, CutMix, RandAugment and random erasing, by name, for an objective that learns the pixels
    themselves (random erasing would replace the very patches it must reconstruct with noise)."""
    if augmentable:
        return
    used = [
        flag
        for flag, on in (
            ("--mixup_alpha", recipe.mixup_alpha > 0),
            ("--cutmix_alpha", recipe.cutmix_alpha > 0 or recipe.cutmix_minmax),
            ("--rand_augment", augmentation.rand_augment is not None),
            ("--reprob", augmentation.reprob > 0),
        )
        if on
    ]
    if used:
        raise ValueError(
            f"{', '.join(used)} augment(s) images for classification: --objective {objective} learns the patches' "
            "colours, which they would change. Drop them (a --recipe sets them: override with --mixup_alpha 0 "
            "--cutmix_alpha 0 --reprob 0, or train without --recipe)."
        )
