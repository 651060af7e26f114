"""Loading a checkpoint in transformers' ViT layout by Hub id: hf-vit's converting `from_pretrained` against
transformers' own, for ViT-B/16 and ViT-L/16 with random weights written into an offline Hub cache of its own (with
`--models DINOv2-B/14`: transformers' `Dinov2Model` against hf-vit's `VisionTransformerModel`). Each load
(from_pretrained and one forward) runs in a fresh process (`--worker`), the loaders alternating for `--rounds`;
printed: the medians of its time and peak resident memory above the imports, from_pretrained's time alone, the range
over the rounds.

    .venv/bin/python benchmarks/load_cost.py --cache /tmp/load-cost-hub --rounds 3

`--code PATH` loads hf-vit from another checkout (e.g. a `git worktree` of an older commit) for before/after figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MODELS = {
    "ViT-B/16": ("google/vit-base-patch16-224", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                     intermediate_size=3072)),
    "ViT-L/16": ("google/vit-large-patch16-224", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                                      intermediate_size=4096)),
    # opt-in (`--models DINOv2-B/14`): DINOv2's layout, LayerScale, a 37x37 position table
    "DINOv2-B/14": ("facebook/dinov2-base", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                 mlp_ratio=4)),
}  # fmt: skip
LOADERS = ("transformers", "hf-vit")


def write_snapshot(cache: Path, repo_id: str, sizes: dict) -> None:
    """`repo_id` in the Hub cache layout under `cache`: a transformers ViT classifier with random weights, or a
    DINOv2 encoder (DINOv2-B/14's 518x518 position table) when `sizes` has DINOv2's `mlp_ratio`."""
    import torch
    import transformers as tf

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    if (snapshot / "model.safetensors").is_file():
        return
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if "mlp_ratio" in sizes:  # DINOv2
        config, model_class = tf.Dinov2Config(image_size=518, patch_size=14, **sizes), tf.Dinov2Model
        processor = tf.BitImageProcessor(size={"shortest_edge": 256}, crop_size=224)
    else:
        config = tf.ViTConfig(image_size=224, patch_size=16, num_labels=1000, **sizes)
        model_class, processor = tf.ViTForImageClassification, tf.ViTImageProcessor(size={"height": 224, "width": 224})
    with torch.device("meta"):
        model = model_class(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.02)
    model.save_pretrained(snapshot)
    processor.save_pretrained(snapshot)


def worker(loader: str, repo_id: str) -> None:
    """One load in this process: prints `{"seconds", "peak_mb"}` above the imports as one JSON line."""
    import resource
    import time

    import torch
    from huggingface_hub import hf_hub_download

    dinov2 = json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text())["model_type"] == "dinov2"
    if loader == "hf-vit":
        import hf_vit

        model_class = hf_vit.VisionTransformerModel if dinov2 else hf_vit.VisionTransformerForImageClassification
    else:
        import transformers

        model_class = transformers.Dinov2Model if dinov2 else transformers.ViTForImageClassification
    # transformers' DINOv2 always resamples its position embeddings
    forward = {"interpolate_pos_encoding": True} if dinov2 and loader == "hf-vit" else {}
    pixels = torch.randn(1, 3, 224, 224)
    with open("/proc/self/statm") as statm:  # the resident set after the imports, in MiB
        base = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    start = time.perf_counter()
    model = model_class.from_pretrained(repo_id)
    loaded = time.perf_counter()
    with torch.no_grad():
        model(pixels, **forward)
    seconds = time.perf_counter() - start
    code = sys.modules[model_class.__module__].__file__
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    print(json.dumps({"seconds": seconds, "load_seconds": loaded - start, "peak_mb": peak, "code": code}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default="/tmp/hf-vit-load-cost-hub", help="Hub cache folder the benchmark fills")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["ViT-B/16", "ViT-L/16"], choices=list(MODELS))
    parser.add_argument("--code", help="load hf-vit from this checkout instead of the installed one")
    parser.add_argument("--worker", nargs=2, metavar=("LOADER", "REPO_ID"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    cache = Path(args.cache)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env["TRANSFORMERS_VERBOSITY"] = "error"
    if args.code:
        env["PYTHONPATH"] = os.pathsep.join([args.code, env.get("PYTHONPATH", "")])
    start_load = os.getloadavg()
    print("| model | loader | seconds | range over the rounds | of which from_pretrained | peak MB above imports |")
    print("|---|---|---|---|---|---|")
    results = {}
    for name in args.models:
        repo_id, sizes = MODELS[name]
        write_snapshot(cache, repo_id, sizes)
        runs = {loader: [] for loader in LOADERS}
        for _ in range(args.rounds):
            for loader in LOADERS:  # alternating, each load in a fresh process
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", loader, repo_id],
                    env=env, capture_output=True, text=True, check=True,
                )  # fmt: skip
                runs[loader].append(json.loads(done.stdout.strip().splitlines()[-1]))
        for loader, done in runs.items():
            seconds, load_seconds, peak = (
                statistics.median(r[key] for r in done) for key in ("seconds", "load_seconds", "peak_mb")
            )
            times, results[(name, loader)] = [r["seconds"] for r in done], (seconds, peak)
            range_ = f"{min(times):.2f}-{max(times):.2f}"
            print(f"| {name} | {loader} | {seconds:.2f} | {range_} | {load_seconds:.2f} | {peak:.0f} |", flush=True)
    for name in args.models:
        (t_seconds, t_peak), (h_seconds, h_peak) = results[(name, "transformers")], results[(name, "hf-vit")]
        print(f"{name}: hf-vit / transformers = {h_seconds / t_seconds:.2f}x time, {h_peak / t_peak:.2f}x memory")
    # the machine's load (1, 5 and 15 minute averages) at the start and the end: figures from busy cores are noisy
    loads = ", ".join(f"{one:.2f}/{five:.2f}/{fifteen:.2f}" for one, five, fifteen in (start_load, os.getloadavg()))
    print(f"load average at the start and the end: {loads} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
