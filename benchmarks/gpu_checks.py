#!/usr/bin/env python
r"""Every path of hf-vit on the GPU, one line per check: passed, failed, or skipped with the reason.

    python benchmarks/gpu_checks.py                  # on a GPU machine: every check (a few minutes)
    python benchmarks/gpu_checks.py --device cpu     # the checks that can run on CPU, with tiny models (seconds)
    python benchmarks/gpu_checks.py --only attention_implementations onnx_export_of_a_trained_model

The checks are the functions marked `@check` below (their docstrings say what each asserts); those marked CUDA-only
(the Trainer runs: a Hub id from an offline cache, resuming after a kill, the DeiT recipe bit for bit, the EMA
update's cost, FSDP through `accelerate launch`) are skipped elsewhere with the reason, and `--trainer_on_cpu` runs
all but FSDP on CPU too (minutes). Exit status 1 when any check failed; tests/test_gpu_checks.py runs the CPU part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_vit import (
    VisionTransformerConfig,
    VisionTransformerForImageClassification,
    VisionTransformerForMaskedPatchPrediction,
    VisionTransformerImageProcessor,
)
from hf_vit.analysis import attention_probabilities
from hf_vit.export import check_onnx, export

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "scripts" / "finetune.py"
FSDP_CONFIG = ROOT / "configs" / "accelerate" / "fsdp.yaml"
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# bf16 keeps 8 bits of mantissa: implementations that sum in another order differ by a few units of the last place
# of the activations, which grows through the blocks. Relative to the largest logit.
BF16_RELATIVE_TOLERANCE = 3e-2
FP32_TOLERANCE = 1e-4
ONNX_TOLERANCE = 1e-3
HUB_COMMIT = "5m0ke" * 8
HUB_REPO_ID = "hf-vit-smoke/vit-tiny"


class Skipped(Exception):
    """A check that cannot run here; the message is the reason."""


@dataclass
class Smoke:
    """What the checks share: the device, the model sizes for it and a scratch folder."""

    device: torch.device
    scratch: Path
    trainer_on_cpu: bool = False
    log: Callable[[str], None] = print
    details: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def config(self, **overrides) -> VisionTransformerConfig:
        """ViT-S/16 cut to 4 blocks at 224 on a GPU (real kernel shapes); 2 tiny blocks at 32x32 on CPU."""
        if self.cuda:
            return VisionTransformerConfig.from_preset(
                "vit-small-patch16-224", **{"num_hidden_layers": 4, "num_labels": 10, **overrides}
            )
        tiny = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
        return VisionTransformerConfig(**{**tiny, "intermediate_size": 128, "num_labels": 10, **overrides})

    def classifier(self, config: VisionTransformerConfig) -> VisionTransformerForImageClassification:
        """`config`'s classification model on the device, seeded and `randomised`."""
        torch.manual_seed(0)
        return randomised(VisionTransformerForImageClassification(config)).to(self.device)

    def pixels(self, config: VisionTransformerConfig, batch: int = 4, size: tuple[int, int] | None = None):
        generator = torch.Generator().manual_seed(0)
        height, width = size or config.image_hw
        return torch.randn(batch, config.num_channels, height, width, generator=generator).to(self.device)


def randomised(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Non-trivial values everywhere (a zero head or identity LayerNorms would make logit checks vacuous)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(param.device) * 0.02)
    return model


def autocast_steps(smoke: Smoke, model: torch.nn.Module, steps: int, **inputs) -> list:
    """`steps` AdamW steps (lr 1e-3) of `model(**inputs)`'s loss in bf16 autocast, each after `manual_seed(step)`; a
    `patch_corruption` the output returns goes into the next call. Returns the losses."""
    optimizer, losses = torch.optim.AdamW(model.parameters(), lr=1e-3), []
    for step in range(steps):
        torch.manual_seed(step)
        with torch.autocast(smoke.device.type, dtype=torch.bfloat16):
            output = model(**inputs)
        if hasattr(output, "patch_corruption"):
            inputs["patch_corruption"] = output.patch_corruption
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(output.loss.item())
    return losses


