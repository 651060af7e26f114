"""The authors' JAX/Flax `.npz` checkpoints (google-research/vision_transformer, AugReg, big_vision) <-> hf-vit.

The files hold one flat array per Flax parameter, named by its path in the parameter tree (`JAX_LAYOUT` lists them;
kernels are HWIO or (in, out), attention's split by head); hybrids add their ResNet stem (`conv_root`, `gn_root`,
`block{s}/unit{u}/...`). Also accepted: an `opt/target/` prefix (the optimizer state under `opt/` is skipped), and
big_vision's names (`params/`, `MultiHeadDotProductAttention_0`, `MAPHead_0`, ...), read by `big_vision_npz.py`.
The transforms only permute, reshape and concatenate, so a round trip is bitwise exact.

* GELU: Flax's `gelu` is the tanh approximation, so a converted `.npz` uses `hidden_act="gelu_pytorch_tanh"`;
  transformers' and timm's ports use the exact erf form (at most 5e-4 apart): pass `hidden_act="gelu"` for that.
* Resolution: at another `image_size` the position embeddings are resampled with `mode="bilinear"`
  (`align_corners=False`, as timm does), the closest to the authors' `scipy.ndimage.zoom(order=1)`.
"""

from __future__ import annotations

import os
import re
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..model.configuration_vit import VisionTransformerConfig, resnet_stride
from .common import (
    ConversionError,
    Layout,
    build_config,
    check_state_dict,
    convert_checkpoint,
    load_preset,
    preset_mismatches,
    resample_positions,
    set_label_names,
    square_side,
)
from .flax_layout import (
    BLOCK_KEY,
    CONV,
    DENSE,
    SCAN_ERROR,
    _tensor,
    array_shape,
    attention_rows,
    mlp_rows,
    norm_rows,
    read_image_size,
    read_sizes,
)

POS_KEY = "Transformer/posembed_input/pos_embedding"
POS_KEYS = {False: POS_KEY, True: "pos_embedding"}  # the position table of vit_jax, of big_vision (top level)


_B, _H = "Transformer/encoderblock_{i}/", "vit.layers.{i}."
_ATTN, _MLP = _B + "MultiHeadDotProductAttention_1/", _B + "MlpBlock_3/"
_STEM = "vit.embeddings.stem."
_UNIT, _HF_UNIT = "block{s}/unit{u}/", _STEM + "block{s}.unit{u}."
_UNIT_KEY = re.compile(r"^block(\d+)/unit(\d+)/")


JAX_LAYOUT = Layout(
    "JAX .npz checkpoint",
    [
        ("embedding/kernel", "vit.embeddings.patch_embedding.weight", CONV),
        ("embedding/bias", "vit.embeddings.patch_embedding.bias"),
        ("cls", "vit.embeddings.cls_token"),
        (POS_KEY, "vit.embeddings.position_embedding"),
        *norm_rows(_B + "LayerNorm_0/", _H + "norm1."),
        *attention_rows(_ATTN, _H + "attention.qkv.", _H + "attention.proj."),
        *norm_rows(_B + "LayerNorm_2/", _H + "norm2."),
        *mlp_rows(_MLP, _H + "mlp."),
        *norm_rows("Transformer/encoder_norm/", "vit.norm."),
        ("pre_logits/kernel", "pre_logits.weight", DENSE),
        ("pre_logits/bias", "pre_logits.bias"),
        ("head/kernel", "classifier.weight", DENSE),
        ("head/bias", "classifier.bias"),
        # The hybrids' ResNet stem; stage and unit numbers are the authors' (from 1) on both sides.
        ("conv_root/kernel", _STEM + "conv_root.weight", CONV),
        *norm_rows("gn_root/", _STEM + "gn_root."),
        (_UNIT + "conv{c}/kernel", _HF_UNIT + "conv{c}.weight", CONV),
        *norm_rows(_UNIT + "gn{c}/", _HF_UNIT + "gn{c}."),
        (_UNIT + "conv_proj/kernel", _HF_UNIT + "conv_proj.weight", CONV),
        *norm_rows(_UNIT + "gn_proj/", _HF_UNIT + "gn_proj."),
    ],
)

# The paper's defaults for what the arrays do not say.
PAPER_DEFAULTS = {"layer_norm_eps": 1e-6, "hidden_act": "gelu", "hidden_dropout_prob": 0.0}


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


