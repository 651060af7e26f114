"""The benchmark's report: its tables, the project's targets, merging a partial run into the full JSON, and the
generated blocks of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from .settings import DTYPES, HF_VIT, PIL_DECODE, TIMM, TORCHVISION, TRANSFORMERS, add_flags
from .timing import PROFILE_CATEGORIES

log = functools.partial(print, file=sys.stderr, flush=True)  # a line of progress: stderr, the tables going to stdout


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def cell(value, spec: str = ",.0f", divisor: float = 1, missing: str = "-") -> str:
    """A table's cell: `value / divisor` in `spec`, or `missing` where there is no value."""
    return missing if value is None else format(value / divisor, spec)


def _format_value(value, unit: str) -> str:
    if value is None or unit in ("of matmul peak", "of bf16 dense peak"):
        return cell(value, ".1%")
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def _mode(row: dict) -> str:
    return ("compiled" if row["compiled"] else "eager") if row["dtype"] else ""


def format_table(report: dict) -> str:
    """Every figure with the hf-vit / transformers ratio (and hf-vit / timm where timm ran)."""
    timm = [TIMM] if any(TIMM in row["values"] for row in report["figures"]) else []
    header = ["figure", "dtype", "mode", "hf-vit", "transformers", *timm, "hf-vit / transformers", "(best runs)"]
    header += ["hf-vit / timm"] * len(timm) + ["better"]
    lines = []
    for row in report["figures"]:
        cells = [row["metric"], row["dtype"] or "", _mode(row)]
        cells += [_format_value(row["values"].get(name), row["unit"]) for name in (HF_VIT, TRANSFORMERS, *timm)]
        cells += [cell(row["ratio"], ".3f"), cell(row.get("ratio_best"), ".3f", missing="")]
        cells += [cell(row.get("ratio_timm"), ".3f") for _ in timm]
        lines.append(cells + ["higher" if row["higher_is_better"] else "lower"])
    if "processor" in report:
        difference, blank = f"{report['processor']['mean_abs_diff_01']:.2e}", [""] * len(timm)
        lines.append(
            ["processor_mean_abs_diff_01", "", "", difference, "(reference)", *blank, "-", "", *blank, "lower"]
        )
    return _markdown_table(header, lines)


def format_profile(report: dict) -> str:
    """The per-category percentages of one training step, side by side for the models and dtypes profiled."""
    profiles = {f"{name} {dtype}": got for dtype, models in report["profile"].items() for name, got in models.items()}
    lines = [[c] + [f"{p['categories_pct'][c]:.1f}%" for p in profiles.values()] for c in PROFILE_CATEGORIES]
    lines.append(["step total (ms, profiled)"] + [f"{p['total_ms']:.0f}" for p in profiles.values()])
    return _markdown_table(["category", *profiles], lines)


def merge_reports(old: dict, new: dict) -> dict:
    """`old` updated with the figures and sections `new` measured (figures replaced by key), and `new`'s command,
    settings and machine appended to "runs": for redoing part of a benchmark, e.g. rows disturbed by another job."""
    merged = dict(old)
    runs = merged.setdefault("runs", [{k: old.get(k) for k in ("command", "settings", "machine")}])
    runs.append({k: new.get(k) for k in ("command", "settings", "machine")})
    runs[-1]["figures"] = [row["key"] for row in new.get("figures", [])]
    new_keys = {row["key"] for row in new.get("figures", [])}
    merged["figures"] = [row for row in old.get("figures", []) if row["key"] not in new_keys] + new.get("figures", [])
    redid_rows = not any(new.get("settings", {}).get(key) for key in ("sweep_only", "profile_only"))
    for section in ("matmul", "profile", "rss_growth_lower_bound_mb"):
        if section in new and (section != "matmul" or redid_rows):  # the peak the figures were measured against
            merged[section] = {**old.get(section, {}), **new[section]}
    if new.get("sweep"):
        redone = {(row["image_size"], row["dtype"]) for row in new["sweep"]}
        kept = [row for row in old.get("sweep", []) if (row["image_size"], row["dtype"]) not in redone]
        order = list(DTYPES)
        merged["sweep"] = sorted(kept + new["sweep"], key=lambda row: (row["image_size"], order.index(row["dtype"])))
    for section in ("processor", "flops_per_image", "memory_metrics", "skipped_models"):
        if new.get(section):
            merged[section] = new[section]
    if "verification" in new:
        before, verification = old.get("verification", {}), new["verification"]
        diffs = {**before.get("max_abs_logits_diff", {}), **verification["max_abs_logits_diff"]}
        passed = bool(before.get("passed", True) and verification["passed"])
        merged["verification"] = {**before, **verification, "max_abs_logits_diff": diffs, "passed": passed}
    if "compile" in new and redid_rows:
        compiled = merged["compile"] = dict(old.get("compile", {}))
        for key in ("first_call_s", "errors"):
            compiled[key] = {**compiled.get(key, {}), **new["compile"].get(key, {})}
    return merged