def relative_difference(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.float()
    return float((value.float() - reference).abs().max() / reference.abs().max().clamp(min=1e-6))


# ------------------------------------------------------------------------------------------------------ the checks

CHECKS: dict[str, tuple[Callable[[Smoke], str], bool]] = {}


def check(cuda_only: bool = False):
    def register(function: Callable[[Smoke], str]) -> Callable[[Smoke], str]:
        CHECKS[function.__name__] = (function, cuda_only)
        return function

    return register


@check()
def attention_implementations(smoke: Smoke) -> str:
    """Every implementation that loads gives eager's logits (bf16 weights, relative tolerance 3e-2)."""
    folder = smoke.scratch / "attention_model"
    torch.manual_seed(0)
    randomised(VisionTransformerForImageClassification(smoke.config())).save_pretrained(folder)
    pixels = smoke.pixels(smoke.config()).to(torch.bfloat16)
    shown = against_eager(smoke, folder, {"pixel_values": pixels}, "attention_implementations", "logits")
    return f"against eager: {shown}"


def against_eager(smoke: Smoke, folder: Path, inputs: dict[str, torch.Tensor], name: str, what: str) -> str:
    """The saved classifier in every attention implementation that loads (bf16) on `inputs`, each against eager's
    logits (relative tolerance `BF16_RELATIVE_TOLERANCE`); eager and SDPA must load. Records the differences and the
    implementations that did not load under `smoke.details[name]`; returns them as text."""
    logits, skipped = {}, {}
    for implementation in ATTENTION_IMPLEMENTATIONS:
        try:
            model = VisionTransformerForImageClassification.from_pretrained(
                folder, attn_implementation=implementation, dtype=torch.bfloat16
            )
            with torch.no_grad():
                logits[implementation] = model.to(smoke.device).eval()(**inputs).logits.float()
        except Exception as error:  # noqa: BLE001 - an implementation that does not load or run here is skipped
            if implementation in ("eager", "sdpa"):
                raise
            skipped[implementation] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    differences = {key: relative_difference(value, logits["eager"]) for key, value in logits.items()}
    bad = {key: value for key, value in differences.items() if value > BF16_RELATIVE_TOLERANCE}
    if bad:
        raise AssertionError(f"{what} differ from eager's beyond {BF16_RELATIVE_TOLERANCE}: {bad}")
    smoke.details[name] = {"relative_difference": differences, "skipped": skipped}
    shown = ", ".join(f"{key} {value:.1e}" for key, value in differences.items() if key != "eager")
    return shown + (f"; did not load: {', '.join(skipped)}" if skipped else "")


@check()
def gradient_checkpointing(smoke: Smoke) -> str:
    """The same loss and gradients with and without checkpointing (fp32, dropout off, attention sdpa)."""
    config = smoke.config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    model = smoke.classifier(config).train()
    pixels = smoke.pixels(config)
    labels = torch.arange(pixels.shape[0], device=smoke.device) % config.num_labels
    # A checkpointed block runs again during the backward: count the forwards of the first block's MLP.
    mlp = next(module for module in model.modules() if type(module).__name__ == "VisionTransformerMLP")
    calls = []
    mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # at entry: the recompute may stop early
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    results, forwards = [], []
    for enabled in (False, True):
        if enabled:
            enable()
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = model(pixels, labels=labels).loss
        loss.backward()
        forwards.append(len(calls))
        results.append((loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}))
    if forwards != [1, 2]:
        raise AssertionError(f"the first block's MLP ran {forwards} times without / with checkpointing, not [1, 2]")
    (loss, plain), (loss_ckpt, ckpt) = results
    worst = max(relative_difference(ckpt[name], plain[name]) for name in plain)
    if abs(float(loss - loss_ckpt)) > FP32_TOLERANCE or worst > 1e-3:
        raise AssertionError(f"loss {float(loss):.6f} vs {float(loss_ckpt):.6f}, gradients differ by {worst:.1e}")
    return f"the block recomputed in the backward; {len(plain)} gradients equal within {worst:.1e} (relative)"


