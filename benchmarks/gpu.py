#!/usr/bin/env python
r"""The GPU benchmark: ViT-S/16, ViT-B/16 and ViT-L/16 at 224 in bf16 autocast, training and inference, eager and
compiled, hf-vit against transformers' and timm's ViT with identical weights in one process, through the sections of
`benchmark.py`. MFU = images/s * analytic FLOPs per image (`models.vit_forward_flops`; a training step 3 * forward)
/ the GPU's dense bf16 peak (data sheet, e.g. 989 TFLOP/s for an H100 SXM or H200).

    python benchmarks/gpu.py --json docs/benchmarks_gpu.json --doc docs/benchmarks.md   # on the GPU machine
    python benchmarks/gpu.py --quick --json /tmp/gpu.json      # the same path on a tiny model, seconds on a CPU
    python benchmarks/gpu.py --packing_only --json docs/benchmarks_gpu.json --merge_json   # the packing rows alone

`--packing` adds the packing rows of `gpu_packing.py` (on by default with `--quick`). The JSON is written after every
model, so a run stopped by a time limit keeps what it measured; `--time_budget_s` skips what would start after it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_packing import format_packing, measure_packing
from benchmarks.report import _markdown_table, cell, log, merge_reports, write_doc, write_json
from benchmarks.runners import machine_info, run_benchmark
from benchmarks.settings import HF_VIT, OUTPUT_FLAGS, TIMM, TRANSFORMERS, BenchmarkSettings, add_flags, check_outputs
from benchmarks.timing import budget_spent

# The presets and the training batch sizes practitioners use on one 80 GB GPU (inference uses the same batch).
GPU_PRESETS = {"vit-small-patch16-224": 256, "vit-base-patch16-224": 256, "vit-large-patch16-224": 128}
# --quick: ViT-Ti/16 cut to 2 blocks at 32x32, batch 2.
QUICK_PRESET = "vit-tiny-patch16-224"
# The project's GPU targets: every hf-vit / peer throughput ratio (eager against eager, compiled against compiled), and
# compiled ViT-B/16's MFU.
RATIO_TARGET = 1.05
MFU_TARGETS = {("vit-base-patch16-224", "train"): 0.40, ("vit-base-patch16-224", "infer"): 0.50}
PEERS = (TRANSFORMERS, TIMM)
TAG = "benchmark-gpu"  # of the generated blocks in the docs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"presets (default: {', '.join(GPU_PRESETS)})")
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=None, help="one per --models")
    parser.add_argument(
        "--sdpa_backend", choices=["flash", "efficient", "cudnn", "math"], help="one SDPA backend only"
    )
    add_flags(parser, {
        **OUTPUT_FLAGS,
        "device": ("cuda" if torch.cuda.is_available() else "cpu", "cuda or cpu"),
        "no_compile": (False, "eager rows only"),
        "no_eager": (False, "compiled rows only (e.g. a second run, merged)"),
        "compile_mode": (None, "torch.compile mode (default: torch's default)"),
        "compile_blocks": (False, "compile each transformer block (fullgraph) instead of the model"),
        "compile_backend": ("inductor", "torch.compile backend"),
        "steps": (10, "timed steps per round"),
        "repeats": (3, "rounds per model; the figures are their medians"),
        "warmup": (3, "untimed steps per model (compiled: at least 2)"),
        "profile": (False, "also profile one training step of each model"),
        "peak_tflops": (None, "dense bf16 peak (default: by GPU name)", float),
        "time_budget_s": (None, "start no model after this many seconds", float),
        "threads": (0, "torch.set_num_threads"),
        "quick": (False, "the same path on a tiny model (2-block ViT-Ti/16 at 32, batch 2)"),
        "packing": (False, "also the packing rows (gpu_packing.py); on by default with --quick"),
        "packing_only": (False, "the packing rows alone, no model comparison"),
    })  # fmt: skip
    args = parser.parse_args(argv)
    args.packing = args.packing or args.packing_only or args.quick
    if args.quick:  # one sample of each row, no warm-up: the path, not the figures
        args.steps, args.repeats, args.warmup = 1, 1, 0
    if args.quick and args.models:
        parser.error("--quick runs its own tiny model: drop --models")
    if args.batch_sizes and len(args.batch_sizes) != len(args.models or GPU_PRESETS):
        parser.error("--batch_sizes needs one batch size per model")
    if args.no_eager and args.no_compile:
        parser.error("--no_eager with --no_compile leaves nothing to time")
    check_outputs(parser, args, TAG)
    return args


def settings_for(args: argparse.Namespace) -> list[BenchmarkSettings]:
    """One `BenchmarkSettings` per model: bf16 only, training and inference, eager and (unless --no_compile)
    compiled, no image processors, input pipelines or onnxruntime (those are CPU figures)."""
    same = ("device", "sdpa_backend", "compile_mode", "compile_backend", "compile_blocks", "steps", "repeats")
    common = {name: getattr(args, name) for name in (*same, "warmup", "profile", "peak_tflops")}
    common.update(dtypes=["bf16"], compile=not args.no_compile, eager=not args.no_eager)
    common.update(processor=False, pipeline=False, onnx=False)
    if args.quick:
        quick = dict(matmul_size=128, matmul_repeats=1, num_hidden_layers=2, image_size=32)
        return [BenchmarkSettings(model=QUICK_PRESET, batch_size=2, **common, **quick)]
    models = args.models or list(GPU_PRESETS)
    batch_sizes = args.batch_sizes or [GPU_PRESETS.get(model, 128) for model in models]
    return [BenchmarkSettings(model=model, batch_size=batch, **common) for model, batch in zip(models, batch_sizes)]


def summary_rows(report: dict) -> list[dict]:
    """One row per model, mode (train, infer) and variant (eager, compiled): images/s of each library, hf-vit's
    ratios to the peers, each library's MFU and peak memory."""
    rows = []
    for model, run in report["models"].items():
        figures = {row["key"]: row for row in run["figures"]}
        for variant, mode in itertools.product(("eager", "compiled"), ("train", "infer")):
            speed = figures.get(f"{mode}_images_per_s/bf16/{variant}")
            if speed is None:
                continue
            row = dict(model=model, batch_size=run["settings"]["batch_size"], mode=mode, variant=variant)
            ratio = {TRANSFORMERS: speed.get("ratio"), TIMM: speed.get("ratio_timm")}
            row.update(images_per_s=speed["values"], ratio=ratio)
            for name in ("mfu", "peak_mem_mb"):
                row[name] = figures.get(f"{mode}_{name}/bf16/{variant}", {}).get("values", {})
            if variant == "compiled" and (model, mode) in MFU_TARGETS:
                row["mfu_target"] = MFU_TARGETS[model, mode]
            rows.append(row)
    return rows