def write_json(report: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


# ------------------------------------------------------------------------------------------------- documentation

# The ratios hf-vit / transformers this project aims for, by figure and dtype; they apply
# to the eager and the compiled rows alike. The processor's also needs a mean absolute difference <= 1/255.
TARGETS = {
    ("train_images_per_s", "fp32"): 1.10,
    ("train_images_per_s", "bf16"): 1.15,
    ("infer_images_per_s", "fp32"): 1.05,
    ("infer_images_per_s", "bf16"): 1.05,
    ("processor_images_per_s", None): 1.50,
    # the training input pipeline per core against torchvision's in transformers' example (the transformers column)
    ("input_pipeline_photo_images_per_s", None): 2.00,
}
PROCESSOR_MAX_MEAN_ABS_DIFF = 1 / 255


def format_targets(report: dict) -> str:
    """Each targeted figure's ratio against its target, met or not (the GPU targets are `gpu.py`'s)."""
    rows = []
    for row in report["figures"]:
        target = TARGETS.get((row["metric"], row["dtype"]))
        if target is None or row["ratio"] is None:
            continue
        met, measured = row["ratio"] >= target, f"{row['ratio']:.3f}"
        if row["metric"] == "processor_images_per_s":
            difference = report["processor"]["mean_abs_diff_01"]
            met = met and difference <= PROCESSOR_MAX_MEAN_ABS_DIFF
            measured += f" at a mean absolute difference of {difference:.1e} (limit {PROCESSOR_MAX_MEAN_ABS_DIFF:.1e})"
        head = [row["metric"], row["dtype"] or "", _mode(row), "hf-vit / transformers", f"{target:.2f}", measured]
        rows.append(head + [cell(row.get("ratio_best"), ".3f", missing=""), "**met**" if met else "not met"])
    return _markdown_table(["figure", "dtype", "mode", "against", "target", "measured", "(best runs)", ""], rows)


def format_sweep(report: dict) -> str:
    """The size sweep as a table: throughput of the models and hf-vit's ratio to the others at each image size."""
    points = report.get("sweep", [])
    others = [name for name in (TRANSFORMERS, TIMM) if any(name in p["train_images_per_s"] for p in points)]
    header = ["size", "tokens", "dtype"]
    for mode in ("train", "infer"):
        header += [f"{mode} hf-vit"] + [f"{mode} {name}" for name in others]
        header += [f"{mode} hf-vit / {name}" for name in others]
    rows = []
    for point in points:
        cells = [point["image_size"], point["tokens"], point["dtype"]]
        for mode in ("train", "infer"):
            values = point[f"{mode}_images_per_s"]
            cells += [f"{values[HF_VIT]:.2f}", *(f"{values[n]:.2f}" if values.get(n) else "-" for n in others)]
            cells += [f"{values[HF_VIT] / values[name]:.3f}" if values.get(name) else "-" for name in others]
        rows.append(cells)
    return _markdown_table(header, rows)


def format_machine(report: dict) -> str:
    machine = report["machine"]
    peaks = [f"{dtype} {entry['flops_per_s'] / 1e12:.3f} TFLOP/s" for dtype, entry in report.get("matmul", {}).items()]
    size = next((entry.get("size") for entry in report.get("matmul", {}).values()), None) or "?"
    timm = f"timm {machine['timm']}" if machine.get("timm") else "timm not installed"
    software = f"torch {machine['torch']}, transformers {machine['transformers']}, {timm}, Python {machine['python']}"
    loads = [machine.get(f"load_average_at_{when}") for when in ("start", "end")]
    loads = [", ".join(f"{value:.2f}" for value in load) if load else "?" for load in loads]
    rows = [
        ["processor", machine.get("gpu") or machine.get("cpu", machine["device"])],
        ["cores, torch threads", f"{machine.get('cpu_count')}, {machine.get('torch_threads')}"],
        ["software", software],
        [f"matmul peak ({size}², best of before and after the models)", ", ".join(peaks)],
        ["load average (1, 5, 15 min) at start / end", f"{loads[0]} / {loads[1]}"],
    ]
    commands = [run["command"] for run in report.get("runs", [])] or [report.get("command", "")]
    rows += [[f"command {index}", f"`{command}`"] for index, command in enumerate(commands, 1)]
    return _markdown_table(["", ""], rows)


def format_input_pipeline(report: dict) -> str:
    """Images/s per core of each training input pipeline on each kind of photo, and hf-vit's ratio to each."""
    pipeline = report["input_pipeline"]
    kinds = [kind for kind in ("photo", "large_photo") if kind in pipeline]
    header = ["pipeline"]
    for kind in kinds:
        header += [f"{kind.replace('_', ' ')}s {', '.join(pipeline[kind]['image_sizes'])} (images/s)", "hf-vit / it"]
    rows = []
    for name in (HF_VIT, TORCHVISION, TIMM, PIL_DECODE):
        cells = [pipeline["names"][name]]
        for kind in kinds:
            values = pipeline[kind]["images_per_s"]
            if name not in values:
                cells += ["-", "-"]
                continue
            cells += [f"{values[name]:.0f}", "" if name == HF_VIT else f"{values[HF_VIT] / values[name]:.2f}"]
        rows.append(cells)
    table = _markdown_table(header, rows)
    if pipeline.get("skipped"):
        missing = "; ".join(f"{name}: {why}" for name, why in pipeline["skipped"].items())
        table += f"\n\nNot in this run (run the benchmark in the peer environment to add them): {missing}"
    profile = pipeline.get("profile")
    if profile:
        table += (
            f"\n\nWhere hf-vit's transform spends its time on the photos (cProfile, self time, "
            f"{profile['total_ms_per_image']:.2f} ms per image in all under the profiler):\n\n"
        )
        functions = [
            [f"`{r['function']}`", f"{r['self_ms_per_image']:.3f}", f"{r['pct']:.1f}%"]
            for r in profile["top_functions"]
        ]
        table += _markdown_table(["function", "ms per image", "share"], functions)
    return table


def format_onnxruntime(report: dict) -> str:
    """onnxruntime against eager PyTorch fp32 inference at each batch size."""
    section = report["onnxruntime"]
    if "error" in section:
        return f"Not timed: {section['error']}"
    rows = [
        [row["batch_size"], f"{row['images_per_s'][HF_VIT]:.1f}", f"{row['images_per_s']['onnxruntime']:.1f}",
         f"{row['ratio_onnxruntime_to_eager']:.3f}", f"{row['max_abs_logits_diff']:.1e}"]
        for key, row in section.items()
        if key.startswith("batch_")
    ]  # fmt: skip
    header = ["batch", "hf-vit eager fp32 (images/s)", "onnxruntime (images/s)", "onnxruntime / eager"]
    return _markdown_table(header + ["max abs logits difference"], rows)


# The generated blocks of docs/benchmarks.md, by marker: (the report's part they show, or None for the main rows;
# their title where `benchmark.py` prints them after the table; their renderer; the text where not measured).
SECTIONS = {
    "machine": (None, None, format_machine, None),
    "table": (None, None, format_table, None),
    "targets": (None, None, format_targets, None),
    "pipeline": (
        "input_pipeline",
        "Training input pipelines, one thread (JPEG bytes to a normalised batch)",
        format_input_pipeline,
        "Not measured in this run (`--no_pipeline`).",
    ),
    "onnxruntime": (
        "onnxruntime",
        "onnxruntime against eager fp32 inference",
        format_onnxruntime,
        "Not measured in this run (`--no_onnx`, or not on CPU).",
    ),
    "profile": ("profile", "Where one training step's time goes (self CPU time)", format_profile, None),
    "sweep": (
        "sweep",
        "Size sweep (images/s)",
        format_sweep,
        "Not measured in this run: the size sweep runs with `--sizes` (outside `make bench`'s 15 minutes).",
    ),
}


def markdown_sections(report: dict) -> dict[str, str]:
    sections = {name: (render(report) if key is None or report.get(key) else missing)
                for name, (key, _, render, missing) in SECTIONS.items()}  # fmt: skip
    return {name: text for name, text in sections.items() if text is not None}


def fill_markdown(text: str, sections: dict[str, str], tag: str = "benchmark") -> str:
    """`text` with every `<!-- TAG:NAME -->` ... `<!-- /TAG:NAME -->` block holding `sections[NAME]` (TAG is
    "benchmark" for the CPU figures, "benchmark-gpu" for `benchmarks/gpu.py`'s)."""
    start = re.compile(rf"<!-- {re.escape(tag)}:(\w+) -->")
    marker = re.compile(rf"(<!-- {re.escape(tag)}:(\w+) -->\r?\n).*?(<!-- /{re.escape(tag)}:\2 -->)", re.DOTALL)
    blocks = [groups[1] for groups in marker.findall(text)]
    unclosed = sorted(set(start.findall(text)) - set(blocks))
    if unclosed:
        raise ValueError(
            f"Block(s) {unclosed} open with <!-- {tag}:NAME --> on a line of its own but have no "
            f"<!-- /{tag}:NAME --> after them; add the closing marker."
        )
    unknown = sorted(set(blocks) - set(sections))
    if unknown:
        raise ValueError(
            f"No figures for the block(s) {unknown}: this report has only {sorted(sections)}. Measure the missing "
            "parts (e.g. --profile, --sizes) or merge them in with --merge_json."
        )
    return marker.sub(lambda match: match[1] + sections[match[2]] + "\n" + match[3], text)


def write_doc(report: dict, path: str | os.PathLike, sections=None, tag: str = "benchmark") -> Path:
    """Rewrite the generated blocks (`sections(report)`, default `markdown_sections`) of the markdown file at `path`;
    the rest of it is left as written."""
    doc = Path(path)
    doc.write_text(fill_markdown(doc.read_text(), (sections or markdown_sections)(report), tag=tag))
    return doc


def plot_sweep(rows: list[dict], path: str | os.PathLike, title: str = "") -> Path:
    """Throughput against tokens for each model (training left, inference middle) and the hf-vit/transformers
    ratio (right)."""
    from hf_vit.outputs.plotting import pyplot, save_figure

    fig, axes = pyplot().subplots(1, 3, figsize=(15, 4.5))
    styles = {HF_VIT: "-o", TRANSFORMERS: "--s", TIMM: ":^"}
    dtypes = sorted({row["dtype"] for row in rows}, key=list(DTYPES).index)
    for dtype in dtypes:
        selected = sorted((row for row in rows if row["dtype"] == dtype), key=lambda row: row["tokens"])
        tokens = [row["tokens"] for row in selected]
        for ax, mode in zip(axes[:2], ("train", "infer")):
            for name in styles:
                if name in selected[0][f"{mode}_images_per_s"]:
                    values = [row[f"{mode}_images_per_s"][name] for row in selected]
                    ax.plot(tokens, values, styles[name], label=f"{name} {dtype}")
        for mode, marker in (("train", "-o"), ("infer", "--s")):
            axes[2].plot(tokens, [row[f"{mode}_ratio"] for row in selected], marker, label=f"{mode} {dtype}")
    sizes = sorted({(row["tokens"], row["image_size"]) for row in rows})
    titles = ("training step", "inference", "hf-vit / transformers")
    labels = ("images / s", "images / s", "throughput ratio (higher: hf-vit faster)")
    for ax, label, y, yscale in zip(axes, titles, labels, ("log", "log", "linear")):
        ax.set(xscale="log", xticks=[t for t, _ in sizes], xlabel="tokens (image size)", title=label, ylabel=y)
        ax.set(yscale=yscale)
        ax.set_xticklabels([f"{t}\n({s}px)" for t, s in sizes], fontsize=8)
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].axhline(1.0, color="grey", lw=0.8)
    return save_figure(fig, path, title, dpi=110)