@check()
def interpolate_pos_encoding(smoke: Smoke) -> str:
    """A non-square input with interpolated position embeddings; at the native size interpolation is the identity."""
    config = smoke.config()
    model = smoke.classifier(config).eval()
    patch = config.patch_size
    height, width = config.image_hw
    size = (height + 2 * patch, width - patch)  # taller and narrower: a non-square grid
    with torch.no_grad():
        wide = model(smoke.pixels(config, size=size), interpolate_pos_encoding=True).logits
        native = smoke.pixels(config)
        same = relative_difference(model(native, interpolate_pos_encoding=True).logits, model(native).logits)
        try:
            model(smoke.pixels(config, size=size))
        except ValueError:
            refused = True
        else:
            refused = False
    if tuple(wide.shape) != (4, config.num_labels) or not torch.isfinite(wide).all():
        raise AssertionError(f"logits of shape {tuple(wide.shape)} at {size}, or not finite")
    if same > FP32_TOLERANCE or not refused:
        raise AssertionError(f"native size differs by {same:.1e}; other size refused without the flag: {refused}")
    return f"{size[0]}x{size[1]} on a {height}x{width} model; identity at the native size ({same:.1e})"


@check()
def hybrid(smoke: Smoke) -> str:
    """A ResNet-stem hybrid trains one step in bf16 autocast and its bf16 logits follow the fp32 ones."""
    overrides = dict(resnet_layers=[1, 1], resnet_width=32, patch_size=8) if not smoke.cuda else {}
    if smoke.cuda:
        config = VisionTransformerConfig.from_preset("r50-vit-base-patch16-224", num_hidden_layers=2, num_labels=10)
    else:
        config = smoke.config(**overrides)
    model = smoke.classifier(config)
    pixels = smoke.pixels(config, batch=2)
    labels = torch.tensor([0, 1], device=smoke.device)
    model.eval()
    with torch.no_grad():
        fp32 = model(pixels).logits
        with torch.autocast(smoke.device.type, dtype=torch.bfloat16):
            bf16 = model(pixels).logits
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with torch.autocast(smoke.device.type, dtype=torch.bfloat16):
        loss = model(pixels, labels=labels).loss
    loss.backward()
    optimizer.step()
    difference = relative_difference(bf16, fp32)
    if not torch.isfinite(loss) or difference > BF16_RELATIVE_TOLERANCE:
        raise AssertionError(f"loss {float(loss)}, bf16 logits differ by {difference:.1e}")
    return f"stem {config.resnet_layers}, stride {config.stem_stride}; bf16 vs fp32 logits {difference:.1e}"


@check()
def masked_patch_prediction(smoke: Smoke) -> str:
    """The self-supervised objective: corrupted patches drawn in training, a finite loss that falls over steps."""
    config = smoke.config()
    torch.manual_seed(0)
    model = VisionTransformerForMaskedPatchPrediction(config).to(smoke.device).train()
    pixels = smoke.pixels(config, batch=8)
    patches = (config.image_hw[0] // config.patch_size) * (config.image_hw[1] // config.patch_size)
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, config.mpp_num_classes, (8, patches), generator=generator).to(smoke.device)
    losses = autocast_steps(smoke, model, 6, pixel_values=pixels, labels=labels, patch_corruption=None)
    if not all(torch.isfinite(torch.tensor(losses))) or not losses[-1] < losses[0]:
        raise AssertionError(f"losses {losses}")
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps on one batch"


@check()
def attention_capture(smoke: Smoke) -> str:
    """`hf_vit.analysis.attention_probabilities` on an SDPA model equals `output_attentions=True` (eager)."""
    config = smoke.config()
    model = smoke.classifier(config).eval()
    pixels = smoke.pixels(config, batch=2)
    captured = attention_probabilities(model, pixels, layers=[0, -1])
    with torch.no_grad():
        returned = model(pixels, output_attentions=True).attentions
    last = config.num_hidden_layers - 1
    if sorted(captured) != [0, last]:
        raise AssertionError(f"captured layers {sorted(captured)}, expected [0, {last}]")
    worst = max(float((captured[i].to(returned[i].device) - returned[i]).abs().max()) for i in (0, last))
    sums = float((captured[0].sum(-1) - 1).abs().max())
    if worst > FP32_TOLERANCE or sums > FP32_TOLERANCE:
        raise AssertionError(f"captured vs output_attentions differ by {worst:.1e}; rows sum to 1 within {sums:.1e}")
    return f"layers 0 and {last}, shape {tuple(captured[0].shape)}, equal to output_attentions within {worst:.1e}"


