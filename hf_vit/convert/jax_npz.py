"""The authors' JAX/Flax `.npz` checkpoints (google-research/vision_transformer, AugReg, big_vision) <-> hf-vit.

The files hold one flat array per Flax parameter, named by its path in the parameter tree (`checkpoint.py` writes
them with `np.savez`):

    embedding/kernel                                          (P, P, C, D)   HWIO convolution
    embedding/bias                                            (D,)
    cls                                                       (1, 1, D)      only with classifier "token"
    Transformer/posembed_input/pos_embedding                  (1, [1 +] N, D)
    Transformer/encoderblock_{i}/LayerNorm_0/{scale,bias}     (D,)
    Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/{query,key,value}/kernel   (D, heads, D / heads)
    Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/{query,key,value}/bias     (heads, D / heads)
    Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/out/kernel                 (heads, D / heads, D)
    Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/out/bias                   (D,)
    Transformer/encoderblock_{i}/LayerNorm_2/{scale,bias}     (D,)
    Transformer/encoderblock_{i}/MlpBlock_3/Dense_0/{kernel,bias}   (D, M), (M,)
    Transformer/encoderblock_{i}/MlpBlock_3/Dense_1/{kernel,bias}   (M, D), (D,)
    Transformer/encoder_norm/{scale,bias}                     (D,)
    pre_logits/{kernel,bias}                                  (D, R), (R,)   only with a representation layer
    head/{kernel,bias}                                        (D or R, K), (K,)

This is the layout of the paper's release (ViT-B/16, B/32, L/16, L/32, H/14; ImageNet-21k and fine-tuned) and of the
AugReg release ("How to train your ViT?", Ti/S/B/L), both written by `vit_jax`. Also accepted:

* an `opt/target/` prefix (checkpoints saved with their optimizer; the optimizer state under `opt/` is skipped);
* big_vision's names (`params/` prefix, `MultiHeadDotProductAttention_0`, `LayerNorm_1`, `MlpBlock_0`, and the
  position embedding at the top level as `pos_embedding`). big_vision adds the position embedding *before* it
  prepends the class token, so its class token has no position: a zero position is prepended, which is exact.

`npz_to_hf_vit_state_dict` and `hf_vit_to_npz_arrays` only permute and reshape, so a round trip is bitwise exact;
`hf_vit_to_npz_arrays` always writes the `vit_jax` layout above.

Two choices to know about:

* GELU. The Flax code calls `flax.linen.gelu`, i.e. `jax.nn.gelu` with its default `approximate=True` (the tanh
  approximation). hf-vit's default `hidden_act="gelu"` is the exact erf form, as in transformers' and timm's ports of
  these checkpoints; the two differ by at most 5e-4 per activation. Pass `hidden_act="gelu_pytorch_tanh"` to compute
  the activation exactly as the authors' code does.
* Resolution. With an `image_size` other than the checkpoint's, the position embeddings are resampled at load as the
  authors' `load_pretrained` does. They use `scipy.ndimage.zoom(order=1)` (bilinear through the grid corners, like
  `align_corners=True`); this uses `hf_vit.resolution.resample_position_embeddings` with `mode="bilinear"`
  (`align_corners=False`, what timm uses for these files), the closest mode it offers. Values differ slightly from
  scipy's away from the corners; both are then fine-tuned in practice.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..configuration_vit import VisionTransformerConfig
from ..resolution import resample_position_embeddings
from .common import (
    ConversionError,
    build_config,
    check_output_dir,
    image_size_field,
    load_preset,
    preset_mismatches,
    save_converted_model,
)

POS_KEY = "Transformer/posembed_input/pos_embedding"
_BLOCK = "Transformer/encoderblock_{i}/"
_ATTN = "MultiHeadDotProductAttention_1"
_MLP = "MlpBlock_3"
# big_vision numbers the sub-modules of a block from 0 per type; vit_jax numbers them in order of creation.
_BIG_VISION_RENAMES = {"MultiHeadDotProductAttention_0": _ATTN, "LayerNorm_1": "LayerNorm_2", "MlpBlock_0": _MLP}
_BLOCK_KEY = re.compile(r"^Transformer/encoderblock_(\d+)/([^/]+)/(.+)$")
# The paper's defaults for what the arrays do not say.
PAPER_DEFAULTS = {"layer_norm_eps": 1e-6, "hidden_act": "gelu", "hidden_dropout_prob": 0.0}
# Hints for arrays of other models, shown when they are found.
_FOREIGN_HINTS = (
    ("MAPHead_0/", "an attention-pooling (MAP) head, which hf-vit does not have"),
    ("Transformer/encoderblock/", "blocks stacked by `nn.scan` (big_vision scan=True), not supported: unstack them"),
    ("conv_root/", "a ResNet stem (hybrid R50+ViT), which hf-vit does not have"),
    ("block1/", "ResNet stages (hybrid R50+ViT), which hf-vit does not have"),
    ("LayerScale", "LayerScale, which hf-vit does not have"),
)


def _is_square(n: int) -> bool:
    return n > 0 and math.isqrt(n) ** 2 == n


def _not_a_vit(keys: Sequence[str]) -> ConversionError:
    sample = sorted(keys)[:6]
    text = " ".join(keys)
    if "conv_root/" in text or "root_block/" in text or "/unit" in text:
        kind = "its arrays look like a ResNet (BiT) checkpoint"
    elif "MixerBlock" in text:
        kind = "its arrays look like an MLP-Mixer checkpoint"
    elif "data.pkl" in text:
        kind = "it looks like a PyTorch checkpoint (use --source timm for timm weights)"
    else:
        kind = "none of its arrays are a ViT's"
    return ConversionError(
        "This is not a ViT checkpoint: it has no patch embedding ('embedding/kernel') or no Transformer blocks "
        f"('Transformer/encoderblock_<i>/...'); {kind}. First arrays: {sample}"
    )


def canonical_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` under the `vit_jax` names of the module docstring: prefixes stripped, big_vision names mapped, and a
    zero class position added where the class token has none. Raises `ConversionError` for non-ViT checkpoints."""
    prefix = next((p for p in ("", "opt/target/", "params/") if f"{p}embedding/kernel" in arrays), None)
    if prefix is None:
        raise _not_a_vit(list(arrays))
    out: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        if key.startswith(prefix):
            out[key[len(prefix) :]] = value
        elif not key.startswith("opt/"):  # under a prefix, opt/ holds the optimizer state: not weights
            out[key] = value
    if "conv_root/kernel" in out:
        raise ConversionError(
            "This is a hybrid ResNet+ViT checkpoint (it has 'conv_root/kernel', a ResNet stem feeding the "
            "Transformer); hf-vit implements the plain ViT only."
        )
    if not any(_BLOCK_KEY.match(k) for k in out):
        if any(k.startswith("Transformer/encoderblock/") for k in out):
            raise ConversionError(
                "The Transformer blocks are stacked into one 'Transformer/encoderblock/...' set of arrays (big_vision "
                "with scan=True); this layout is not supported. Unstack them into 'Transformer/encoderblock_<i>/'."
            )
        raise _not_a_vit(list(arrays))
    big_vision = "pos_embedding" in out or any(
        (m := _BLOCK_KEY.match(k)) and m.group(2) == "MultiHeadDotProductAttention_0" for k in out
    )
    if big_vision:
        renamed = {}
        for key, value in out.items():
            match = _BLOCK_KEY.match(key)
            if match:
                index, module, rest = match.groups()
                key = f"Transformer/encoderblock_{index}/{_BIG_VISION_RENAMES.get(module, module)}/{rest}"
            renamed[key] = value
        out = renamed
    for old in ("pos_embedding", "Transformer/pos_embedding"):  # big_vision, and its pre-2022 place
        if old in out and POS_KEY not in out:
            out[POS_KEY] = out.pop(old)
    pos = out.get(POS_KEY)
    if "cls" in out and isinstance(pos, np.ndarray) and pos.ndim == 3:
        if _is_square(pos.shape[1]) and not _is_square(pos.shape[1] - 1):
            # The class token was added after the position embedding: give it a zero position (exact).
            out[POS_KEY] = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)
    return out


