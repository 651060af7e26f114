"""Deployment: `torch.export` and ONNX graphs of an hf-vit model taking `pixel_values` of any batch and any
patch-divisible size (positions resampled in the graph), giving `logits` or `last_hidden_state` and `pooler_output`.
With `native=True` they take the processor's native-aspect batches instead (`pixel_values` (batch, patches, P*P*C),
`pixel_attention_mask`, `spatial_shapes`), each grid read from `spatial_shapes` as data."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .infer.loading import check_native_model, check_serving_sizes
from .model.image_processing_vit import grid_for_max_patches
from .model.modeling_vit import VisionTransformerForImageClassification, VisionTransformerPreTrainedModel
from .model.resolution import MAX_PATCH_POSITIONS
from .outputs.files import check_not_a_link
from .outputs.output_folders import overlap

FORMATS = ("onnx", "torch_export")
EXTENSIONS = {"onnx": ".onnx", "torch_export": ".pt2"}  # the one extension a file of each format is written with
NATIVE_INPUTS = ["pixel_values", "pixel_attention_mask", "spatial_shapes"]


class _GraphModel(nn.Module):
    """The model as a function of `pixel_values` at any size, or of a native-aspect batch, returning plain tensors."""

    def __init__(self, model: VisionTransformerPreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.is_classifier = isinstance(model, VisionTransformerForImageClassification)

    def forward(self, pixel_values, pixel_attention_mask=None, spatial_shapes=None):
        native = {"pixel_attention_mask": pixel_attention_mask, "spatial_shapes": spatial_shapes}
        options = native if spatial_shapes is not None else {"interpolate_pos_encoding": True}
        outputs = self.model(pixel_values, return_dict=True, **options)
        return outputs.logits if self.is_classifier else (outputs.last_hidden_state, outputs.pooler_output)


def check_native_export(model: VisionTransformerPreTrainedModel, max_num_patches: int) -> None:
    """Refuse, naming `--max_num_patches`, a native-aspect export the model cannot take."""
    if isinstance(max_num_patches, bool) or not isinstance(max_num_patches, int) or max_num_patches < 2:
        raise ValueError(
            f"--max_num_patches must be a number of patches per image of at least 2 (the graph is traced on it and "
            f"takes any number after), got {max_num_patches!r}."
        )
    check_serving_sizes(None, max_num_patches)
    check_native_model(model.config)


def native_example(model: VisionTransformerPreTrainedModel, max_num_patches: int, batch: int = 2, seed: int = 0):
    """A native-aspect batch of `max_num_patches` patches, as the image processor gives them."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    aspects = [(1, 1), (1, 3), (3, 1), (2, 5), (4, 3)]
    grids = [
        grid_for_max_patches(*(side * 10 for side in aspects[(seed + row) % len(aspects)]), 1, max_num_patches)
        for row in range(batch)
    ]
    width = config.patch_size**2 * config.num_channels
    pixel_values = torch.randn(batch, max_num_patches, width, generator=generator)
    shapes = torch.tensor(grids, dtype=torch.int64)
    mask = (torch.arange(max_num_patches) < shapes.prod(1)[:, None]).int()
    parameter = next(model.parameters())
    return pixel_values.to(parameter.device, parameter.dtype) * mask[..., None], mask, shapes


def export_program(
    model: VisionTransformerPreTrainedModel, max_num_patches: int | None = None
) -> torch.export.ExportedProgram:
    """`torch.export` of `model`: batch, height and width free, multiples of the patch size; with
    `max_num_patches`, a native-aspect batch of any batch and number of patches (the patch width and the grids' 2
    fixed), traced at that many patches."""
    graph, config = _GraphModel(model.eval()), model.config
    batch = torch.export.Dim("batch", min=1, max=4096)
    if max_num_patches is not None:
        check_native_export(model, max_num_patches)
        patches = torch.export.Dim("patches", min=1, max=MAX_PATCH_POSITIONS)
        shapes = {"pixel_values": {0: batch, 1: patches}, "pixel_attention_mask": {0: batch, 1: patches}}
        example = native_example(model, max_num_patches)
        return torch.export.export(graph, example, dynamic_shapes={**shapes, "spatial_shapes": {0: batch}})
    side, patch = int(MAX_PATCH_POSITIONS**0.5), config.patch_size
    rows, cols = (torch.export.Dim(f"patch_{name}", min=1, max=side) for name in ("rows", "cols"))
    # batch 2 and a grid of at least 2x2: dimensions of size 0 or 1 would be specialised by the tracer
    height, width = (max(2, n) * patch for n in config.grid_size)
    parameter = next(model.parameters())
    example = torch.zeros(2, config.num_channels, height, width, dtype=parameter.dtype, device=parameter.device)
    dynamic = {"pixel_values": {0: batch, 2: patch * rows, 3: patch * cols}}
    return torch.export.export(graph, (example,), dynamic_shapes=dynamic)


