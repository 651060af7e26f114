"""What every converter shares: a rename table per foreign layout (`Layout(name, table)`) read in both directions,
one check of a state dict against the model built on the meta device, one error listing every problem, and config
helpers.

A row is `(source, target)` or `(source, target, transform)`: `source` a foreign key pattern (or a tuple, for arrays
fused into one hf-vit weight), `target` the hf-vit one; `{p}` is "weight" or "bias", any other `{name}` an index."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..model.configuration_vit import VisionTransformerConfig
from ..model.resolution import image_size_field as config_image_size
from ..model.resolution import resample_position_embeddings
from ..outputs.cards import write_card
from ..outputs.output_folders import check_output_dir, write_converted_folder

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message lists what is wrong."""


def read_safetensors(files: list[Path], header_only: bool = True) -> dict[str, torch.Tensor]:
    """The arrays of safetensors `files`; with `header_only`, as meta tensors read from the headers only."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    out = {}
    for path in files:
        try:
            if not header_only:
                out.update(load_file(path))
                continue
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():
                    part = handle.get_slice(key)
                    dtype = SAFETENSORS_DTYPES.get(part.get_dtype(), torch.uint8)
                    out[key] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
        except SafetensorError as error:
            raise ConversionError(f"{path} is truncated or corrupted ({error}); download or save it again.") from error
    return out


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or a `ConversionError` naming the file and what is wrong with it."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path} is not readable JSON: {error}. Fix or replace the file.") from error
    if not isinstance(value, dict):
        raise ConversionError(f"{path} holds a JSON {type(value).__name__}, not an object; fix or replace the file.")
    return value


def raise_problems(what: str, problems: Sequence[str]) -> None:
    """The one problem report: raise a `ConversionError` listing `problems` (one line each), if there are any."""
    if problems:
        raise ConversionError(f"Cannot convert the {what}:\n- " + "\n- ".join(problems))


def _listing(leftovers: Iterable[str] = (), missing: Iterable[str] = (), extra: Iterable[str] = ()) -> list[str]:
    lines = []
    for label, keys in (
        ("arrays with no place in hf-vit", leftovers),
        ("arrays the model needs but the checkpoint lacks", missing),
        ("arrays the model (as configured) has no place for", extra),
    ):
        if keys := sorted(keys):
            lines.append(f"{label}: {keys}")
    return lines


@dataclass(frozen=True)
class Transform:
    """How one row's source arrays become the hf-vit tensor (`to_hf`) and back (`from_hf(tensor, config)`)."""

    to_hf: Callable[..., torch.Tensor]
    from_hf: Callable[[torch.Tensor, Any], tuple[torch.Tensor, ...]]
    # `to_hf` concatenates its arrays along the first dimension: a lazy load reads them straight into the result.
    concatenates: bool = False


RENAME = Transform(lambda x: x, lambda x, config: (x,))
# Separate query, key and value projections <-> hf-vit's fused `qkv`, rows [q; k; v]. The parts are cloned so that
# they do not share storage (safetensors refuses shared tensors).
FUSED_QKV = Transform(
    lambda q, k, v: torch.cat([q, k, v]), lambda qkv, config: tuple(part.clone() for part in qkv.chunk(3)), True
)
# A 1x1 convolution's kernel `(out, in, 1, 1)` <-> the linear map's weight `(out, in)` it applies at every position.
POINTWISE_CONV = Transform(lambda kernel: kernel.flatten(1), lambda weight, config: (weight[:, :, None, None],))
# `{p}` is a parameter's name; any other placeholder an index (a block, or a stage and unit of a ResNet stem).
_PLACEHOLDERS = {"p": "weight|bias"}


def _compile(pattern: str) -> re.Pattern:
    pieces = re.split(r"\{(\w+)\}", pattern)  # literal, placeholder, literal, ...
    return re.compile(
        "".join(
            f"(?P<{piece}>{_PLACEHOLDERS.get(piece, '[0-9]+')})" if n % 2 else re.escape(piece)
            for n, piece in enumerate(pieces)
        )
    )


@dataclass(frozen=True)
class _Row:
    sources: tuple[str, ...]
    target: str
    transform: Transform
    source_patterns: tuple[re.Pattern, ...]
    target_pattern: re.Pattern


