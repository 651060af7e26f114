"""onnxruntime (CPU) on hf-vit's exported ONNX file against eager PyTorch inference.

(Named onnx_runtime, not onnx: a module called onnx beside benchmark.py would shadow the onnx package.)"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hf_vit import VisionTransformerForImageClassification

from .settings import HF_VIT
from .timing import make_infer_step, median_seconds, time_alternating

ONNX_TOLERANCE = 1e-3


def compare_onnxruntime(
    model: VisionTransformerForImageClassification, batch_sizes: Sequence[int], steps: int, repeats: int, seed: int
) -> dict:
    """onnxruntime (CPU, as many threads as torch) on `hf_vit.export`'s ONNX file against eager PyTorch fp32
    inference, the outputs compared first (max |logits difference| <= `ONNX_TOLERANCE`)."""
    import tempfile

    import onnxruntime

    from hf_vit.export import export

    model = model.eval()
    config = model.config
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        path = export(model, Path(folder) / "model.onnx", "onnx")
        export_s = time.perf_counter() - start
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    result: dict = {"onnxruntime": onnxruntime.__version__, "export_s": export_s, "threads": torch.get_num_threads()}
    generator = torch.Generator().manual_seed(seed + 3)
    for batch in batch_sizes:
        pixel_values = torch.randn(batch, config.num_channels, *config.image_hw, generator=generator)
        array = pixel_values.numpy()
        with torch.no_grad():
            expected = model(pixel_values).logits
        got = session.run(None, {"pixel_values": array})[0]
        difference = float((torch.from_numpy(got) - expected).abs().max())
        if difference > ONNX_TOLERANCE:
            raise AssertionError(
                f"onnxruntime's logits differ by {difference:.2e} > {ONNX_TOLERANCE} at batch {batch}"
            )
        fns = {
            HF_VIT: make_infer_step(model, pixel_values, "fp32"),
            "onnxruntime": functools.partial(session.run, None, {"pixel_values": array}),
        }
        samples = time_alternating(fns, steps, repeats, torch.device("cpu"))
        per_s = {name: batch / median_seconds(sample) for name, sample in samples.items()}
        ratio = per_s["onnxruntime"] / per_s[HF_VIT]
        row = dict(batch_size=batch, max_abs_logits_diff=difference, seconds=samples, images_per_s=per_s)
        result[f"batch_{batch}"] = {**row, "ratio_onnxruntime_to_eager": ratio}
    return result
