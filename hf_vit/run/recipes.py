"""The training recipes that make ViTs learn from mid-sized data: layer-wise learning-rate decay (as parameter groups)
and the named recipes (`--recipe`), each a table of flags from its paper.

Layer-wise decay numbers the model's parameters as timm's `param_groups_layer_decay` does for a ViT of L blocks:
the embeddings (patch embedding, class and mask tokens, positions, the hybrid's ResNet stem) are layer 0, block `i`
(0-based) is layer `i + 1`, and everything after the blocks (the final norm, the pre-logits layer and the classifier,
or masked patch prediction's head) is layer `L + 1`. Layer `k` learns at `lr * D ** (L + 1 - k)`: block `i` at
`lr * D ** (L - i)`, the embeddings at `lr * D ** (L + 1)`, the head at `lr`. Biases, norms (every parameter of one
dimension), position embeddings and special tokens get no weight decay. The names are matched inside any wrapper
(peft's `base_model.model.`, DDP's `module.`), so the same function serves the plain model, a LoRA-wrapped model and
the masked patch prediction model; frozen parameters are left out.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn
from torch.nn import functional as F

from ..outputs.cards import card_value
from .ema import EmaCallback
from .mixing import Mixing, mix_batch, mixing_seed, soft_target_cross_entropy

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


def count_blocks(names: Iterable[str]) -> int:
    blocks = [int(m.group(1) or m.group(2)) for name in names if (m := _BLOCK.search(name))]
    return max(blocks) + 1 if blocks else 0


def layer_decay_param_groups(
    model: nn.Module, learning_rate: float, weight_decay: float, layer_decay: float
) -> list[dict[str, Any]]:
    """The optimiser's parameter groups of `model`'s trained parameters: one per (layer, weight decay or not), each
    with its `lr` (`learning_rate * layer_decay ** (L + 1 - layer)`), `weight_decay`, and for the record `layer`,
    `lr_scale` and `param_names`. In layer order, so that an optimiser's saved state matches on resume."""
    if not 0 < layer_decay <= 1:
        raise ValueError(f"--layer_decay must be in (0, 1] (e.g. 0.65 for ViT-B), got {layer_decay}.")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    num_blocks = count_blocks(name for name, _ in model.named_parameters())
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
    lines = []
    for group in groups:
        count = sum(p.numel() for p in group["params"])
        lines.append(
            f"layer {group['layer']}: lr x {group['lr_scale']:.4g}, weight decay {group['weight_decay']:g}, "
            f"{len(group['params'])} tensors ({count:,} values)"
        )
    return "; ".join(lines)


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


