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

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

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


RECIPES: dict[str, Recipe] = {
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
    # rand-m9-mstd0.5-inc1, Mixup 0.8 and CutMix 1.0 (half each), EMA 0.99996, no clipping.
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
            ema_decay=0.99996,
            ema_warmup=True,
        ),
        base_batch=512,
        left_out="random erasing (0.25) and repeated augmentation are not implemented; the EMA warms up (timm's "
        "ModelEmaV3 warmup) so that short runs do not average over their first steps",
    ),
    # He et al. 2021, "Masked Autoencoders Are Scalable Vision Learners", appendix A.2 (end-to-end fine-tuning, after
    # BEiT): AdamW (0.9, 0.999), lr 5e-4 x batch/256, weight decay 0.05, layer-wise decay 0.65 (ViT-B), 5 of 100
    # epochs warmup then cosine, label smoothing 0.1, Mixup 0.8, CutMix 1.0, RandAugment (9, 0.5), drop path 0.1.
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
        ),
        base_batch=256,
        left_out="random erasing (0.25) is not implemented",
    ),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"--recipe must be one of {sorted(RECIPES)}, got {name!r}.")
    return RECIPES[name]


def scaled_learning_rate(recipe: Recipe, global_batch: int) -> float:
    """The recipe's learning rate for a run's global batch (linear scaling from `base_batch`, as its paper does)."""
    lr = recipe.flags["learning_rate"]
    return lr if recipe.base_batch is None else lr * global_batch / recipe.base_batch