class Layout:
    """A foreign checkpoint layout as one rename table (see the module docstring), read in both directions."""

    def __init__(self, name: str, table: Sequence[tuple]):
        self.name = name
        self.rows = []
        for source, target, *transform in table:
            sources = (source,) if isinstance(source, str) else tuple(source)
            patterns = tuple(_compile(s) for s in sources)
            self.rows.append(_Row(sources, target, transform[0] if transform else RENAME, patterns, _compile(target)))
        for side in ([s for row in self.rows for s in row.sources], [row.target for row in self.rows]):
            if twice := sorted({pattern for pattern in side if side.count(pattern) > 1}):
                raise ValueError(f"{name}: key patterns {twice} appear twice in the table; its inverse is ambiguous.")

    def _find(self, key: str) -> tuple[int, int, dict[str, str]] | None:
        """(row, part, placeholder values) of a source key, or None when no row places it."""
        for index, row in enumerate(self.rows):
            for part, pattern in enumerate(row.source_patterns):
                if match := pattern.fullmatch(key):
                    return index, part, match.groupdict()
        return None

    def to_hf(
        self,
        source: Mapping[str, torch.Tensor],
        config: VisionTransformerConfig | None = None,
        problems: Sequence[str] = (),
    ) -> dict[str, torch.Tensor]:
        """`source` under hf-vit's names. With `config`, checked first (`check_state_dict`); without it, only
        unplaced arrays and incomplete fused groups are reported, with the format's own `problems`, in one
        `ConversionError`."""
        if config is not None:
            check_state_dict(source, config, self, problems)
        groups: dict[tuple[int, tuple], dict[int, torch.Tensor]] = {}
        leftovers = []
        for key, value in source.items():
            found = self._find(key)
            if found is None:
                leftovers.append(key)
                continue
            index, part, values = found
            groups.setdefault((index, tuple(sorted(values.items()))), {})[part] = value
        out, missing = {}, []
        for (index, values), parts in groups.items():
            row, values = self.rows[index], dict(values)
            if len(parts) < len(row.sources):
                missing += [s.format(**values) for n, s in enumerate(row.sources) if n not in parts]
            else:
                arrays = [parts[n] for n in range(len(row.sources))]
                out[row.target.format(**values)] = row.transform.to_hf(*arrays).contiguous()
        raise_problems(self.name, [*problems, *_listing(leftovers, missing)])
        return out

    def to_hf_lazy(
        self,
        source: Mapping[str, Any],
        shapes: Mapping[str, torch.Tensor],
        config: VisionTransformerConfig,
        problems: Sequence[str] = (),
    ) -> LazyStateDict:
        """`to_hf` computed tensor by tensor as transformers' loading reads it (`source`: safetensors slices or
        tensors, `shapes`: them as meta tensors). What needs no model is checked now; the check against `config`'s
        model is the result's `verify()`, run when loading reports a problem (measured: docs/benchmarks.md)."""
        # `config` copied: the caller may change it before it loads (a new head, labels)
        verify = functools.partial(self.to_hf, shapes, copy.deepcopy(config), problems)
        plan: dict[str, tuple[Transform, list]] = {}
        unusual = bool(problems)
        for key, shape in shapes.items():
            found = self._find(key)
            if found is None or not shape.is_floating_point():
                unusual = True
                continue
            index, part, values = found
            row = self.rows[index]
            plan.setdefault(row.target.format(**values), (row.transform, [None] * len(row.sources)))[1][part] = key
        for _, keys in plan.values():
            # Parts missing, or fused parts (query, key, value) of different shapes whose sum may still fit the fused
            # weight: transformers' loading sees only the fused weight, so the check must run here.
            unusual |= None in keys or len({tuple(shapes[key].shape) for key in keys if key is not None}) > 1
        if unusual:
            verify()
            raise_problems(self.name, [*problems, "arrays no row places, that are not floating point or do not fit"])
        lazy = {
            target: LazyTensor(transform, [source[key] for key in keys]) for target, (transform, keys) in plan.items()
        }
        return LazyStateDict(lazy, verify)

    def from_hf(
        self, state_dict: Mapping[str, torch.Tensor], config: VisionTransformerConfig | None = None
    ) -> dict[str, torch.Tensor]:
        """hf-vit weights under this layout's names (the inverse of `to_hf`); works on meta tensors too."""
        out, unplaced = {}, []
        for key, value in state_dict.items():
            found = next(((row, m) for row in self.rows if (m := row.target_pattern.fullmatch(key))), None)
            if found is None:
                unplaced.append(key)
                continue
            row, match = found
            parts = row.transform.from_hf(value, config)
            out.update((s.format(**match.groupdict()), p.contiguous()) for s, p in zip(row.sources, parts))
        if unplaced:
            raise ConversionError(f"The {self.name} layout has no place for the hf-vit weights {sorted(unplaced)}.")
        return out