def canonical_arrays(arrays: Mapping[str, np.ndarray], big_vision: bool = False) -> dict[str, np.ndarray]:
    """`arrays` without a prefix, the position table at `POS_KEYS[big_vision]` (big_vision's other names kept for
    `BIG_VISION_LAYOUT`), a zero class position added where needed; non-ViTs and stacked blocks refused."""
    prefix = next((p for p in ("", "opt/target/", "params/") if f"{p}embedding/kernel" in arrays), None)
    if prefix is None:
        raise _not_a_vit(list(arrays))
    out: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        if key.startswith(prefix):
            out[key[len(prefix) :]] = value
        elif not key.startswith("opt/"):  # under a prefix, opt/ holds the optimizer state: not weights
            out[key] = value
    if any(k.startswith("Transformer/encoderblock/") for k in out):
        raise ConversionError(SCAN_ERROR)
    if not any(BLOCK_KEY.match(k) for k in out):
        raise _not_a_vit(list(arrays))
    pos_key = POS_KEYS[big_vision]
    for old in ("pos_embedding", "Transformer/pos_embedding"):  # big_vision, and its pre-2022 place
        if old in out and pos_key not in out:
            out[pos_key] = out.pop(old)
    if big_vision and pos_key not in out:
        raise ConversionError(
            "The checkpoint has no 'pos_embedding': big_vision's fixed sin-cos position embeddings "
            "(posemb='sincos2d'), which hf-vit does not have (it learns its position table)."
        )
    pos = out.get(pos_key)
    if "cls" in out and isinstance(pos, np.ndarray) and pos.ndim == 3:
        # big_vision adds the class token after the positions (a grid of any shape); vit_jax's table without a class
        # position is told by its square grid. The class token then gets a zero position (exact).
        if big_vision or (square_side(pos.shape[1]) and not square_side(pos.shape[1] - 1)):
            out[pos_key] = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)
    return out


def npz_to_hf_vit_state_dict(
    arrays: Mapping[str, np.ndarray], config: VisionTransformerConfig, resize_mode: str = "bilinear"
) -> dict[str, torch.Tensor]:
    """The arrays of an authors' (or big_vision's) `.npz` checkpoint as the state dict of `config`'s classification
    model (every array placed, every weight found with its shape, else one `ConversionError`); the position grid
    resampled to `config`'s with `resize_mode`."""
    from .big_vision_npz import BIG_VISION_LAYOUT, is_big_vision

    big_vision = is_big_vision(arrays)  # a MAP head is big_vision's own
    source = canonical_arrays(arrays, big_vision)
    layer_scale = not big_vision and any("LayerScale" in key for key in source)
    problems = ["some arrays look like LayerScale, which hf-vit does not have"] if layer_scale else []
    source = {key: _tensor(value) for key, value in source.items()}
    mode = resize_mode or config.interpolation_mode
    source = resample_positions(source, POS_KEYS[big_vision], config, mode, config.interpolation_antialias)
    layout = BIG_VISION_LAYOUT if big_vision else JAX_LAYOUT
    return layout.to_hf(source, config, problems)


def hf_vit_to_npz_arrays(
    state_dict: Mapping[str, torch.Tensor], config: VisionTransformerConfig
) -> dict[str, np.ndarray]:
    """The inverse of `npz_to_hf_vit_state_dict`: the arrays of a `vit_jax` `.npz` file."""
    check_state_dict(state_dict, config)
    arrays = JAX_LAYOUT.from_hf({k: v.detach().cpu() for k, v in state_dict.items()}, config)
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in arrays.items()}


def _hybrid_fields(source: Mapping[str, np.ndarray], kernel: tuple[int, ...] | None, problems: list[str]) -> dict:
    """A hybrid's stem sizes: stage depths, channels, width, and the patch size in input pixels."""
    root = array_shape(source, "conv_root/kernel", 4, problems)
    units: dict[int, set[int]] = {}
    for key in source:
        if match := _UNIT_KEY.match(key):
            units.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
    stages = sorted(units)
    if stages != list(range(1, len(stages) + 1)):
        problems.append(f"the ResNet stages are not numbered block1..block<n>: found {stages}")
    layers = []
    for stage in stages:
        numbers = sorted(units[stage])
        if numbers != list(range(1, len(numbers) + 1)):
            problems.append(f"the units of block{stage} are not numbered unit1..unit<n>: found {numbers}")
        layers.append(len(numbers))
    fields = {"resnet_layers": layers}
    if root is not None:
        fields.update(num_channels=root[2], resnet_width=root[3])
    if kernel is not None:
        fields["patch_size"] = kernel[0] * resnet_stride(layers)
    return fields