def check_export_output(
    output: str | os.PathLike, format: str, source: str | os.PathLike | None = None, overwrite: bool = False
) -> Path:
    """`output` as a Path; refused for another extension, a place inside `source`, or an existing file without
    `overwrite`."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    output = Path(output)
    if output.suffix.lower() != EXTENSIONS[format]:
        raise ValueError(
            f"--output {output}: a {format} file is named *{EXTENSIONS[format]}, not *{output.suffix or '(none)'}; "
            f"name the file to write, e.g. {output.with_suffix(EXTENSIONS[format]).name}."
        )
    if source is not None and os.path.isdir(source):
        problem = overlap(Path(source).expanduser().resolve(), output.expanduser().resolve())
        if problem:
            raise ValueError(
                f"--output {output} {problem} ({source}): exporting there could destroy the model. Choose an "
                "--output outside the model folder."
            )
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists; choose another --output or pass --overwrite to replace it.")
    return output


@contextlib.contextmanager
def quiet_exporters() -> Iterator[None]:
    """torch's exporters' warnings about torchvision operators and pytree kept quiet."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            yield
    finally:
        registration.setLevel(level)


def export(
    model: VisionTransformerPreTrainedModel,
    output: str | os.PathLike,
    format: str = "onnx",
    overwrite: bool = False,
    max_num_patches: int | None = None,
) -> Path:
    """Write `model` as ONNX or a `torch.export` program (`.pt2`) to `output` (with `max_num_patches`: the
    native-aspect graph, traced at that many patches), beside it and renamed over it; an existing file needs
    `overwrite`."""
    if Path(output).is_dir():
        raise IsADirectoryError(
            f"--output {output} is a folder; name the file to write, e.g. {Path(output) / 'model.onnx'}."
        )
    output = check_not_a_link(check_export_output(output, format, overwrite=overwrite))
    output.parent.mkdir(parents=True, exist_ok=True)
    with quiet_exporters(), tempfile.TemporaryDirectory(prefix=f".{output.name}.", dir=output.parent) as staging:
        program = export_program(model, max_num_patches)
        partial = Path(staging) / output.name
        if format == "onnx":
            onnx_program = torch.onnx.export(
                program,
                dynamo=True,
                input_names=NATIVE_INPUTS if max_num_patches is not None else ["pixel_values"],
                output_names=["logits"]
                if isinstance(model, VisionTransformerForImageClassification)
                else ["last_hidden_state", "pooler_output"],
                external_data=False,
                verbose=False,  # no progress lines of its own
            )
            onnx_program.save(str(partial))
        else:
            torch.export.save(program, partial)
        os.replace(partial, output)
    return output


@torch.no_grad()
def check_onnx(
    path: str | os.PathLike,
    model: VisionTransformerPreTrainedModel,
    sizes: Sequence[tuple[int, int]] = (),
    batch: int = 2,
    patch_counts: Sequence[int] = (),
) -> dict[str, float]:
    """The largest difference of the first output, onnxruntime vs PyTorch, per image size ("HxW") or, for a
    native-aspect graph, per number of patches ("N patches")."""
    import onnxruntime

    generator = torch.Generator().manual_seed(0)
    channels = model.config.num_channels
    cases = {f"{h}x{w}": (torch.randn(batch, channels, h, w, generator=generator),) for h, w in sizes}
    cases.update({f"{n} patches": native_example(model, n, batch, seed) for seed, n in enumerate(patch_counts)})
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    graph, differences = _GraphModel(model.eval()), {}
    for label, inputs in cases.items():
        expected = graph(*inputs)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = session.run(None, dict(zip(NATIVE_INPUTS, (tensor.cpu().numpy() for tensor in inputs))))[0]
        differences[label] = float(np.abs(got - expected.float().cpu().numpy()).max())
    return differences
