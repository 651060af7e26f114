r"""Benchmark hf-vit's VisionTransformerForImageClassification against transformers' ViTForImageClassification
(and timm's VisionTransformer where it imports, e.g. in `bash benchmarks/peer_env.sh`'s environment) with identical
weights, in one process: training-step and inference throughput, peak memory and the fraction of the machine's matmul
peak, in fp32 and bf16 autocast, eager (and compiled with --compile); the image processors on real photos; the
training input pipelines per core; onnxruntime; optionally a size sweep and a profile. Under 15 minutes on 2 cores.

    python benchmarks/benchmark.py                                # ViT-S/16, 224, batch 16, fp32 + bf16
    python benchmarks/benchmark.py --json docs/benchmarks.json --profile --compile \
        --sizes 224 288 384 448 512 --sweep_batch_size 4 --plot docs/throughput_vs_size.png
    python benchmarks/benchmark.py --model vit-tiny-patch16-224 --image_size 32 --batch_size 2 --steps 1 \
        --warmup 0 --no_timm --no_pipeline --no_onnx              # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from transformers import HfArgumentParser

from benchmarks.report import SECTIONS, format_table, log, merge_reports, plot_sweep, write_doc, write_json
from benchmarks.runners import run_benchmark
from benchmarks.settings import OUTPUT_FLAGS, BenchmarkSettings, add_flags, check_outputs


def parse_args(argv: list[str] | None = None) -> tuple[BenchmarkSettings, argparse.Namespace]:
    """The settings and outputs from the command line; inconsistent flags exit with a one-line usage error."""
    parser = HfArgumentParser(
        BenchmarkSettings, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(parser, {**OUTPUT_FLAGS, "plot": (None, "PNG of the size sweep")})
    try:
        settings, output = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:  # BenchmarkSettings.__post_init__ names the flags
        parser.error(str(error))
    if output.plot and not settings.sizes:
        parser.error("--plot needs --sizes")
    if output.doc and not settings.main_rows and not output.merge_json and not output.doc_only:
        parser.error(
            "--doc with --sweep_only/--profile_only would rewrite the page from a partial run: add --merge_json "
            "(and --json) to merge this run into the full figures first"
        )
    check_outputs(parser, output, "benchmark")
    return settings, output


def main(argv: list[str] | None = None) -> int:
    settings, output = parse_args(argv)
    if output.doc_only:
        print(f"doc: {write_doc(json.loads(Path(output.json).read_text()), output.doc)}")
        return 0
    if settings.threads:
        torch.set_num_threads(settings.threads)
    report = run_benchmark(settings, log=log)
    report["command"] = "python benchmarks/benchmark.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if output.merge_json and Path(output.json).is_file():
        # Figures, sweep points and sections this run redid replace the file's; the rest stays (and is plotted).
        report = merge_reports(json.loads(Path(output.json).read_text()), report)
    if output.json:  # first: what was measured is kept even if printing or plotting fails
        print(f"json: {write_json(report, output.json)}")
    print(format_table(report))
    for key, title, render, _ in SECTIONS.values():
        if title and report.get(key):
            print(f"\n{title}:\n{render(report)}")
    if output.plot and report.get("sweep"):
        machine = report["machine"].get("gpu") or report["machine"].get("cpu", settings.device)
        title = f"{settings.model} batch {report['sweep'][0]['batch_size']} on {machine}"
        print(f"plot: {plot_sweep(report['sweep'], output.plot, title)}")
    if output.doc:
        print(f"doc: {write_doc(report, output.doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