@dataclass(frozen=True)
class _Entry:
    """Some npz arrays and the hf-vit weight they make; `kind` says how."""

    npz_keys: tuple[str, ...]
    npz_shapes: tuple[tuple[int, ...], ...]
    hf_key: str
    kind: str  # copy | conv | dense | qkv_kernel | qkv_bias | out_kernel


def _entries(config: VisionTransformerConfig) -> list[_Entry]:
    """Every hf-vit weight of `config`'s classification model with its npz arrays and their expected shapes."""
    d, h, m = config.hidden_size, config.num_attention_heads, config.intermediate_size
    hd, p, c = d // h, config.patch_size, config.num_channels
    out = [
        _Entry(("embedding/kernel",), ((p, p, c, d),), "vit.embeddings.patch_embedding.weight", "conv"),
        _Entry(("embedding/bias",), ((d,),), "vit.embeddings.patch_embedding.bias", "copy"),
    ]
    if config.classifier == "token":
        out.append(_Entry(("cls",), ((1, 1, d),), "vit.embeddings.cls_token", "copy"))
    positions = config.num_prefix_tokens + config.num_patches
    out.append(_Entry((POS_KEY,), ((1, positions, d),), "vit.embeddings.position_embedding", "copy"))

    def ln(npz: str, hf: str) -> list[_Entry]:
        return [
            _Entry((f"{npz}/{n}",), ((d,),), f"{hf}.{w}", "copy") for n, w in (("scale", "weight"), ("bias", "bias"))
        ]

    def dense(npz: str, hf: str, n_in: int, n_out: int) -> list[_Entry]:
        return [
            _Entry((f"{npz}/kernel",), ((n_in, n_out),), f"{hf}.weight", "dense"),
            _Entry((f"{npz}/bias",), ((n_out,),), f"{hf}.bias", "copy"),
        ]

    for i in range(config.num_hidden_layers):
        npz, hf = _BLOCK.format(i=i), f"vit.layers.{i}."
        attn = f"{npz}{_ATTN}/"
        out += ln(f"{npz}LayerNorm_0", f"{hf}norm1")
        qkv = tuple(f"{attn}{n}" for n in ("query", "key", "value"))
        out.append(
            _Entry(tuple(f"{k}/kernel" for k in qkv), ((d, h, hd),) * 3, f"{hf}attention.qkv.weight", "qkv_kernel")
        )
        if config.qkv_bias:
            out.append(_Entry(tuple(f"{k}/bias" for k in qkv), ((h, hd),) * 3, f"{hf}attention.qkv.bias", "qkv_bias"))
        out.append(_Entry((f"{attn}out/kernel",), ((h, hd, d),), f"{hf}attention.proj.weight", "out_kernel"))
        out.append(_Entry((f"{attn}out/bias",), ((d,),), f"{hf}attention.proj.bias", "copy"))
        out += ln(f"{npz}LayerNorm_2", f"{hf}norm2")
        out += dense(f"{npz}{_MLP}/Dense_0", f"{hf}mlp.fc1", d, m)
        out += dense(f"{npz}{_MLP}/Dense_1", f"{hf}mlp.fc2", m, d)
    out += ln("Transformer/encoder_norm", "vit.norm")
    width = d
    if config.representation_size is not None:
        out += dense("pre_logits", "pre_logits", d, config.representation_size)
        width = config.representation_size
    if config.num_labels > 0:
        out += dense("head", "classifier", width, config.num_labels)
    return out