def infer_config_from_npz(
    arrays: Mapping[str, np.ndarray],
    preset: str | None = None,
    image_size: int | Sequence[int] | None = None,
    hidden_act: str = "gelu_pytorch_tanh",
) -> VisionTransformerConfig:
    """The hf-vit config of an `.npz` checkpoint, read from its array shapes (`flax_layout.read_sizes`; a hybrid's
    stem from `conv_root` and the `block{s}/unit{u}` names), the classifier "token" with `cls`, "map" with big_vision's
    `MAPHead_0`, else "gap", the image size from the position grid unless `image_size` is given. The rest comes from
    `preset` (its sizes must match the arrays; its resolution is not used) or the paper's (big_vision's) defaults."""
    from .big_vision_npz import BIG_VISION_DEFAULTS, is_big_vision

    problems: list[str] = []
    big_vision = is_big_vision(arrays)
    source = canonical_arrays(arrays, big_vision)
    if big_vision:
        block = "Transformer/encoderblock_0/"
        fields = read_sizes(source, block + "MultiHeadDotProductAttention_0/", block + "MlpBlock_0/", problems)
        pooled = "MAPHead_0/probe" in source
        fields["classifier"] = "token" if "cls" in source else "map" if pooled else "gap"
        if "cls" in source and pooled:
            problems.append("the checkpoint has both a class token (cls) and attention pooling (MAPHead_0)")
        base, what = dict(BIG_VISION_DEFAULTS, **({"hidden_act": hidden_act} if hidden_act else {})), "big_vision "
    else:
        hybrid = (lambda kernel: _hybrid_fields(source, kernel, problems)) if "conv_root/kernel" in source else None
        fields = read_sizes(source, _ATTN.format(i=0), _MLP.format(i=0), problems, hybrid)
        fields["classifier"] = "token" if "cls" in source else "gap"
        base, what = dict(PAPER_DEFAULTS, hidden_act=hidden_act), ""
    read_image_size(source, POS_KEYS[big_vision], fields, image_size, problems)
    if preset is not None:
        preset_config = load_preset(preset)
        problems += preset_mismatches(fields, preset_config, preset)
        if not what:  # the authors' files take the preset's norm epsilon and initialiser range
            base.update(
                {k: v for k, v in preset_config.to_dict().items() if k in ("layer_norm_eps", "initializer_range")}
            )
    return build_config(base, fields, problems, what + "checkpoint")


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
    # A cut file (a download or copy that stopped) has no zip directory, or members that end early.
    damaged = (OSError, EOFError, zipfile.BadZipFile, zlib.error)
    cut = "it is truncated or corrupted (a download or copy that stopped?); fetch the file again"
    try:
        archive = np.load(path, allow_pickle=False)
    except damaged as error:
        raise ConversionError(f"Could not read {path} as an .npz archive: {cut} ({error}).") from error
    except ValueError as error:
        raise ConversionError(f"Could not read {path} as an .npz archive: {error}") from error
    arrays, pickled = {}, []
    with archive:
        for name in archive.files:
            try:
                arrays[name] = archive[name]
            except (*damaged, ValueError) as error:  # a ValueError naming allow_pickle: an object array
                if "allow_pickle" not in str(error):
                    raise ConversionError(f"Could not read the array {name!r} of {path}: {cut} ({error}).") from error
                pickled.append(name)
    if pickled:
        raise ConversionError(
            f"{path} contains pickled object arrays {pickled}: reading them needs allow_pickle=True, which can run "
            "arbitrary code, so they are refused. A ViT checkpoint holds only numeric arrays; re-save it without "
            "Python objects."
        )
    return arrays


def read_jax_checkpoint(
    input_path: str | os.PathLike,
    preset: str | None = None,
    image_size: int | Sequence[int] | None = None,
    labels: Sequence[str] | None = None,
    hidden_act: str = "gelu_pytorch_tanh",
    resize_mode: str = "bilinear",
):
    """`(config, state_dict, processor)` of an authors' `.npz` checkpoint (mean = std = 0.5, bilinear: the processor
    timm gives a checkpoint without settings)."""
    from .timm_vit import timm_processor

    arrays = load_npz(input_path)
    config = infer_config_from_npz(arrays, preset=preset, image_size=image_size, hidden_act=hidden_act)
    if labels is not None:
        labels = list(labels)
        if len(labels) != config.num_labels:
            raise ConversionError(f"{len(labels)} labels given for a head of {config.num_labels} classes.")
        set_label_names(config, labels)
    state_dict = npz_to_hf_vit_state_dict(arrays, config, resize_mode=resize_mode)
    return config, state_dict, timm_processor(config, None)


def convert_jax_checkpoint(
    input_path: str | os.PathLike, output_dir: str | os.PathLike, overwrite: bool = False, base_model=None, **options
):
    """Convert an authors' `.npz` checkpoint into a complete hf-vit folder; `options` are `read_jax_checkpoint`'s
    (`labels` names the classes in order). The card names `base_model` (default: the file's name). Returns the model;
    nothing is written unless everything succeeded."""
    what = "the authors' JAX .npz layout"
    return convert_checkpoint(read_jax_checkpoint, input_path, output_dir, overwrite, what, base_model, options)