@check()
def onnx_export_of_a_trained_model(smoke: Smoke) -> str:
    """Train a few steps on the device, export to ONNX, and compare onnxruntime with the model at two sizes."""
    config = smoke.config()
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(config).to(smoke.device).train()
    labels = torch.arange(8, device=smoke.device) % config.num_labels
    autocast_steps(smoke, model, 3, pixel_values=smoke.pixels(config, batch=8), labels=labels)
    if float(model.classifier.weight.abs().max()) == 0:
        raise AssertionError("training did not move the (zero-initialised) classifier")
    model.eval()
    path = export(model, smoke.scratch / "trained.onnx", "onnx")
    height, width = config.image_hw
    patch = config.patch_size
    differences = check_onnx(path, model.cpu(), [(height, width), (height + patch, width - patch)])
    if max(differences.values()) > ONNX_TOLERANCE:
        raise AssertionError(f"onnxruntime differs from the model: {differences}")
    return f"{path.stat().st_size / 2**20:.1f} MiB; onnxruntime vs PyTorch: " + ", ".join(
        f"{size} {value:.1e}" for size, value in differences.items()
    )


# ------------------------------------------------------------------------------------------- Trainer on the GPU


@check()
def native_aspect_batches(smoke: Smoke) -> str:
    """A padded native-aspect batch (the processor's `max_num_patches`) gives eager's logits in every attention
    implementation that loads (bf16): flash attention takes the padding mask, flex attention a block mask."""
    config = smoke.config()
    folder = smoke.scratch / "native_model"
    smoke.classifier(config).save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    shapes = [(224, 224), (120, 400), (500, 90), (64, 64)] if smoke.cuda else [(40, 40), (20, 80), (90, 30)]
    images = [torch.randint(0, 256, (3, *shape), generator=generator, dtype=torch.uint8) for shape in shapes]
    processor = VisionTransformerImageProcessor(max_num_patches=config.num_patches, patch_size=config.patch_size)
    inputs = {name: value.to(smoke.device) for name, value in processor(images, return_tensors="pt").items()}
    if bool((inputs["spatial_shapes"].prod(-1) == inputs["pixel_values"].shape[1]).all()):
        raise AssertionError("the batch has no padding: the check would not test the mask")
    shown = against_eager(smoke, folder, inputs, "native_aspect_batches", "native-batch logits")
    return f"grids {inputs['spatial_shapes'].tolist()}, against eager: {shown}"


def hub_cache_with(smoke: Smoke, repo_id: str) -> Path:
    """An offline Hub cache holding a tiny hf-vit checkpoint as `repo_id` (refs/main -> snapshots/<commit>)."""
    cache = smoke.scratch / "hub"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / HUB_COMMIT
    if not snapshot.is_dir():
        config = smoke.config()
        torch.manual_seed(0)
        VisionTransformerForImageClassification(config).save_pretrained(snapshot)
        VisionTransformerImageProcessor(size=config.image_hw[0]).save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(HUB_COMMIT)
    return cache