def _to_hf(kind: str, arrays: list[np.ndarray]) -> torch.Tensor:
    if kind == "copy":
        value = arrays[0]
    elif kind == "conv":  # HWIO -> OIHW
        value = arrays[0].transpose(3, 2, 0, 1)
    elif kind == "dense":  # (in, out) -> (out, in)
        value = arrays[0].T
    elif kind == "qkv_kernel":  # 3 x (D, heads, head_dim) -> rows [q; k; v] of (out, in)
        value = np.concatenate([a.reshape(a.shape[0], -1).T for a in arrays], axis=0)
    elif kind == "qkv_bias":  # 3 x (heads, head_dim) -> (3 D,)
        value = np.concatenate([a.reshape(-1) for a in arrays])
    elif kind == "out_kernel":  # (heads, head_dim, D) -> (out D, in heads * head_dim)
        value = arrays[0].reshape(-1, arrays[0].shape[-1]).T
    else:
        raise AssertionError(kind)
    return torch.from_numpy(np.ascontiguousarray(value))


def _to_npz(kind: str, tensor: torch.Tensor, shapes: tuple[tuple[int, ...], ...]) -> list[np.ndarray]:
    t = tensor.detach().cpu()
    value = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    if kind == "copy":
        parts = [value]
    elif kind == "conv":
        parts = [value.transpose(2, 3, 1, 0)]
    elif kind == "dense":
        parts = [value.T]
    elif kind == "qkv_kernel":
        parts = [chunk.T.reshape(shape) for chunk, shape in zip(np.split(value, 3, axis=0), shapes)]
    elif kind == "qkv_bias":
        parts = [chunk.reshape(shape) for chunk, shape in zip(np.split(value, 3), shapes)]
    elif kind == "out_kernel":
        parts = [value.T.reshape(shapes[0])]
    else:
        raise AssertionError(kind)
    return [np.ascontiguousarray(p) for p in parts]