class LazyStateDict(dict):
    """The weights of `Layout.to_hf_lazy`, with `verify()`: the check against the config's model."""

    def __init__(self, weights: Mapping[str, Any], verify: Callable[[], None]) -> None:
        super().__init__(weights)
        self.verify = verify


class LazyTensor:
    """A weight computed from its row's source arrays when transformers' loading reads it (`value[...]`)."""

    def __init__(self, transform: Transform, parts: Sequence[Any]) -> None:
        self.transform, self.parts = transform, parts

    @property
    def dtype(self) -> torch.dtype:
        """The weight's dtype, known without reading it (transformers' `dtype="auto"` asks): its parts', promoted."""
        return functools.reduce(torch.promote_types, (part.dtype for part in self.parts))

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __getitem__(self, index: Any) -> torch.Tensor:
        dtype = self.dtype
        if self.transform.concatenates and all(hasattr(part, "read_into") for part in self.parts):
            # One buffer for the fused weight, each part read into its rows: no copies of the parts on the way (a
            # part of another dtype than the others is read, then cast).
            shapes = [part.shape for part in self.parts]
            out = torch.empty((sum(shape[0] for shape in shapes), *shapes[0][1:]), dtype=dtype)
            start = 0
            for part, shape in zip(self.parts, shapes):
                rows = out[start : start + shape[0]]
                if part.dtype == dtype:
                    part.read_into(rows)
                else:
                    rows.copy_(part.read())
                start += shape[0]
            return out[index]
        fused = len(self.parts) > 1  # read the parts of a fused weight into memory, not mapped from their file
        arrays = [
            part if isinstance(part, torch.Tensor) else part.read() if fused and hasattr(part, "read") else part[...]
            for part in self.parts
        ]
        return self.transform.to_hf(*(array.to(dtype) for array in arrays)).contiguous()[index]


def check_state_dict(
    state_dict: Mapping[str, Any],
    config: VisionTransformerConfig,
    layout: Layout | None = None,
    problems: Sequence[str] = (),
) -> None:
    """Raise one `ConversionError` unless `state_dict` (in `layout`'s names, hf-vit's without one) holds exactly the
    floating-point arrays, with their shapes, of `config`'s model built on the meta device; the format's own
    `problems` come first."""
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights():  # shapes only: nothing allocated, no initialiser run
        expected = converted_model_class(state_dict, layout)(config).state_dict()
    if layout is not None:
        expected = layout.from_hf(expected, config)
    placed = {key for key in state_dict if layout is None or layout._find(key) is not None}
    lines = [*problems, *_listing(set(state_dict) - placed, set(expected) - set(state_dict), placed - set(expected))]
    for key in sorted(placed & set(expected)):
        value, shape = state_dict[key], tuple(expected[key].shape)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            lines.append(f"{key}: {getattr(value, 'dtype', type(value).__name__)} is not a floating point array")
        elif tuple(value.shape) != shape:
            lines.append(f"{key}: shape {tuple(value.shape)} does not fit the model's {shape}")
    raise_problems(layout.name if layout is not None else "state dict", lines)


def converted_model_class(state_dict: Mapping[str, Any], layout: Layout | None = None) -> type:
    """SimMIM's class for a state dict (in `layout`'s names) holding its decoder, else the classification model."""
    from ..model.modeling_mim import VisionTransformerForMaskedImageModeling
    from ..model.modeling_vit import VisionTransformerForImageClassification

    probe = {"decoder.weight": torch.empty(1, 1, device="meta")}
    try:
        names = set(layout.from_hf(probe) if layout is not None else probe)
    except ConversionError:  # a layout without SimMIM's decoder
        names = set()
    simmim = bool(names & set(state_dict))
    return VisionTransformerForMaskedImageModeling if simmim else VisionTransformerForImageClassification


def resample_positions(
    source: Mapping[str, torch.Tensor], key: str, config: VisionTransformerConfig, mode: str, antialias, grid=None
) -> dict[str, torch.Tensor]:
    """`source` with its positions `source[key]` resampled to `config`'s grid from `grid` (default: a square one)."""
    out = dict(source)
    pos, prefix = out.get(key), config.num_position_prefix_tokens
    if isinstance(pos, torch.Tensor) and pos.ndim == 3 and pos.shape[0] == 1 and pos.shape[2] == config.hidden_size:
        side = square_side(pos.shape[1] - prefix)
        if grid is None and side and pos.shape[1] != prefix + config.num_patches:
            grid = (side, side)
        if grid is not None and tuple(grid) != config.grid_size:
            out[key] = resample_position_embeddings(pos, grid, config.grid_size, prefix, mode, antialias).contiguous()
    return out