def format_summary(report: dict) -> str:
    """The GPU table: images/s, hf-vit / peer ratios (target 1.05), MFU and peak memory of every row."""
    header = ["model", "batch", "mode", "variant", "hf-vit (images/s)", "transformers", "timm"]
    header += ["hf-vit / transformers", "hf-vit / timm", "MFU hf-vit", "MFU transformers", "MFU timm"]
    header += ["peak memory hf-vit (GiB)", "transformers", "timm"]
    # the summary row's field, the libraries it has a value for, their format (and divisor: MiB to GiB)
    groups = [("images_per_s", (HF_VIT, *PEERS), ",.0f", 1), ("ratio", PEERS, ".3f", 1)]
    groups += [("mfu", (HF_VIT, *PEERS), ".1%", 1), ("peak_mem_mb", (HF_VIT, *PEERS), ",.2f", 1024)]
    lines = []
    for row in report["summary"]:
        cells = [cell(row[field].get(name), *spec) for field, names, *spec in groups for name in names]
        lines.append([row["model"], row["batch_size"], row["mode"], row["variant"], *cells])
    return _markdown_table(header, lines)


def format_targets(report: dict) -> str:
    """Each of the project's GPU targets against the measured figure: every ratio >= 1.05, compiled ViT-B/16 MFU."""
    lines = []
    for row in report["summary"]:
        head = [row["model"], row["mode"], row["variant"]]
        for peer in PEERS:
            ratio = row["ratio"].get(peer)
            if ratio is not None:
                met = "**met**" if ratio >= RATIO_TARGET else "not met"
                lines.append(head + [f"hf-vit / {peer}", f"{RATIO_TARGET:.2f}", f"{ratio:.3f}", met])
        if "mfu_target" in row:
            value = row["mfu"].get(HF_VIT)
            met = "**met**" if value is not None and value >= row["mfu_target"] else "not met"
            lines.append(head + ["MFU", f"{row['mfu_target']:.0%}", cell(value, ".1%"), met])
    return _markdown_table(["model", "mode", "variant", "figure", "target", "measured", ""], lines)