def _hints(keys: Sequence[str]) -> str:
    found = [hint for pattern, hint in _FOREIGN_HINTS if any(pattern in k for k in keys)]
    return f" (these look like {'; '.join(found)})" if found else ""


def npz_to_hf_vit_state_dict(
    arrays: Mapping[str, np.ndarray], config: VisionTransformerConfig, resize_mode: str = "bilinear"
) -> dict[str, torch.Tensor]:
    """Map the arrays of an authors' `.npz` checkpoint to the state dict of a `VisionTransformerForImageClassification`
    built from `config`.

    Every array must find its place and every weight must be found, with the shape `config` implies; otherwise a
    `ConversionError` lists all the problems at once. When `config`'s patch grid differs from the checkpoint's (square)
    grid, the position embeddings are resampled in 2D (`resize_mode`, see the module docstring).
    """
    source = canonical_arrays(arrays)
    entries = _entries(config)
    expected = {k: s for e in entries for k, s in zip(e.npz_keys, e.npz_shapes)}
    problems = []
    extra = sorted(set(source) - set(expected))
    if extra:
        problems.append(f"arrays with no place in the model: {extra}{_hints(extra)}")
    missing = sorted(set(expected) - set(source))
    if missing:
        problems.append(f"arrays the model needs but the checkpoint lacks: {missing}")
    old_grid = None
    for key in sorted(set(expected) & set(source)):
        value = source[key]
        if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
            kind = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            problems.append(f"{key}: {kind} is not a floating point array")
            continue
        shape = tuple(value.shape)
        if key == POS_KEY and shape != expected[key]:
            prefix, dim = config.num_prefix_tokens, config.hidden_size
            if len(shape) == 3 and shape[0] == 1 and shape[2] == dim and _is_square(shape[1] - prefix):
                side = math.isqrt(shape[1] - prefix)
                old_grid = (side, side)  # another resolution: resampled below
                continue
        if shape != expected[key]:
            problems.append(f"{key}: shape {shape} does not fit the model's {expected[key]}")
    if problems:
        raise ConversionError("Cannot convert the checkpoint:\n- " + "\n- ".join(problems))
    out = {e.hf_key: _to_hf(e.kind, [source[k] for k in e.npz_keys]) for e in entries}
    if old_grid is not None:
        key = "vit.embeddings.position_embedding"
        out[key] = resample_position_embeddings(
            out[key], old_grid, config.grid_size, config.num_prefix_tokens, mode=resize_mode
        ).contiguous()
    return out