NAMED_RECIPES: dict[str, Recipe] = {
    # Steiner et al. 2021, "How to train your ViT? Data, Augmentation, and Regularization in Vision Transformers":
    # Adam, lr 1e-3 at batch 4096, decoupled weight decay 0.1, 10k of ~94k steps warmup then cosine, clipping at 1;
    # the "medium1" augmentation (Mixup 0.2, RandAugment 2 ops at magnitude 15) with dropout and stochastic depth 0.1.
    "augreg": Recipe(
        name="augreg",
        source="Steiner et al. 2021, How to train your ViT? (AugReg), medium1 augmentation with regularisation 0.1",
        flags=dict(
            optim="adamw_torch",
            adam_beta1=0.9,
            adam_beta2=0.999,
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
    # Touvron et al. 2021, "Training data-efficient image transformers" (DeiT), table 9: AdamW, lr 5e-4 x batch/512,
    # weight decay 0.05, cosine with 5 of 300 epochs warmup, label smoothing 0.1, stochastic depth 0.1, RandAugment
    # rand-m9-mstd0.5-inc1, Mixup 0.8 and CutMix 1.0 (half each), random erasing 0.25 (one rectangle of per-pixel
    # noise), EMA 0.99996, no clipping.
    "deit": Recipe(
        name="deit",
        source="Touvron et al. 2021, Training data-efficient image transformers (DeiT), table 9",
        flags=dict(
            optim="adamw_torch",
            adam_beta1=0.9,
            adam_beta2=0.999,
            learning_rate=5e-4,
            weight_decay=0.05,
            lr_scheduler_type="cosine",
            warmup_steps=5 / 300,
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
            ema_decay=0.99996,
            ema_warmup=True,
        ),
        base_batch=512,
        left_out="repeated augmentation is not implemented; the EMA warms up (timm's "
        "ModelEmaV3 warmup) so that short runs do not average over their first steps",
    ),
    # He et al. 2021, "Masked Autoencoders Are Scalable Vision Learners", appendix A.2 (end-to-end fine-tuning, after
    # BEiT): AdamW (0.9, 0.999), lr 5e-4 x batch/256, weight decay 0.05, layer-wise decay 0.65 (ViT-B), 5 of 100
    # epochs warmup then cosine, label smoothing 0.1, Mixup 0.8, CutMix 1.0, RandAugment (9, 0.5), random erasing
    # 0.25, drop path 0.1.
    "finetune": Recipe(
        name="finetune",
        source="He et al. 2021, Masked Autoencoders Are Scalable Vision Learners, appendix A.2 (fine-tuning, ViT-B)",
        flags=dict(
            optim="adamw_torch",
            adam_beta1=0.9,
            adam_beta2=0.999,
            learning_rate=5e-4,
            weight_decay=0.05,
            layer_decay=0.65,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
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
        ),
        base_batch=256,
    ),
}


def get_recipe(name: str) -> Recipe:
    if name not in NAMED_RECIPES:
        raise ValueError(f"--recipe must be one of {sorted(NAMED_RECIPES)}, got {name!r}.")
    return NAMED_RECIPES[name]


def scaled_learning_rate(recipe: Recipe, global_batch: int) -> float:
    """The recipe's learning rate for a run's global batch (linear scaling from `base_batch`, as its paper does)."""
    lr = recipe.flags["learning_rate"]
    return lr if recipe.base_batch is None else lr * global_batch / recipe.base_batch


def passed_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags `argv` gives explicitly (however spelled: `--x v`, `--x=v`, `--no_x`)."""
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
    return set(vars(namespace))


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


class RecipeTrainerMixin:
    """The recipes' part of a run's Trainer (put it before `transformers.Trainer` in the bases):

    - `args.layer_decay`: the optimiser gets `layer_decay_param_groups` (logged) instead of Trainer's two groups;
    - `mixing` (a `Mixing`): each training batch is mixed on its way into `training_step`, seeded by the run's seed,
      the optimiser step and the batch's place in it (the same on every process, and again after resuming), and its
      soft targets are learnt with soft-target cross-entropy (single-label) or the sigmoid cross-entropy the model
      uses (multi-label); evaluation is unchanged;
    - `ema` (an `ema.EmaCallback`): evaluation during training sees the averaged weights, and every checkpoint holds
      the average (`ema.EMA_FILE`, written before Trainer's state so that a cut checkpoint is skipped) to resume it.
    """

    mixing: Mixing | None = None
    ema: EmaCallback | None = None
    _mixing_step: tuple[int, int] = (-1, 0)

    def create_optimizer(self, model=None):
        layer_decay = getattr(self.args, "layer_decay", None)
        if layer_decay is None or self.optimizer is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        if {"params", "model", "optimizer_dict"} & set(kwargs) or not isinstance(optimizer_cls, type):
            raise ValueError(
                f"--layer_decay builds the optimiser's parameter groups, which --optim {self.args.optim} builds "
                "itself: use it with adamw_torch, sgd, adafactor or another optimiser of parameter groups."
            )
        kwargs = dict(kwargs)
        learning_rate = kwargs.pop("lr", self.args.learning_rate)
        groups = layer_decay_param_groups(opt_model, learning_rate, self.args.weight_decay, layer_decay)
        if self.args.process_index == 0:
            logger.info("Layer-wise learning-rate decay %g: %s.", layer_decay, describe_param_groups(groups))
        groups = [{key: value for key, value in g.items() if key != "param_names"} for g in groups]
        self.optimizer = optimizer_cls(groups, lr=learning_rate, **kwargs)
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.mixing is not None and "labels" in inputs:
            step = self.state.global_step
            micro = self._mixing_step[1] + 1 if self._mixing_step[0] == step else 0
            self._mixing_step = (step, micro)
            rng = np.random.default_rng(mixing_seed(self.args.seed, step, micro))
            pixel_values, targets, _ = mix_batch(inputs["pixel_values"], inputs["labels"], self.mixing, rng)
            inputs = {**inputs, "pixel_values": pixel_values, "labels": targets}
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.get("labels")
        if self.mixing is None or not model.training or labels is None or not labels.is_floating_point():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = {key: value for key, value in inputs.items() if key != "labels"}
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        by_items = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if self.mixing.multi_label:  # the model's own multi-label loss (a mean), on the soft multi-hot targets
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels.to(logits.device))
        else:
            loss = soft_target_cross_entropy(logits, labels, num_items_in_batch if by_items else None)
        if self.args.average_tokens_across_devices and by_items:
            loss = loss * self.accelerator.num_processes  # as Trainer scales the model's own loss
        return (loss, outputs) if return_outputs else loss

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        if self.ema is None or not self.ema.averaging:
            return super().evaluate(*args, **kwargs)
        with self.ema.average.applied():
            return super().evaluate(*args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.ema is not None:
            self.ema.resume_from = resume_from_checkpoint

    def _save_checkpoint(self, model, trial) -> None:
        if self.ema is not None and self.ema.average is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            self.ema.average.save(folder)
        super()._save_checkpoint(model, trial)


# ---------------------------------------------------------------------------------------------------------------------
# A run's recipe, from its arguments


def ema_callback(training_args: Any) -> EmaCallback | None:
    decay = getattr(training_args, "ema_decay", None)
    return None if decay is None else EmaCallback(decay, getattr(training_args, "ema_warmup", False))


def mixing_for(training_args: Any, config: Any) -> Mixing | None:
    """The run's `Mixing` of its training batches (None when off), for a classifier with `config`."""
    minmax = getattr(training_args, "cutmix_minmax", None)
    mixing = Mixing(
        num_classes=max(int(getattr(config, "num_labels", 0)), 2),
        mixup_alpha=getattr(training_args, "mixup_alpha", 0.0),
        cutmix_alpha=getattr(training_args, "cutmix_alpha", 0.0),
        cutmix_minmax=tuple(minmax) if minmax else None,
        prob=getattr(training_args, "mixup_prob", 1.0),
        switch_prob=getattr(training_args, "mixup_switch_prob", 0.5),
        label_smoothing=training_args.label_smoothing_factor,
        multi_label=getattr(config, "problem_type", None) == "multi_label_classification",
    )
    return mixing if mixing.enabled else None


def _flag_values(*arguments: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for args in arguments:
        values.update({name: getattr(args, name) for name in getattr(args, "__dataclass_fields__", {})})
    return values


def log_recipe(model_args: Any, data_args: Any, training_args: Any) -> None:
    """The run's set-up: the named recipe and the values it ran with."""
    name = getattr(training_args, "recipe", None)
    if name is not None:
        given = set(getattr(training_args, "recipe_flags_given", ()))
        values = _flag_values(model_args, data_args, training_args)
        logger.info("Training with the %s", recipe_summary(get_recipe(name), values, given))


def regularisation_text(model_args: Any, data_args: Any, training_args: Any) -> str:
    """The augmentation and regularisation a run used, in one sentence (empty when none of them)."""
    parts = []
    if getattr(training_args, "layer_decay", None) is not None:
        parts.append(f"layer-wise learning-rate decay {training_args.layer_decay}")
    if getattr(training_args, "ema_decay", None) is not None:
        warmup = " with warmup" if training_args.ema_warmup else ""
        parts.append(f"EMA of the weights (decay {training_args.ema_decay}{warmup}; the saved weights are the EMA)")
    mixup = getattr(training_args, "mixup_alpha", 0) > 0
    cutmix = getattr(training_args, "cutmix_alpha", 0) > 0 or bool(getattr(training_args, "cutmix_minmax", None))
    if mixup:
        parts.append(f"Mixup alpha {training_args.mixup_alpha}")
    if cutmix:
        minmax = f" (box sides {training_args.cutmix_minmax} of the image's)" if training_args.cutmix_minmax else ""
        parts.append(f"CutMix alpha {training_args.cutmix_alpha}{minmax}")
    if mixup or cutmix:
        share = f", CutMix for {training_args.mixup_switch_prob} of them" if mixup and cutmix else ""
        parts.append(f"batches mixed with probability {training_args.mixup_prob}{share}")
    if getattr(data_args, "rand_augment", None):
        parts.append(f"RandAugment {data_args.rand_augment}")
    if getattr(data_args, "reprob", 0):
        count = f", up to {data_args.recount} rectangles" if data_args.recount > 1 else ""
        parts.append(f"random erasing {data_args.reprob} ({data_args.remode} fill{count})")
    if training_args.label_smoothing_factor:
        parts.append(f"label smoothing {training_args.label_smoothing_factor}")
    for name, text in (("drop_path_rate", "stochastic depth"), ("hidden_dropout_prob", "dropout")):
        if getattr(model_args, name, None):
            parts.append(f"{text} {getattr(model_args, name)}")
    return ("Regularisation and augmentation: " + ", ".join(parts) + ".") if parts else ""


def recipe_card_text(task: str, model_args: Any, data_args: Any, training_args: Any) -> str:
    """The card's recipe line: the optimiser and schedule, the regularisation, and the named recipe, if any."""
    from ..outputs.cards import training_recipe_text

    text = " ".join(
        filter(
            None,
            [training_recipe_text(task, training_args), regularisation_text(model_args, data_args, training_args)],
        )
    )
    text += drawn_sizes_text(data_args, training_args)
    name = getattr(training_args, "recipe", None)
    if name is not None:
        given = set(getattr(training_args, "recipe_flags_given", ()))
        values = _flag_values(model_args, data_args, training_args)
        text += " Named " + recipe_summary(get_recipe(name), values, given)
    return text


def drawn_sizes_text(data_args: Any, training_args: Any) -> str:
    """The card's words for sizes drawn per step (`--seq_lens`, `--patch_sizes`), or nothing."""
    text = ""
    seq_lens = getattr(data_args, "seq_lens", None)
    if seq_lens:
        longest = max(int(length) for length in seq_lens.split(","))
        budget = data_args.max_tokens_per_batch or training_args.per_device_train_batch_size * longest
        text += (
            f" Native aspect ratio with a sequence length drawn per step from {seq_lens} patches, each device's batch "
            f"holding {budget} // length images."
        )
    patch_sizes = getattr(data_args, "patch_sizes", None)
    if patch_sizes:
        weights = getattr(data_args, "patch_size_probs", None)
        text += (
            f" FlexiViT training: a patch size drawn per step from {patch_sizes}"
            + (f" (weights {weights})" if weights else "")
            + ", the patch embedding resampled from the saved one by the pseudo-inverse resize."
        )
    return text


def refuse_augmentation(objective: str, augmentable: bool, data_args: Any, training_args: Any) -> None:
    """Refuse Mixup, CutMix, RandAugment and random erasing, by name, for an objective that learns the pixels
    themselves (random erasing would replace the very patches it must reconstruct with noise)."""
    if augmentable:
        return
    used = [
        flag
        for flag, on in (
            ("--mixup_alpha", getattr(training_args, "mixup_alpha", 0) > 0),
            (
                "--cutmix_alpha",
                getattr(training_args, "cutmix_alpha", 0) > 0 or getattr(training_args, "cutmix_minmax", None),
            ),
            ("--rand_augment", getattr(data_args, "rand_augment", None) is not None),
            ("--reprob", getattr(data_args, "reprob", 0) > 0),
        )
        if on
    ]
    if used:
        raise ValueError(
            f"{', '.join(used)} augment(s) images for classification: --objective {objective} learns the patches' "
            "colours, which they would change. Drop them (a --recipe sets them: override with --mixup_alpha 0 "
            "--cutmix_alpha 0 --reprob 0, or train without --recipe)."
        )