def format_machine(report: dict) -> str:
    machine, peak = report["machine"], report.get("bf16_dense_peak")
    rows = [
        ["device", f"{machine['device']}: {machine.get('gpu') or machine.get('cpu', '?')}"],
        ["software", f"torch {machine['torch']} (CUDA {machine.get('cuda')}), transformers {machine['transformers']}"
         + (f", timm {machine['timm']}" if machine.get("timm") else ", timm not installed")],
        ["dense bf16 peak", "unknown" if peak is None else f"{peak['flops_per_s'] / 1e12:g} TFLOP/s "
         f"({peak['source']})"],
        ["FLOPs", report.get("flops_formula", "-")],
        *[[f"command {i}", f"`{command}`"] for i, command in enumerate(report.get("runs", [report["command"]]), 1)],
    ]  # fmt: skip
    return _markdown_table(["", ""], rows)


def markdown_sections(report: dict) -> dict[str, str]:
    sections = {"machine": format_machine(report), "summary": format_summary(report)}
    return {**sections, "targets": format_targets(report), "packing": format_packing(report)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.doc_only:
        print(f"doc: {write_doc(json.loads(Path(args.json).read_text()), args.doc, markdown_sections, TAG)}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    report: dict = {"command": "python benchmarks/gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)}
    previous = json.loads(Path(args.json).read_text()) if args.merge_json and Path(args.json).is_file() else {}
    kept = ("models", "machine", "flops_formula", "bf16_dense_peak", "packing")  # a model measured again is merged
    report.update({key: previous[key] for key in kept if key in previous}, skipped={})
    report.setdefault("models", {})
    if previous:
        report["runs"] = previous.get("runs", [previous["command"]]) + [report["command"]]

    def save(packing: dict | None = None) -> None:  # after every model and packing variant: a run cut short keeps them
        if packing is not None:
            report["packing"] = {**packing, "rows": {**previous.get("packing", {}).get("rows", {}), **packing["rows"]}}
        report["summary"] = summary_rows(report)
        if args.json:
            write_json(report, args.json)

    for part in ([] if args.packing_only else settings_for(args)) + (["packing"] if args.packing else []):
        name, began = getattr(part, "model", part), time.perf_counter()
        if spent := budget_spent(args.time_budget_s, start):
            report["skipped"][name] = spent
            log(f"{name}: skipped, {spent}")
        elif part == "packing":
            report.setdefault("machine", machine_info(torch.device(args.device)))
            save(measure_packing(args, log, start, save))
        else:
            run = run_benchmark(part, log=log)
            run["seconds"] = time.perf_counter() - began
            report["models"][name] = merge_reports(report["models"][name], run) if name in report["models"] else run
            for key in ("machine", "flops_formula", "bf16_dense_peak"):
                report.setdefault(key, run[key])
            if torch.cuda.is_available() and part.device.startswith("cuda"):
                torch.cuda.empty_cache()
            save()
    if not report["models"] and not report.get("packing"):
        print("error: no model was measured (the time budget was spent before the first)", file=sys.stderr)
        return 1
    report.update(seconds=time.perf_counter() - start, summary=summary_rows(report))
    if args.json:
        print(f"json: {write_json(report, args.json)}")
    print(format_summary(report) + "\n\n" + format_targets(report))
    if report.get("packing"):
        print("\n" + format_packing(report))
    if args.doc:
        print(f"doc: {write_doc(report, args.doc, markdown_sections, TAG)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