def square_side(n: int) -> int | None:
    """The side of a square grid of `n` positions, or None when `n` is not a positive square."""
    side = math.isqrt(n) if n > 0 else 0
    return side if side and side * side == n else None


def grid_mismatch(found: int, config: VisionTransformerConfig) -> list[str]:
    """The problem of a position table of `found` patch positions that is not `config`'s grid (none when it is)."""
    if found == config.num_patches:
        return []
    side, (rows, cols) = square_side(found), config.grid_size
    hint = f": pass image_size={side * config.patch_size} for their own grid, or a size to resample to" if side else ""
    return [
        f"the position embeddings hold {found} positions, but config.json's image_size {config.image_size} "
        f"with patch_size {config.patch_size} makes a {rows}x{cols} grid{hint}"
    ]


def count_blocks(keys: Iterable[str], pattern: re.Pattern, problems: list[str]) -> int:
    """The number of blocks among `keys` (`pattern`'s first group is the index); gaps go to `problems`."""
    indices = sorted({int(m.group(1)) for key in keys if (m := pattern.match(key))})
    gaps = sorted(set(range(indices[-1] + 1)) - set(indices)) if indices else []
    if gaps:
        problems.append(f"the encoder blocks are not numbered 0..L-1: blocks {gaps} are missing")
    return len(indices)


def set_label_names(config: VisionTransformerConfig, labels: Any) -> None:
    """Name `config`'s classes after `labels` when it is a list of one name per class (of at least one)."""
    if isinstance(labels, list) and len(labels) == config.num_labels and config.num_labels > 0:
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}


def _conversion_errors(function: Callable) -> Callable:
    """`function` with its `ValueError`s raised as `ConversionError`s."""

    @functools.wraps(function)
    def call(*args: Any) -> Any:
        try:
            return function(*args)
        except ValueError as error:
            raise ConversionError(str(error)) from error

    return call


load_preset = _conversion_errors(VisionTransformerConfig.from_preset)
image_size_field = _conversion_errors(config_image_size)


def preset_mismatches(fields: Mapping[str, object], preset_config: VisionTransformerConfig, preset: str) -> list[str]:
    """The architecture fields read from a checkpoint that differ from the named preset's."""
    return [
        f"{name}: the checkpoint has {fields[name]}, preset {preset!r} has {getattr(preset_config, name)}"
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size")
        if name in fields and fields[name] != getattr(preset_config, name)
    ]


def build_config(
    base: Mapping[str, object], fields: Mapping[str, object], problems: Sequence[str], source: str
) -> VisionTransformerConfig:
    """The config inferred from the `source` checkpoint, or a `ConversionError` listing every problem found."""
    if problems:
        raise ConversionError(f"Cannot infer the model from the {source}:\n- " + "\n- ".join(problems))
    try:
        config = VisionTransformerConfig(**base, **fields)
    except ValueError as error:
        raise ConversionError(f"The checkpoint's shapes do not make a valid model: {error}") from error
    return config


def convert_checkpoint(
    read: Callable[..., tuple], source: str | os.PathLike, output_dir, overwrite: bool, what: str, base_model, options
):
    """Check `options` and `output_dir` before any loading, then build the model of `read(source, **options)`'s
    `(config, state_dict, processor)` (SimMIM's with a decoder), load the weights strictly and write it with the
    processor and a card there only if all of that succeeded; returns the model in eval mode. The card's base model
    is `base_model`, else `source`'s name."""
    inspect.signature(read).bind(source, **options)  # a misspelt option is a TypeError before any work
    target = check_output_dir(output_dir, overwrite, [source])
    config, state_dict, processor = read(source, **options)
    check_state_dict(state_dict, config)
    model = converted_model_class(state_dict)(config)
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    base_model = base_model or Path(source).expanduser().resolve().name

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        write_card(
            folder,
            model,
            base_model=base_model,
            output_name=target.name,
            summary=f"`{base_model}` converted from {what} to hf-vit; the weights are unchanged.",
            recipe=f"not trained by hf-vit: the weights are those of `{base_model}`, renamed to hf-vit's layout.",
        )

    write_converted_folder(save, target, overwrite=overwrite, inputs=[source])
    return model
