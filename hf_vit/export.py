"""Deployment: `torch.export` and ONNX graphs of an hf-vit model that take any batch size and any patch-divisible
image size, the position embeddings resampled inside the graph.

The graph's input is `pixel_values` (batch, channels, height, width), normalised as the model's image processor
does; its outputs are `logits` for a classifier, `last_hidden_state` and `pooler_output` for the encoder.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .model.modeling_vit import VisionTransformerForImageClassification, VisionTransformerPreTrainedModel
from .model.resolution import MAX_PATCH_POSITIONS

FORMATS = ("onnx", "torch_export")


class _GraphModel(nn.Module):
    """The model as a function of `pixel_values` alone, at any size, returning plain tensors."""

    def __init__(self, model: VisionTransformerPreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.is_classifier = isinstance(model, VisionTransformerForImageClassification)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        outputs = self.model(pixel_values, interpolate_pos_encoding=True, return_dict=True)
        return outputs.logits if self.is_classifier else (outputs.last_hidden_state, outputs.pooler_output)


def output_names(model: VisionTransformerPreTrainedModel) -> list[str]:
    if isinstance(model, VisionTransformerForImageClassification):
        return ["logits"]
    return ["last_hidden_state", "pooler_output"]


def dynamic_shapes(model: VisionTransformerPreTrainedModel) -> dict:
    """Batch, height and width free; height and width multiples of the patch size (a symbolic grid of patches), so
    the graph holds no check that could fail and no size frozen at tracing."""
    patch = model.config.patch_size
    side = int(MAX_PATCH_POSITIONS**0.5)
    rows = torch.export.Dim("patch_rows", min=1, max=side)
    cols = torch.export.Dim("patch_cols", min=1, max=side)
    batch = torch.export.Dim("batch", min=1, max=4096)
    return {"pixel_values": {0: batch, 2: patch * rows, 3: patch * cols}}


def example_input(model: VisionTransformerPreTrainedModel) -> torch.Tensor:
    # batch 2 and a grid of at least 2x2: dimensions of size 0 or 1 would be specialised by the tracer
    rows, cols = (max(2, n) for n in model.config.grid_size)
    patch = model.config.patch_size
    parameter = next(model.parameters())
    return torch.zeros(
        2, model.config.num_channels, rows * patch, cols * patch, dtype=parameter.dtype, device=parameter.device
    )


def export_program(model: VisionTransformerPreTrainedModel) -> torch.export.ExportedProgram:
    """`torch.export` of `model` (in eval mode) with dynamic batch, height and width."""
    graph = _GraphModel(model.eval())
    return torch.export.export(graph, (example_input(model),), dynamic_shapes=dynamic_shapes(model))


def export(
    model: VisionTransformerPreTrainedModel,
    output: str | os.PathLike,
    format: str = "onnx",
    overwrite: bool = False,
) -> Path:
    """Write `model` as an ONNX file or a `torch.export` program (`.pt2`) to `output`.

    An existing `output` is kept unless `overwrite`; the file is written beside it and renamed over it, so a failed
    export leaves the old file (or none), never a half-written one.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    output = Path(output)
    if output.is_dir():
        raise IsADirectoryError(
            f"--output {output} is a folder; name the file to write, e.g. {output / 'model.onnx'}."
        )
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists; choose another --output or pass --overwrite to replace it.")
    output.parent.mkdir(parents=True, exist_ok=True)
    program = export_program(model)
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.", dir=output.parent) as staging:
        partial = Path(staging) / output.name
        if format == "onnx":
            onnx_program = torch.onnx.export(
                program,
                dynamo=True,
                input_names=["pixel_values"],
                output_names=output_names(model),
                external_data=False,
            )
            onnx_program.save(str(partial))
        else:
            torch.export.save(program, partial)
        os.replace(partial, output)
    return output


@torch.no_grad()
def check_onnx(
    path: str | os.PathLike, model: VisionTransformerPreTrainedModel, sizes: Sequence[tuple[int, int]], batch: int = 2
) -> dict[str, float]:
    """Run the ONNX file with onnxruntime and `model` with PyTorch on the same random inputs at each (height, width);
    returns the largest absolute difference of the first output per size ("HxW")."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    graph = _GraphModel(model.eval())
    differences = {}
    for height, width in sizes:
        pixels = torch.randn(batch, model.config.num_channels, height, width, generator=generator)
        expected = graph(pixels)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = session.run(None, {"pixel_values": pixels.numpy()})[0]
        differences[f"{height}x{width}"] = float(np.abs(got - expected.float().numpy()).max())
    return differences