def hf_vit_to_npz_arrays(
    state_dict: Mapping[str, torch.Tensor], config: VisionTransformerConfig
) -> dict[str, np.ndarray]:
    """The inverse of `npz_to_hf_vit_state_dict` (at the checkpoint's own resolution): an hf-vit classification state
    dict as the arrays of a `vit_jax` `.npz` file (save them with `np.savez(path, **arrays)`)."""
    entries = _entries(config)
    extra = sorted(set(state_dict) - {e.hf_key for e in entries})
    missing = sorted({e.hf_key for e in entries} - set(state_dict))
    if extra or missing:
        raise ConversionError(
            f"The state dict does not fit the config: unexpected weights {extra}, missing weights {missing}."
        )
    out = {}
    for e in entries:
        out.update(zip(e.npz_keys, _to_npz(e.kind, state_dict[e.hf_key], e.npz_shapes)))
    return out


def infer_config_from_npz(
    arrays: Mapping[str, np.ndarray],
    preset: str | None = None,
    image_size: int | Sequence[int] | None = None,
    hidden_act: str = "gelu",
) -> VisionTransformerConfig:
    """The hf-vit config of an `.npz` checkpoint, read from its array shapes.

    Width, patch size and channels come from `embedding/kernel`, depth from the `encoderblock_<i>` count, heads from
    the query kernel's middle dimension, the MLP size from `Dense_0`, the classifier from the presence of `cls`
    ("token") or not ("gap"), the representation size from `pre_logits`, the number of labels from `head` (0 without
    one) and the image size from the position-embedding grid, unless `image_size` is given (the position embeddings
    are then resampled at load). The rest comes from `preset` when given (its sizes must match the arrays; its
    resolution is not used) or the paper's defaults (LayerNorm epsilon 1e-6, no dropout).
    """
    source = canonical_arrays(arrays)
    problems = []

    def shape_of(key: str, ndim: int) -> tuple[int, ...] | None:
        value = source.get(key)
        if value is None:
            problems.append(f"{key} is missing")
            return None
        if not isinstance(value, np.ndarray) or value.ndim != ndim:
            got = value.shape if isinstance(value, np.ndarray) else type(value).__name__
            problems.append(f"{key} should have {ndim} dimensions, got {got}")
            return None
        return tuple(value.shape)

    fields = {}
    kernel = shape_of("embedding/kernel", 4)
    if kernel is not None:
        if kernel[0] != kernel[1]:
            problems.append(f"embedding/kernel {kernel}: non-square {kernel[0]}x{kernel[1]} patches are not supported")
        fields.update(patch_size=kernel[0], num_channels=kernel[2], hidden_size=kernel[3])
    indices = sorted({int(m.group(1)) for k in source if (m := _BLOCK_KEY.match(k))})
    fields["num_hidden_layers"] = len(indices)
    if indices != list(range(len(indices))):
        gaps = sorted(set(range(indices[-1] + 1)) - set(indices))
        problems.append(f"the encoder blocks are not numbered 0..L-1: blocks {gaps} are missing")
    query = shape_of(f"{_BLOCK.format(i=0)}{_ATTN}/query/kernel", 3)
    if query is not None:
        fields["num_attention_heads"] = query[1]
    mlp = shape_of(f"{_BLOCK.format(i=0)}{_MLP}/Dense_0/kernel", 2)
    if mlp is not None:
        fields["intermediate_size"] = mlp[1]
    fields["qkv_bias"] = f"{_BLOCK.format(i=0)}{_ATTN}/query/bias" in source
    fields["classifier"] = "token" if "cls" in source else "gap"
    fields["representation_size"] = None
    if "pre_logits/kernel" in source:
        pre_logits = shape_of("pre_logits/kernel", 2)
        fields["representation_size"] = pre_logits[1] if pre_logits else None
    fields["num_labels"] = 0
    if "head/kernel" in source:
        head = shape_of("head/kernel", 2)
        fields["num_labels"] = head[1] if head else 0

    if image_size is None:
        pos = shape_of(POS_KEY, 3)
        if pos is not None and kernel is not None:
            patches = pos[1] - (1 if fields["classifier"] == "token" else 0)
            if _is_square(patches):
                fields["image_size"] = math.isqrt(patches) * kernel[0]
            else:
                problems.append(f"{POS_KEY} {pos}: {patches} patch positions are not a square grid; pass image_size")
    else:
        fields["image_size"] = image_size_field(image_size)

    base = dict(PAPER_DEFAULTS, hidden_act=hidden_act)
    if preset is not None:
        preset_config = load_preset(preset)
        problems += preset_mismatches(fields, preset_config, preset)
        base.update({k: v for k, v in preset_config.to_dict().items() if k in ("layer_norm_eps", "initializer_range")})
    return build_config(base, fields, problems, "checkpoint")


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read every array of an `.npz` file without unpickling anything (`allow_pickle=False`)."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path} is not a file; pass the path of an .npz checkpoint.")
    with path.open("rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x93NUMPY"):
        raise ConversionError(f"{path} is a single .npy array, not an .npz archive of named arrays.")
    if not magic.startswith(b"PK"):
        what = "a pickle file" if magic[:1] == b"\x80" else "not an .npz (zip) archive"
        raise ConversionError(
            f"{path} is {what}. Only .npz archives of plain numeric arrays are read; pickled content would need "
            "allow_pickle=True, which can run arbitrary code, so it is refused."
        )
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as error:
        raise ConversionError(f"Could not read {path} as an .npz archive: {error}") from error
    arrays, pickled = {}, []
    with archive:
        for name in archive.files:
            try:
                arrays[name] = archive[name]
            except ValueError:  # an object array: np.load refuses it without allow_pickle
                pickled.append(name)
    if pickled:
        raise ConversionError(
            f"{path} contains pickled object arrays {pickled}: reading them needs allow_pickle=True, which can run "
            "arbitrary code, so they are refused. A ViT checkpoint holds only numeric arrays; re-save it without "
            "Python objects."
        )
    return arrays


