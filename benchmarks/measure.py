"""Speed and memory of hf-vit against transformers' ViT (and timm's, where it is installed) with identical weights.

Everything runs in one process: the models share the input batch, the settings (attention implementation "sdpa",
dtype, train/eval mode, dropout 0) and the optimiser; their logits are checked to agree before anything is timed, and
their order alternates between rounds so that neither profits from running second (warm caches) or suffers from a
neighbour's job starting half-way. Figures are medians over the rounds. CPU and CUDA go through the same code; the
device is `--device` (default: CUDA where available).

The parts live in their own modules: `settings` (the flags), `models` (building the models, the logits check, the
analytic FLOPs), `timing`, `memory`, `inputs` (image processors and input pipelines), `onnx_runtime`, `profiling`,
and `runners` (the sections of a run). `run_benchmark` runs the sections in order; `benchmarks/benchmark.py` is its
command line and `benchmarks/report.py` turns the report into tables and the generated blocks of docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable

from .runners import Run, sections
from .settings import BenchmarkSettings


def run_benchmark(settings: BenchmarkSettings, log: Callable[[str], None] = print) -> dict:
    """Measure everything `settings` asks for and return it as one JSON-able dict (see `report.format_table`)."""
    run = Run(settings, log)
    for section in sections(settings):
        if section.wanted(run):
            if section.name:
                log(f"{section.name} ...")
            section.run(run)
    return run.finish()
