r"""End to end: `scripts/finetune.py` on a folder of generated ImageNet-sized JPEGs, with the project's data loader,
against the model-only throughput of the same training step (SGD momentum 0.9, clipping 1, dtype and compile as given)
on one batch kept on the device. The end-to-end figure is the difference of two finetune.py runs' `train_runtime`
(`--warmup_steps` and `--warmup_steps + --steps`): steady steps without start-up or compiling. Flags after `--` go to
finetune.py (and, for `--bf16` / `--torch_compile`, to the model-only step).

    python benchmarks/end_to_end.py --folder /tmp/jpegs --images 4096 --preset vit-base-patch16-224 \
        --batch_size 256 --steps 40 --json e2e.json -- --bf16 --torch_compile      # on the GPU machine
    python benchmarks/end_to_end.py --folder /tmp/jpegs --images 48 --preset vit-tiny-patch16-224 \
        --num_hidden_layers 2 --image_size 64 --batch_size 8 --steps 2 --warmup_steps 1   # proves the path on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report import log, write_json
from benchmarks.runners import random_batch
from benchmarks.settings import add_flags
from benchmarks.timing import make_train_step, timed_rounds
from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, VisionTransformerImageProcessor

FINETUNE = Path(__file__).resolve().parents[1] / "scripts" / "finetune.py"
# Sizes (width, height) typical of ImageNet-1k's training images (most are 500 pixels on the long side; the mean is
# about 400x350), in turn.
IMAGENET_SIZES = [(500, 375), (500, 333), (375, 500), (500, 500), (333, 500), (640, 480), (500, 400), (400, 300)]


def generate_jpeg_folder(folder: str | os.PathLike, images: int, classes: int = 10, seed: int = 0) -> dict:
    """An image folder `folder/images/{train,validation}/class_NN/*.jpg` of `images` training JPEGs (and one
    validation image per class) of ImageNet's typical sizes and quality: crops of scikit-learn's two sample photos,
    each with its own crop, flip and brightness, so no two files are alike.

    Reuses a folder this function wrote with the same figures (`generated.json` says so); refuses a folder that has
    other files, to overwrite nothing of a user's.
    """
    import numpy as np
    import PIL.Image
    from sklearn.datasets import load_sample_images

    folder = Path(folder)
    spec = {"images": images, "classes": classes, "seed": seed, "sizes": IMAGENET_SIZES}
    marker = folder / "generated.json"
    if marker.is_file():
        written = json.loads(marker.read_text())
        if {key: written.get(key) for key in spec} == json.loads(json.dumps(spec)):
            return written
    if folder.exists() and any(folder.iterdir()):
        if not marker.is_file():
            raise FileExistsError(f"--folder {folder} holds files this benchmark did not write; give an empty one.")
        raise FileExistsError(f"--folder {folder} holds JPEGs generated with other settings ({marker}); give another.")
    rng = random.Random(seed)
    photos = [PIL.Image.fromarray(photo) for photo in load_sample_images().images]
    total_bytes = 0
    for split, count in {"train": images, "validation": classes}.items():
        for index in range(count):
            label = index % classes
            photo = photos[rng.randrange(len(photos))]
            width, height = IMAGENET_SIZES[index % len(IMAGENET_SIZES)]
            scale = rng.uniform(0.5, 1.0)
            crop_w, crop_h = int(photo.width * scale), int(photo.height * scale)
            left, top = rng.randrange(photo.width - crop_w + 1), rng.randrange(photo.height - crop_h + 1)
            image = photo.crop((left, top, left + crop_w, top + crop_h))
            image = image.resize((width, height), PIL.Image.Resampling.BICUBIC)
            if rng.random() < 0.5:
                image = image.transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT)
            pixels = np.asarray(image, dtype=np.float32) * rng.uniform(0.7, 1.3)
            path = folder / "images" / split / f"class_{label:02d}" / f"{index:07d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            PIL.Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=rng.choice([75, 85, 90, 95]))
            total_bytes += path.stat().st_size if split == "train" else 0
    written = dict(spec, mean_jpeg_kib=total_bytes / images / 1024, dataset=str(folder / "images"))
    return json.loads(write_json(written, marker).read_text())  # as a later call that reuses the folder returns it


def model_only_images_per_s(
    model: torch.nn.Module, batch_size: int, steps: int, device: str, bf16: bool, compile: bool, warmup: int = 3
) -> float:
    """Images/s of finetune.py's training step (SGD momentum 0.9, clipping at 1) on one batch kept on `device`."""
    device = torch.device(device)
    model = model.to(device).train()
    pixel_values, labels = random_batch(model.config, batch_size, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    forward = torch.compile(model) if compile else model
    step = make_train_step(forward, optimizer, pixel_values, labels, "bf16" if bf16 else "fp32", clip=1.0)
    return batch_size / timed_rounds({"step": step}, steps, 1, device, warmup)["seconds"]["step"]


def finetune_command(model_dir, dataset, output_dir, batch_size: int, max_steps: int, extra=()) -> list[str]:
    flags = dict(model_name_or_path=model_dir, dataset_name=dataset, output_dir=output_dir, max_steps=max_steps)
    flags.update(per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size, eval_strategy="no")
    flags.update(save_strategy="no", logging_steps=max(max_steps, 1), seed=0)
    argv = [word for key, value in flags.items() for word in (f"--{key}", str(value))]
    return [sys.executable, str(FINETUNE), *argv, *extra]


def finetune_runtime(model_dir, dataset, output_dir: Path, batch_size: int, max_steps: int, extra) -> float:
    """Run finetune.py; its `train_runtime` (seconds in `trainer.train`) from all_results.json."""
    command = finetune_command(model_dir, dataset, output_dir, batch_size, max_steps, extra)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"finetune.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    log(f"  finetune.py --max_steps {max_steps}: {time.perf_counter() - start:.1f} s")
    return float(json.loads((output_dir / "all_results.json").read_text())["train_runtime"])


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", required=True, help="where the JPEGs are generated (or were, by this script)")
    add_flags(parser, {
        "images": (4096, "training JPEGs to generate"), "classes": (10, None),
        "preset": ("vit-base-patch16-224", None),
        "image_size": (None, None, int), "num_hidden_layers": (None, None, int), "batch_size": (256, None),
        "steps": (40, "steady steps timed"), "warmup_steps": (10, "steps of the shorter run (start-up, compile)"),
        "device": ("cuda" if torch.cuda.is_available() else "cpu", None), "json": (None, None),
        "threads": (None, "torch threads of the model-only timing", int),
    })  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.steps < 1 or args.warmup_steps < 1:
        parser.error("--steps and --warmup_steps must be at least 1")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = generate_jpeg_folder(args.folder, args.images, args.classes)
    seconds = time.perf_counter() - start
    log(f"{args.images} JPEGs in {data['dataset']} (mean {data['mean_jpeg_kib']:.0f} KiB): {seconds:.0f} s")
    bf16, compile = "--bf16" in extra, "--torch_compile" in extra
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    result = dict(preset=args.preset, batch_size=args.batch_size, device=args.device, gpu=gpu)
    result.update(cpu_count=os.cpu_count(), finetune_flags=extra, data=data)
    fields = {"image_size": args.image_size, "num_hidden_layers": args.num_hidden_layers, "num_labels": args.classes}
    fields = {key: value for key, value in fields.items() if value}
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(VisionTransformerConfig.from_preset(args.preset, **fields))
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "model"
        model.save_pretrained(model_dir)
        VisionTransformerImageProcessor(size=model.config.image_hw[0]).save_pretrained(model_dir)
        speed = model_only_images_per_s(model, args.batch_size, args.steps, args.device, bf16, compile)
        log(f"model only: {speed:.1f} images/s")
        del model
        runtimes = {}
        for steps in (args.warmup_steps, args.warmup_steps + args.steps):
            run = (model_dir, data["dataset"], Path(scratch) / f"run{steps}", args.batch_size, steps, extra)
            runtimes[steps] = finetune_runtime(*run)
    result["finetune_train_runtime_s"] = {str(steps): value for steps, value in runtimes.items()}
    steady = runtimes[args.warmup_steps + args.steps] - runtimes[args.warmup_steps]
    if steady <= 0:
        raise RuntimeError(f"the longer run was not slower ({runtimes}); time more --steps")
    rate = args.batch_size * args.steps / steady
    result.update(
        model_only_images_per_s=speed, end_to_end_images_per_s=rate, ratio_end_to_end_to_model_only=rate / speed
    )
    result["command"] = "python benchmarks/end_to_end.py " + " ".join(sys.argv[1:] if argv is None else argv)
    log(f"end to end: {rate:.1f} images/s, {rate / speed:.1%} of the model-only figure")
    if args.json:
        write_json(result, args.json)
    print(json.dumps({k: v for k, v in result.items() if k != "data"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