def convert_jax_checkpoint(
    input_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    preset: str | None = None,
    image_size: int | Sequence[int] | None = None,
    overwrite: bool = False,
    labels: Sequence[str] | None = None,
    hidden_act: str = "gelu",
    resize_mode: str = "bilinear",
    base_model: str | None = None,
):
    """Convert an authors' `.npz` checkpoint into a complete hf-vit folder: `VisionTransformerForImageClassification`
    weights (safetensors), config, code, and an image processor resizing to the model's size and normalising with
    mean = std = 0.5 (the authors' [-1, 1] inputs).

    `labels` names the classes in order (default "LABEL_<i>"). The folder's model card names `base_model` (default:
    the file's name) as its origin. Returns the converted model; nothing is written unless everything succeeded.
    """
    from ..image_processing_vit import VisionTransformerImageProcessor

    check_output_dir(output_dir, overwrite, [input_path])  # before any loading
    arrays = load_npz(input_path)
    config = infer_config_from_npz(arrays, preset=preset, image_size=image_size, hidden_act=hidden_act)
    if labels is not None:
        labels = list(labels)
        if len(labels) != config.num_labels:
            raise ConversionError(f"{len(labels)} labels given for a head of {config.num_labels} classes.")
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
    state_dict = npz_to_hf_vit_state_dict(arrays, config, resize_mode=resize_mode)
    height, width = config.image_hw
    half = [0.5] * config.num_channels
    processor = VisionTransformerImageProcessor(
        size={"height": height, "width": width}, image_mean=half, image_std=half
    )
    return save_converted_model(
        config, state_dict, processor, output_dir, overwrite,
        source=input_path, source_format="the authors' JAX .npz layout", base_model=base_model,
    )  # fmt: skip
