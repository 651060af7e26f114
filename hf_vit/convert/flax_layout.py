"""What the Flax `.npz` layouts (the authors' vit_jax and big_vision) share: the array transforms, the rows of the
norms, attention and MLP blocks, and the sizes read from the arrays' shapes."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from ..model.configuration_vit import VisionTransformerConfig
from .common import ConversionError, Transform, count_blocks, image_size_field, square_side

BLOCK_KEY = re.compile(r"^Transformer/encoderblock_(\d+)/")
SCAN_ERROR = (
    "The Transformer blocks are stacked into one 'Transformer/encoderblock/...' set of arrays (big_vision "
    "with scan=True); this layout is not supported. Unstack them into 'Transformer/encoderblock_<i>/'."
)


def _heads(config: VisionTransformerConfig | None) -> int:
    if config is None:
        raise ConversionError("Writing the JAX layout needs the config: its kernels are split by attention head.")
    return config.num_attention_heads


# Flax kernels are (in, out) and split by head; hf-vit's are torch's (out, in), heads flattened.
CONV = Transform(lambda k: k.permute(3, 2, 0, 1), lambda w, config: (w.permute(2, 3, 1, 0),))  # HWIO <-> OIHW
DENSE = Transform(lambda k: k.T, lambda w, config: (w.T,))
QKV_KERNEL = Transform(  # 3 x (D, heads, head_dim) <-> rows [q; k; v] of (3 D, D)
    lambda *kernels: torch.cat([k.flatten(1).T for k in kernels]),
    lambda w, config: tuple(part.T.unflatten(1, (_heads(config), -1)) for part in w.chunk(3)),
)
QKV_BIAS = Transform(  # 3 x (heads, head_dim) <-> (3 D,)
    lambda *biases: torch.cat([b.flatten() for b in biases]),
    lambda b, config: tuple(part.unflatten(0, (_heads(config), -1)) for part in b.chunk(3)),
)
OUT_KERNEL = Transform(  # (heads, head_dim, D) <-> (D, D)
    lambda k: k.flatten(0, 1).T, lambda w, config: (w.T.unflatten(0, (_heads(config), -1)),)
)


def norm_rows(source: str, target: str) -> list[tuple]:
    """A Flax norm's `scale` and `bias` <-> torch's `weight` and `bias`."""
    return [(source + "scale", target + "weight"), (source + "bias", target + "bias")]


def attention_rows(source: str, qkv: str, out: str) -> list[tuple]:
    """Flax attention's query, key, value <-> the fused `qkv`, and its `out` projection <-> `out`."""
    parts = [tuple(f"{source}{part}/{name}" for part in ("query", "key", "value")) for name in ("kernel", "bias")]
    return [
        (parts[0], qkv + "weight", QKV_KERNEL),
        (parts[1], qkv + "bias", QKV_BIAS),
        (source + "out/kernel", out + "weight", OUT_KERNEL),
        (source + "out/bias", out + "bias"),
    ]


def mlp_rows(source: str, target: str) -> list[tuple]:
    """A Flax MlpBlock's `Dense_0` and `Dense_1` <-> `fc1` and `fc2`."""
    return [
        row
        for i in (0, 1)
        for row in (
            (f"{source}Dense_{i}/kernel", f"{target}fc{i + 1}.weight", DENSE),
            (f"{source}Dense_{i}/bias", f"{target}fc{i + 1}.bias"),
        )
    ]


def array_shape(source: Mapping[str, np.ndarray], key: str, ndim: int, problems: list[str]) -> tuple[int, ...] | None:
    """The shape of `source[key]` when it is an array of `ndim` dimensions, else None and a problem saying why."""
    value = source.get(key)
    if value is None:
        problems.append(f"{key} is missing")
        return None
    if not isinstance(value, np.ndarray) or value.ndim != ndim:
        got = value.shape if isinstance(value, np.ndarray) else type(value).__name__
        problems.append(f"{key} should have {ndim} dimensions, got {got}")
        return None
    return tuple(value.shape)


def read_sizes(
    source: Mapping[str, np.ndarray],
    attention: str,
    mlp: str,
    problems: list[str],
    stem: Callable[[tuple[int, ...] | None], dict] | None = None,
) -> dict:
    """The sizes of a Flax ViT from its arrays' shapes: width, patch size and channels from `embedding/kernel`
    (`stem(kernel)` adds a hybrid's), depth from the blocks, heads from the first block's `attention` query kernel,
    the MLP from `mlp`'s `Dense_0`, the representation size from `pre_logits`, the classes from `head` (0 without)."""
    fields: dict = {}
    kernel = array_shape(source, "embedding/kernel", 4, problems)
    if kernel is not None:
        if kernel[0] != kernel[1]:
            problems.append(f"embedding/kernel {kernel}: non-square {kernel[0]}x{kernel[1]} patches are not supported")
        fields.update(patch_size=kernel[0], num_channels=kernel[2], hidden_size=kernel[3])
    if stem is not None:
        fields.update(stem(kernel))
    fields["num_hidden_layers"] = count_blocks(source, BLOCK_KEY, problems)
    if (query := array_shape(source, attention + "query/kernel", 3, problems)) is not None:
        fields["num_attention_heads"] = query[1]
    if (dense := array_shape(source, mlp + "Dense_0/kernel", 2, problems)) is not None:
        fields["intermediate_size"] = dense[1]
    fields["qkv_bias"] = attention + "query/bias" in source
    pre_logits = array_shape(source, "pre_logits/kernel", 2, problems) if "pre_logits/kernel" in source else None
    fields["representation_size"] = pre_logits[1] if pre_logits else None
    head = array_shape(source, "head/kernel", 2, problems) if "head/kernel" in source else None
    fields["num_labels"] = head[1] if head else 0
    return fields


def read_image_size(
    source: Mapping[str, np.ndarray],
    pos_key: str,
    fields: dict,
    image_size: int | Sequence[int] | None,
    problems: list[str],
) -> None:
    """`fields["image_size"]`: `image_size` when given, else the square position grid times the patch size."""
    if image_size is not None:
        fields["image_size"] = image_size_field(image_size)
    elif (pos := array_shape(source, pos_key, 3, problems)) is not None and "patch_size" in fields:
        patches = pos[1] - int("cls" in source)
        if side := square_side(patches):
            fields["image_size"] = side * fields["patch_size"]
        else:
            problems.append(f"{pos_key} {pos}: {patches} patch positions are not a square grid; pass image_size")


def _tensor(value):
    """A float array as a tensor sharing its memory; anything else as it is (the check reports it)."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value