# The flags of naflex_speed.py and simmim_speed.py beside their own: name: (default, help), as `add_flags` takes them.
SPEED_FLAGS = {
    "batch_size": (8, None), "width": (192, None), "depth": (12, None), "heads": (3, None),
    "steps": (2, "calls per timed sample"), "repeats": (5, "undisturbed samples per row"),
}  # fmt: skip


def speed_parser(doc: str, tag: str, flags: dict) -> argparse.ArgumentParser:
    """The command line of a speed table: `flags`, `SPEED_FLAGS` and --doc, the file whose TAG block `print_table`
    rewrites."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    block = f"<!-- {tag}:table -->"

    def doc_file(text: str) -> Path:  # refused before anything is measured
        if not Path(text).is_file() or block not in Path(text).read_text():
            raise argparse.ArgumentTypeError(f"{text} is not a markdown file with a {block} block to rewrite")
        return Path(text)

    add_flags(
        parser, {**flags, **SPEED_FLAGS, "doc": (None, f"markdown file whose {block} block is rewritten", doc_file)}
    )
    return parser


def print_table(table: str, doc: Path | None, script: str, argv: list[str] | None, tag: str) -> None:
    """Print a table and, with `doc`, rewrite that file's `<!-- TAG:table -->` block with it and the command."""
    print(table)
    if doc:
        command = f"python benchmarks/{script} " + shlex.join(sys.argv[1:] if argv is None else argv)
        doc.write_text(fill_markdown(doc.read_text(), {"table": f"{table}\n\n`{command}`"}, tag=tag))
        print(f"doc: {doc}")