def trainer_env(smoke: Smoke) -> dict[str, str]:
    offline = dict.fromkeys(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"), "1")
    return {**os.environ, "HF_HUB_CACHE": str(hub_cache_with(smoke, HUB_REPO_ID)), **offline}


def finetune_args(output_dir: Path, max_steps: int, extra=(), learning_rate: float = 0.03) -> list[str]:
    return [
        "--model_name_or_path", HUB_REPO_ID,
        "--dataset_name", "digits",
        "--output_dir", str(output_dir),
        "--max_steps", str(max_steps),
        "--per_device_train_batch_size", "32",
        "--per_device_eval_batch_size", "64",
        "--learning_rate", str(learning_rate),
        "--eval_strategy", "no",
        "--logging_steps", "5",
        "--seed", "0",
        *extra,
    ]  # fmt: skip


def _trainer_skip(smoke: Smoke, cpu_ok: bool) -> None:
    if not smoke.cuda and not (cpu_ok and smoke.trainer_on_cpu):
        raise Skipped("needs CUDA (no GPU here)" + ("; --trainer_on_cpu runs it on CPU" if cpu_ok else ""))


def _run(command: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise AssertionError(f"exit status {done.returncode}: {done.stderr.strip()[-1500:]}")
    return done


def _final_metrics(output_dir: Path) -> dict:
    metrics = json.loads((output_dir / "all_results.json").read_text())
    if not all(torch.isfinite(torch.tensor(float(metrics[key]))) for key in ("train_loss", "eval_accuracy")):
        raise AssertionError(f"non-finite metrics: {metrics}")
    return metrics


@check(cuda_only=True)
def finetune_bf16_compiled_from_hub_id(smoke: Smoke) -> str:
    """`finetune.py --bf16 --torch_compile --model_name_or_path <Hub id>` with the checkpoint in an offline cache."""
    _trainer_skip(smoke, cpu_ok=True)
    output_dir = smoke.scratch / "finetune"
    extra = ["--bf16", "--torch_compile"] if smoke.cuda else ["--bf16"]
    start = time.perf_counter()
    _run([sys.executable, str(FINETUNE), *finetune_args(output_dir, 40, extra)], trainer_env(smoke))
    metrics = _final_metrics(output_dir)
    loaded = VisionTransformerForImageClassification.from_pretrained(output_dir)
    if loaded.config.num_labels != 10:
        raise AssertionError(f"saved model has {loaded.config.num_labels} labels, digits has 10")
    return (
        f"{' '.join(extra)}: 40 steps in {time.perf_counter() - start:.0f} s, train loss {metrics['train_loss']:.3f}, "
        f"eval accuracy {metrics['eval_accuracy']:.3f}"
    )


def _folder_and_steps(args: list[str]) -> tuple[Path, int]:
    """The `--output_dir` and `--max_steps` of finetune.py's arguments."""
    return Path(args[args.index("--output_dir") + 1]), int(args[args.index("--max_steps") + 1])


def kill_after_a_checkpoint(smoke: Smoke, args: list[str], env: dict[str, str], name: str) -> int:
    """Start `finetune.py args` and SIGKILL it once it has saved a checkpoint; returns the last checkpoint's step
    (which must be before the run's end). Its output goes to `<scratch>/<name>-killed.log`."""
    output_dir, max_steps = _folder_and_steps(args)
    with open(smoke.scratch / f"{name}-killed.log", "w") as log:
        # Its own process group, killed whole as a scheduler kills a job: SIGKILL to the main process alone leaves
        # its DataLoader workers alive for a few seconds, holding the output folder's lock (inherited over fork).
        process = subprocess.Popen(
            [sys.executable, str(FINETUNE), *args], stdout=log, stderr=log, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and process.poll() is None:
                saved = [p for p in output_dir.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
                if saved:
                    time.sleep(1.0)  # let the checkpoint's files land
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"no checkpoint within the time limit (exit status {process.poll()})")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    killed_at = max(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))
    if killed_at >= max_steps:
        raise AssertionError("the run finished before it could be killed")
    return killed_at


def resume_to_the_end(smoke: Smoke, args: list[str], env: dict[str, str], killed_at: int, name: str) -> int:
    """`finetune.py args --resume_from_checkpoint True`: it must say that it resumes from step `killed_at` and end
    at `--max_steps`. Returns the step it resumed from; its output goes to `<scratch>/<name>-resumed.log`."""
    output_dir, max_steps = _folder_and_steps(args)
    # --log_level info: Trainer then says from which step it resumes. The output goes to the log as it comes, so that
    # a run that stalls (a --recipe deit resume on an H200 did not end within 200 s) leaves where it stopped.
    log = smoke.scratch / f"{name}-resumed.log"
    command = [sys.executable, str(FINETUNE), *args, "--resume_from_checkpoint", "True", "--log_level", "info"]
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900, cwd=ROOT)
    said = log.read_text()
    if done.returncode != 0:
        raise AssertionError(f"exit status {done.returncode}: {said.strip()[-1500:]}")
    state = json.loads((output_dir / "trainer_state.json").read_text())
    resumed = re.search(r"Resuming training from checkpoint with epoch \d+ and global step (\d+)", said)
    if resumed is None or int(resumed[1]) != killed_at or state["global_step"] != max_steps:
        raise AssertionError(
            f"the second run did not resume from checkpoint-{killed_at} ({resumed and resumed[0]!r}) or ended at step "
            f"{state['global_step']}, not {max_steps}; its output is in {log}"
        )
    return int(resumed[1])


@check(cuda_only=True)
def resume_after_a_kill(smoke: Smoke) -> str:
    """Kill a run (SIGKILL) once it has saved a checkpoint; `--resume_from_checkpoint True` then finishes it."""
    _trainer_skip(smoke, cpu_ok=True)
    max_steps = 60
    args = finetune_args(smoke.scratch / "resume", max_steps, ["--save_strategy", "steps", "--save_steps", "10"])
    args += ["--bf16"] if smoke.cuda else []
    env = trainer_env(smoke)
    killed_at = kill_after_a_checkpoint(smoke, args, env, "resume")
    resumed = resume_to_the_end(smoke, args, env, killed_at, "resume")
    _final_metrics(smoke.scratch / "resume")
    return f"killed after checkpoint-{killed_at}, resumed from step {resumed} to {max_steps}"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _differing(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not bit for bit equal (or missing from one side)."""
    return sorted(
        name
        for name in first.keys() | second.keys()
        if name not in first or name not in second or not torch.equal(first[name], second[name])
    )


RECIPE_STEPS = 60  # at 12 steps an H200 finished the run before the kill could land


@check(cuda_only=True)
def recipe_deit_resumes_bit_for_bit(smoke: Smoke) -> str:
    """`finetune.py --recipe deit --layer_decay 0.75 --bf16` (RandAugment, random erasing, Mixup/CutMix, label
    smoothing, stochastic depth, AdamW in layer-decay groups, EMA with warmup) for 60 steps, a checkpoint every 10:
    the saved model is the EMA, equal to the last checkpoint's EMA state and not to its raw weights; a second run,
    killed after its first checkpoint and resumed, ends bit for bit as the first (model, raw weights and EMA).
    Eager attention and `--full_determinism`: SDPA's fused backward kernels may sum with atomics, cuDNN may choose
    non-deterministic kernels, so that two uninterrupted runs would differ in the last bits without them."""
    _trainer_skip(smoke, cpu_ok=True)
    from hf_vit.train.ema import EMA_FILE

    extra = ["--recipe", "deit", "--layer_decay", "0.75", "--save_strategy", "steps", "--save_steps", "10"]
    extra += ["--attn_implementation", "eager", "--full_determinism", "True"]
    extra += ["--bf16"] if smoke.cuda else []
    env = trainer_env(smoke)
    straight, killed = smoke.scratch / "deit", smoke.scratch / "deit_killed"
    start = time.perf_counter()
    args = finetune_args(straight, RECIPE_STEPS, extra, learning_rate=5e-4)
    done = _run([sys.executable, str(FINETUNE), *args, "--log_level", "info"], env)
    (smoke.scratch / "deit.log").write_text(done.stdout + done.stderr)
    seconds = time.perf_counter() - start
    for said in ("Training with the recipe deit", "Layer-wise learning-rate decay 0.75"):
        if said not in done.stderr:
            raise AssertionError(f"the run's log does not say {said!r}: the recipe was not applied")
    metrics = _final_metrics(straight)
    last = straight / f"checkpoint-{RECIPE_STEPS}"
    final, raw, average = (
        _tensors(p) for p in (straight / "model.safetensors", last / "model.safetensors", last / EMA_FILE)
    )
    if not average or not average.keys() <= final.keys():
        raise AssertionError(f"{EMA_FILE} holds {len(average)} tensors, not a subset of the model's {len(final)}")
    if _differing({k: final[k] for k in average}, average):
        raise AssertionError("the saved model.safetensors is not the EMA state of the last checkpoint")
    if not _differing({k: raw[k] for k in average}, average):
        raise AssertionError("the EMA equals the raw weights: the average did not average (or was never updated)")
    again = finetune_args(killed, RECIPE_STEPS, extra, learning_rate=5e-4)
    killed_at = kill_after_a_checkpoint(smoke, again, env, "deit")
    resume_to_the_end(smoke, again, env, killed_at, "deit")
    differing = {}
    for name in (
        "model.safetensors",
        *(f"checkpoint-{RECIPE_STEPS}/{file}" for file in ("model.safetensors", EMA_FILE)),
    ):
        first, again = _tensors(straight / name), _tensors(killed / name)
        if names := _differing(first, again):
            gaps = [
                float((first[n].float() - again[n].float()).abs().max()) for n in names if n in first and n in again
            ]
            differing[name] = {"tensors": len(names), "largest": max(gaps)}
    smoke.details["recipe_deit_resumes_bit_for_bit"] = {
        "straight_seconds": seconds, "killed_after": killed_at, "differing": differing,
        "train_loss": metrics["train_loss"], "eval_accuracy": metrics["eval_accuracy"],
    }  # fmt: skip
    if differing:
        raise AssertionError(f"the resumed run differs from the uninterrupted one: {differing}")
    return (
        f"{RECIPE_STEPS} steps in {seconds:.0f} s, eval accuracy {metrics['eval_accuracy']:.3f}; the model is the "
        f"EMA ({len(average)} tensors); killed after checkpoint-{killed_at}, resumed: equal bit for bit"
    )


@check(cuda_only=True)
def ema_update_cost(smoke: Smoke) -> str:
    """The EMA update (`WeightAverage.update`) is one `_foreach_lerp_` over every trained tensor (on CUDA the
    multi-tensor kernels: far fewer launches than tensors), and its time as a fraction of a ViT-S/16 bf16 training
    step (`benchmarks/recipes_speed.py`'s `ema_cost` on the device, batch 256; on CPU batch 2, fp32)."""
    _trainer_skip(smoke, cpu_ok=True)
    from torch.profiler import ProfilerActivity, profile

    if str(ROOT) not in sys.path:  # run as `python benchmarks/gpu_checks.py`: the `benchmarks` package from the root
        sys.path.insert(0, str(ROOT))
    from benchmarks.recipes_speed import ema_cost
    from benchmarks.timing import synchronize
    from hf_vit.train.ema import WeightAverage

    model = smoke.classifier(smoke.config(num_hidden_layers=12) if smoke.cuda else smoke.config())
    average = WeightAverage(model, 0.999)
    average.update(1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if smoke.cuda else [])
    with profile(activities=activities) as profiled:
        average.update(2)
        synchronize(smoke.device)
    events = profiled.events()
    calls = sum(event.name == "aten::_foreach_lerp_" for event in events)
    kernels = [event.name for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    tensors = len(average.params)
    if calls != 1:
        raise AssertionError(f"the update made {calls} aten::_foreach_lerp_ calls, not 1")
    if smoke.cuda and not (0 < len(kernels) < tensors / 4 and any("multi_tensor" in name for name in kernels)):
        raise AssertionError(
            f"the update launched {len(kernels)} kernels for {tensors} tensors ({sorted(set(kernels))[:3]}): not the "
            "multi-tensor (foreach) path"
        )
    on = {str(a.device) for a in average.averages}
    if on != {str(p.device) for p in average.params}:
        raise AssertionError(f"the averages are on {on}, the weights on {[str(p.device) for p in average.params][:1]}")
    del model, average
    batch = 256 if smoke.cuda else 2
    dtype, rounds = ("bf16", 5) if smoke.cuda else ("fp32", 2)
    cost = ema_cost(batch, repeats=rounds, steps=rounds if smoke.cuda else 1, device=str(smoke.device), dtype=dtype)
    smoke.details["ema_update_cost"] = cost = {**cost, "kernels_per_update": len(kernels), "tensors": tensors}
    seconds = cost["seconds"]
    return (
        f"{tensors} tensors, {len(kernels)} kernels per update on {sorted(on)}; "
        f"ViT-S/16 {cost['dtype']} batch {batch}: "
        f"step {seconds['training step'] * 1e3:.1f} ms, EMA update {seconds['EMA update'] * 1e3:.2f} ms "
        f"({cost['update_over_step']:.2%} of the step; step + update / step {cost['with_over_without']:.3f})"
    )


@check(cuda_only=True)
def fsdp_through_accelerate(smoke: Smoke) -> str:
    """`accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 1 scripts/finetune.py`: the
    checkpoints are FSDP's sharded ones (the wrapper was FSDP), the final model.safetensors is whole."""
    if not smoke.cuda:
        raise Skipped(
            "needs CUDA: accelerate enables FSDP only for GPU process groups (finetune.py refuses --fsdp on CPU)"
        )
    output_dir = smoke.scratch / "fsdp"
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    if accelerate is None:
        raise AssertionError("the accelerate command is not installed")
    command = [accelerate, "launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "1", str(FINETUNE)]
    command += finetune_args(output_dir, 20, ["--save_strategy", "steps", "--save_steps", "10", "--bf16"])
    _run(command, trainer_env(smoke))
    checkpoints = sorted(output_dir.glob("checkpoint-*"))
    if not checkpoints:
        raise AssertionError("no checkpoint was saved")
    sharded = [p.name for p in checkpoints[-1].iterdir() if p.name.startswith(("pytorch_model_fsdp", "optimizer_0"))]
    if not sharded or (checkpoints[-1] / "optimizer.pt").exists():
        raise AssertionError(
            f"{checkpoints[-1].name} holds {sorted(p.name for p in checkpoints[-1].iterdir())}: not FSDP's sharded "
            "state (pytorch_model_fsdp_0/, optimizer_0/)"
        )
    if not (output_dir / "model.safetensors").is_file():
        held = sorted(p.name for p in output_dir.iterdir())
        raise AssertionError(
            f"no consolidated model.safetensors in {output_dir} (it holds {held}): Trainer.save_model writes the "
            "whole model under FSDP only with FULL_STATE_DICT, and "
            "configs/accelerate/fsdp.yaml asks for SHARDED_STATE_DICT (for the checkpoints)"
        )
    loaded = VisionTransformerForImageClassification.from_pretrained(output_dir)
    reference = VisionTransformerForImageClassification(loaded.config)
    shapes = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    if {name: tuple(t.shape) for name, t in loaded.state_dict().items()} != shapes:
        raise AssertionError("the saved model's tensors are not the whole model's (not consolidated)")
    metrics = _final_metrics(output_dir)
    return f"checkpoint {checkpoints[-1].name}: {sorted(sharded)}; consolidated model, eval accuracy " + (
        f"{metrics['eval_accuracy']:.3f}"
    )


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", nargs="+", default=None, metavar="CHECK", help=f"some of: {', '.join(CHECKS)}")
    parser.add_argument(
        "--trainer_on_cpu", action="store_true", help="run the Hub-id, resume, recipe and EMA checks on CPU too"
    )
    parser.add_argument("--json", default=None, help="write every check's outcome and details here")
    parser.add_argument("--keep", default=None, help="scratch folder to keep (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(CHECKS))
    if unknown:
        parser.error(f"unknown check(s) {unknown}; the checks are {list(CHECKS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but CUDA is not available here; use --device cpu")
    return args


def run_checks(
    smoke: Smoke, names: list[str], after_each: Callable[[dict[str, dict]], None] = lambda outcomes: None
) -> dict[str, dict]:
    """Run the named checks in order; `after_each` sees the outcomes so far (to keep them if the run is stopped)."""
    outcomes = {}
    for name in names:
        function, _ = CHECKS[name]
        start = time.perf_counter()
        try:
            detail = function(smoke)
            status = "passed"
        except Skipped as reason:
            status, detail = "skipped", str(reason)
        except Exception as error:  # noqa: BLE001 - a failing check is reported, and the others still run
            status, detail = "failed", f"{type(error).__name__}: {error}"
            if os.environ.get("HF_VIT_TRACEBACK"):
                traceback.print_exc()
        seconds = time.perf_counter() - start
        outcomes[name] = {"status": status, "detail": detail, "seconds": seconds}
        smoke.log(f"{status:7s} {name} ({seconds:.1f} s): {detail}")
        after_each(outcomes)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons mean fp32
        torch.backends.cudnn.allow_tf32 = False
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"hf-vit smoke checks on {device} ({where}), torch {torch.__version__}", flush=True)
    with contextlib.ExitStack() as stack:
        if args.keep:
            scratch = Path(args.keep)
            scratch.mkdir(parents=True, exist_ok=True)
        else:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hf-vit-smoke-")))
        smoke = Smoke(device, scratch, args.trainer_on_cpu, log=lambda line: print(line, flush=True))

        def write(outcomes: dict[str, dict]) -> None:  # after every check: a run stopped by a time limit keeps them
            if args.json:
                report = {"device": str(device), "name": where, "torch": torch.__version__, "checks": outcomes}
                report["details"] = smoke.details
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")

        outcomes = run_checks(smoke, args.only or list(CHECKS), write)
    counts = {
        status: sum(o["status"] == status for o in outcomes.values()) for status in ("passed", "failed", "skipped")
    }
    print(", ".join(f"{count} {status}" for status, count in counts.items()))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
