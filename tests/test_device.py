"""Every path of hf-vit on a device, one test each, saying its one-line result: on CPU (the default) with tiny models
in the normal suite, on a GPU with real kernel shapes (a few minutes):

    pytest tests/test_device.py -q -s -rA --device cuda --junitxml smoke.xml -o junit_family=xunit1
    pytest tests/test_device.py -q -s --device cpu --trainer_on_cpu -k resume    # a Trainer check on CPU (minutes)

The Trainer runs (a Hub id from an offline cache, resuming after a kill, the DeiT recipe bit for bit, the EMA update's
cost, FSDP through `accelerate launch`) are skipped off CUDA with the reason; `--trainer_on_cpu` runs all but FSDP on
CPU too. Each test records its result as the junit property "detail".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed with hf_vit

from benchmarks.models import build_hf_vit  # noqa: E402
from hf_vit import (  # noqa: E402
    VisionTransformerConfig,
    VisionTransformerForImageClassification,
    VisionTransformerForMaskedPatchPrediction,
    VisionTransformerImageProcessor,
)
from hf_vit.analysis import attention_probabilities  # noqa: E402
from hf_vit.export import check_onnx, export  # noqa: E402

FINETUNE = ROOT / "scripts" / "finetune.py"
FSDP_CONFIG = ROOT / "configs" / "accelerate" / "fsdp.yaml"
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# bf16 keeps 8 bits of mantissa: implementations that sum in another order differ by a few units of the last place
# of the activations, which grows through the blocks. Relative to the largest logit.
BF16_RELATIVE_TOLERANCE = 3e-2
FP32_TOLERANCE = 1e-4
ONNX_TOLERANCE = 1e-3
HUB_COMMIT = "5e0ce" * 8  # 40 hex digits: transformers resolves the revision, and takes anything else for a branch
HUB_REPO_ID = "hf-vit-smoke/vit-tiny"
TRAINER = "needs CUDA (no GPU here); --trainer_on_cpu runs it on CPU"  # a Trainer check's reason to be skipped
FSDP = "needs CUDA: accelerate enables FSDP only for GPU process groups (finetune.py refuses --fsdp on CPU)"


@dataclass
class Smoke:
    """What the checks share: the device, the model sizes for it and a scratch folder."""

    device: torch.device
    scratch: Path

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

    def pixels(self, config: VisionTransformerConfig, batch: int = 4, size: tuple[int, int] | None = None):
        generator = torch.Generator().manual_seed(0)
        height, width = size or config.image_hw
        return torch.randn(batch, config.num_channels, height, width, generator=generator).to(self.device)


@pytest.fixture(scope="module")
def smoke(request, tmp_path_factory, record_testsuite_property) -> Smoke:
    """`--device` (default cpu) and a scratch folder the checks share (`--basetemp` keeps it: the Trainer logs)."""
    device = torch.device(request.config.getoption("--device"))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 comparisons: fp32
    record_testsuite_property("device", f"{device} ({where}), torch {torch.__version__}")
    print(f"\nhf-vit device checks on {device} ({where}), torch {torch.__version__}")
    return Smoke(device, tmp_path_factory.mktemp("smoke", numbered=False))


@pytest.fixture
def trainer_smoke(smoke, request) -> Smoke:
    """`smoke` for a Trainer check: skipped off CUDA unless --trainer_on_cpu."""
    if not smoke.cuda and not request.config.getoption("--trainer_on_cpu"):
        pytest.skip(TRAINER)
    return smoke


@pytest.fixture
def say(record_property):
    """Prints a check's one-line result and records it (and any other `details`) as junit properties."""

    def say(detail: str, **details) -> None:
        print(f" {detail}", flush=True)
        for name, value in {"detail": detail, **details}.items():
            record_property(name, value)

    return say


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


def test_attention_implementations(smoke, say):
    """Every implementation that loads gives eager's logits (bf16 weights, relative tolerance 3e-2)."""
    config = smoke.config()
    pixels = smoke.pixels(config).to(torch.bfloat16)
    shown, differences, skipped = against_eager(smoke, config, {"pixel_values": pixels}, "attention_implementations")
    assert "sdpa" in differences and differences["eager"] == 0.0, differences
    assert smoke.cuda or skipped.get("flash_attention_2"), f"flash attention loaded on CPU: {skipped}"
    say("against eager: " + shown, relative_difference=differences, skipped=skipped)


def against_eager(smoke: Smoke, config: VisionTransformerConfig, inputs: dict, name: str, what: str = "logits"):
    """`config`'s classifier loaded in each attention implementation (bf16; eager and SDPA must load) on `inputs`:
    the result line, the differences from eager and the implementations that did not load (with their errors)."""
    folder, logits, skipped = smoke.scratch / name, {}, {}
    build_hf_vit(config).save_pretrained(folder)
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
    assert not bad, f"{what} differ from eager's beyond {BF16_RELATIVE_TOLERANCE}: {bad}"
    shown = ", ".join(f"{key} {value:.1e}" for key, value in differences.items() if key != "eager")
    return shown + (f"; did not load: {', '.join(skipped)}" if skipped else ""), differences, skipped


def test_gradient_checkpointing(smoke, say):
    """The same loss and gradients with and without checkpointing (fp32, dropout off, attention sdpa)."""
    config = smoke.config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    model = build_hf_vit(config).to(smoke.device).train()
    pixels = smoke.pixels(config)
    labels = torch.arange(pixels.shape[0], device=smoke.device) % config.num_labels
    # A checkpointed block runs again during the backward: count the forwards of the first block's MLP.
    mlp = next(module for module in model.modules() if type(module).__name__ == "VisionTransformerMLP")
    calls = []
    mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # at entry: the recompute may stop early
    results, forwards = [], []
    for enabled in (False, True):
        if enabled:
            model.gradient_checkpointing_enable()
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = model(pixels, labels=labels).loss
        loss.backward()
        forwards.append(len(calls))
        results.append((loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}))
    assert forwards == [1, 2], f"the first block's MLP ran {forwards} times without / with checkpointing, not [1, 2]"
    (loss, plain), (loss_ckpt, ckpt) = results
    worst = max(relative_difference(ckpt[name], plain[name]) for name in plain)
    assert abs(float(loss - loss_ckpt)) <= FP32_TOLERANCE and worst <= 1e-3, (
        f"loss {float(loss):.6f} vs {float(loss_ckpt):.6f}, gradients differ by {worst:.1e}"
    )
    say(f"the block recomputed in the backward; {len(plain)} gradients equal within {worst:.1e} (relative)")


def test_interpolate_pos_encoding(smoke, say):
    """A non-square input with interpolated position embeddings; at the native size interpolation is the identity."""
    config = smoke.config()
    model = build_hf_vit(config).to(smoke.device).eval()
    height, width = config.image_hw
    size = (height + 2 * config.patch_size, width - config.patch_size)  # taller and narrower: a non-square grid
    native = smoke.pixels(config)
    with torch.no_grad():
        wide = model(smoke.pixels(config, size=size), interpolate_pos_encoding=True).logits
        same = relative_difference(model(native, interpolate_pos_encoding=True).logits, model(native).logits)
        refused = True
        with contextlib.suppress(ValueError):
            model(smoke.pixels(config, size=size))
            refused = False
    shape = tuple(wide.shape)
    assert shape == (4, config.num_labels) and torch.isfinite(wide).all(), f"logits {shape} at {size}, or not finite"
    assert same <= FP32_TOLERANCE and refused, (
        f"native size differs by {same:.1e}; other size refused without the flag: {refused}"
    )
    say(f"{size[0]}x{size[1]} on a {height}x{width} model; identity at the native size ({same:.1e})")


def test_hybrid(smoke, say):
    """A ResNet-stem hybrid trains one step in bf16 autocast and its bf16 logits follow the fp32 ones."""
    if smoke.cuda:
        config = VisionTransformerConfig.from_preset("r50-vit-base-patch16-224", num_hidden_layers=2, num_labels=10)
    else:
        config = smoke.config(resnet_layers=[1, 1], resnet_width=32, patch_size=8)
    model = build_hf_vit(config).to(smoke.device).eval()
    pixels = smoke.pixels(config, batch=2)
    with torch.no_grad():
        fp32 = model(pixels).logits
        with torch.autocast(smoke.device.type, dtype=torch.bfloat16):
            bf16 = model(pixels).logits
    (loss,) = autocast_steps(smoke, model.train(), 1, pixel_values=pixels, labels=torch.arange(2, device=smoke.device))
    difference = relative_difference(bf16, fp32)
    assert math.isfinite(loss) and difference <= BF16_RELATIVE_TOLERANCE, (
        f"loss {loss}, bf16 logits differ by {difference:.1e}"
    )
    say(f"stem {config.resnet_layers}, stride {config.stem_stride}; bf16 vs fp32 logits {difference:.1e}")


def test_masked_patch_prediction(smoke, say):
    """The self-supervised objective: corrupted patches drawn in training, a finite loss that falls over steps."""
    config = smoke.config()
    torch.manual_seed(0)
    model = VisionTransformerForMaskedPatchPrediction(config).to(smoke.device).train()
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, config.mpp_num_classes, (8, config.num_patches), generator=generator).to(smoke.device)
    pixels = smoke.pixels(config, batch=8)
    losses = autocast_steps(smoke, model, 6, pixel_values=pixels, labels=labels, patch_corruption=None)
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], f"losses {losses}"
    say(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps on one batch")


def test_attention_capture(smoke, say):
    """`hf_vit.analysis.attention_probabilities` on an SDPA model equals `output_attentions=True` (eager)."""
    config = smoke.config()
    model = build_hf_vit(config).to(smoke.device).eval()
    pixels = smoke.pixels(config, batch=2)
    captured = attention_probabilities(model, pixels, layers=[0, -1])
    with torch.no_grad():
        returned = model(pixels, output_attentions=True).attentions
    last = config.num_hidden_layers - 1
    assert sorted(captured) == [0, last], f"captured layers {sorted(captured)}, expected [0, {last}]"
    worst = max(float((captured[i].to(returned[i].device) - returned[i]).abs().max()) for i in (0, last))
    sums = float((captured[0].sum(-1) - 1).abs().max())
    assert worst <= FP32_TOLERANCE and sums <= FP32_TOLERANCE, (
        f"captured vs output_attentions differ by {worst:.1e}; rows sum to 1 within {sums:.1e}"
    )
    say(f"layers 0 and {last}, shape {tuple(captured[0].shape)}, equal to output_attentions within {worst:.1e}")


def test_onnx_export_of_a_trained_model(smoke, say):
    """Train a few steps on the device, export to ONNX, and compare onnxruntime with the model at two sizes."""
    config = smoke.config()
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(config).to(smoke.device).train()
    labels = torch.arange(8, device=smoke.device) % config.num_labels
    autocast_steps(smoke, model, 3, pixel_values=smoke.pixels(config, batch=8), labels=labels)
    assert model.classifier.weight.detach().abs().max() > 0, "training did not move the (zero-initialised) classifier"
    path = export(model.eval(), smoke.scratch / "trained.onnx", "onnx")
    (height, width), patch = config.image_hw, config.patch_size
    differences = check_onnx(path, model.cpu(), [(height, width), (height + patch, width - patch)])
    assert max(differences.values()) <= ONNX_TOLERANCE, f"onnxruntime differs from the model: {differences}"
    shown = ", ".join(f"{size} {value:.1e}" for size, value in differences.items())
    say(f"{path.stat().st_size / 2**20:.1f} MiB; onnxruntime vs PyTorch: {shown}")


def test_native_aspect_batches(smoke, say):
    """A padded native-aspect batch (the processor's `max_num_patches`) gives eager's logits in every attention
    implementation that loads (bf16): flash attention takes the padding mask, flex attention a block mask."""
    config = smoke.config()
    generator = torch.Generator().manual_seed(0)
    shapes = [(224, 224), (120, 400), (500, 90), (64, 64)] if smoke.cuda else [(40, 40), (20, 80), (90, 30)]
    images = [torch.randint(0, 256, (3, *shape), generator=generator, dtype=torch.uint8) for shape in shapes]
    processor = VisionTransformerImageProcessor(max_num_patches=config.num_patches, patch_size=config.patch_size)
    inputs = {name: value.to(smoke.device) for name, value in processor(images, return_tensors="pt").items()}
    padded = not bool((inputs["spatial_shapes"].prod(-1) == inputs["pixel_values"].shape[1]).all())
    assert padded, "the batch has no padding: the check would not test the mask"
    shown, differences, skipped = against_eager(smoke, config, inputs, "native_aspect_batches", "native-batch logits")
    grids = inputs["spatial_shapes"].tolist()
    say(f"grids {grids}, against eager: {shown}", relative_difference=differences, skipped=skipped)


# ------------------------------------------------------------------------------------------------- Trainer runs


def trainer_env(smoke: Smoke) -> dict[str, str]:
    """The environment of a `finetune.py` run: offline, with an offline Hub cache holding a tiny hf-vit checkpoint as
    `HUB_REPO_ID` (refs/main -> snapshots/<commit>)."""
    cache = smoke.scratch / "hub"
    repo = cache / f"models--{HUB_REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / HUB_COMMIT
    if not snapshot.is_dir():
        config = smoke.config()
        torch.manual_seed(0)
        VisionTransformerForImageClassification(config).save_pretrained(snapshot)
        VisionTransformerImageProcessor(size=config.image_hw[0]).save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(HUB_COMMIT)
    offline = dict.fromkeys(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"), "1")
    return {**os.environ, "HF_HUB_CACHE": str(cache), **offline}


def finetune_args(output_dir: Path, max_steps: int, extra=(), learning_rate: float = 0.03) -> list[str]:
    fixed = f"--model_name_or_path {HUB_REPO_ID} --dataset_name digits --per_device_train_batch_size 32"
    fixed += " --per_device_eval_batch_size 64 --eval_strategy no --logging_steps 5 --seed 0"
    mine = ["--output_dir", str(output_dir), "--max_steps", str(max_steps), "--learning_rate", str(learning_rate)]
    return [str(FINETUNE), *fixed.split(), *mine, *extra]


def run_logged(smoke: Smoke, command: list[str], env: dict[str, str], name: str) -> str:
    """`command` in the repository's root, its output going to `<scratch>/<name>.log` as it comes (a run that stalls
    leaves where it stopped); fails the check on a non-zero exit status. Returns the output."""
    log = smoke.scratch / f"{name}.log"
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900, cwd=ROOT)
    said = log.read_text()
    assert done.returncode == 0, f"exit status {done.returncode}: {said.strip()[-1500:]}"
    return said


def final_metrics(output_dir: Path) -> dict:
    metrics = json.loads((output_dir / "all_results.json").read_text())
    assert all(math.isfinite(metrics[k]) for k in ("train_loss", "eval_accuracy")), f"non-finite metrics: {metrics}"
    return metrics


def test_finetune_bf16_compiled_from_hub_id(trainer_smoke, say):
    """`finetune.py --bf16 --torch_compile --model_name_or_path <Hub id>` with the checkpoint in an offline cache."""
    smoke, output_dir = trainer_smoke, trainer_smoke.scratch / "finetune"
    extra = ["--bf16", "--torch_compile"] if smoke.cuda else ["--bf16"]
    start = time.perf_counter()
    run_logged(smoke, [sys.executable, *finetune_args(output_dir, 40, extra)], trainer_env(smoke), "finetune")
    metrics = final_metrics(output_dir)
    labels = VisionTransformerForImageClassification.from_pretrained(output_dir).config.num_labels
    assert labels == 10, f"saved model has {labels} labels, digits has 10"
    say(
        f"{' '.join(extra)}: 40 steps in {time.perf_counter() - start:.0f} s, train loss {metrics['train_loss']:.3f}, "
        f"eval accuracy {metrics['eval_accuracy']:.3f}"
    )


def kill_and_resume(smoke: Smoke, args: list[str], env: dict[str, str], name: str) -> int:
    """Start `finetune.py args`, SIGKILL it once it has saved a checkpoint (before the run's end), then run it again
    with `--resume_from_checkpoint True`: it must say that it resumes from that checkpoint's step, and end at
    `--max_steps`. Returns that step; the outputs go to `<scratch>/<name>-killed.log` and `<name>-resumed.log`."""
    output_dir, max_steps = Path(args[args.index("--output_dir") + 1]), int(args[args.index("--max_steps") + 1])
    with open(smoke.scratch / f"{name}-killed.log", "w") as log:
        # Its own process group, killed whole as a scheduler kills a job: SIGKILL to the main process alone leaves
        # its DataLoader workers alive for a few seconds, holding the output folder's lock (inherited over fork).
        process = subprocess.Popen(
            [sys.executable, *args], stdout=log, stderr=log, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and process.poll() is None:
                if [p for p in output_dir.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]:
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
    assert killed_at < max_steps, "the run finished before it could be killed"
    # --log_level info: Trainer then says from which step it resumes (a --recipe deit resume on an H200 once did not
    # end within 200 s: the log shows where it stopped).
    again = [sys.executable, *args, "--resume_from_checkpoint", "True", "--log_level", "info"]
    said = run_logged(smoke, again, env, f"{name}-resumed")
    state = json.loads((output_dir / "trainer_state.json").read_text())
    resumed = re.search(r"Resuming training from checkpoint with epoch \d+ and global step (\d+)", said)
    assert resumed is not None and int(resumed[1]) == killed_at and state["global_step"] == max_steps, (
        f"the second run did not resume from checkpoint-{killed_at} ({resumed and resumed[0]!r}) or ended at step "
        f"{state['global_step']}, not {max_steps}; its output is in {smoke.scratch / f'{name}-resumed.log'}"
    )
    return killed_at


def test_resume_after_a_kill(trainer_smoke, say):
    """Kill a run (SIGKILL) once it has saved a checkpoint; `--resume_from_checkpoint True` then finishes it."""
    smoke, max_steps = trainer_smoke, 60
    extra = ["--save_strategy", "steps", "--save_steps", "10"] + (["--bf16"] if smoke.cuda else [])
    killed_at = kill_and_resume(
        smoke, finetune_args(smoke.scratch / "resume", max_steps, extra), trainer_env(smoke), "resume"
    )
    final_metrics(smoke.scratch / "resume")
    say(f"killed after checkpoint-{killed_at}, resumed from step {killed_at} to {max_steps}")


def _differing(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest difference of each tensor that is not bit for bit equal (inf: missing from one side)."""
    differing = dict.fromkeys(first.keys() ^ second.keys(), math.inf)
    for name in first.keys() & second.keys():
        if not torch.equal(first[name], second[name]):
            differing[name] = float((first[name].float() - second[name].float()).abs().max())
    return differing


RECIPE_STEPS = 60  # at 12 steps an H200 finished the run before the kill could land


def test_recipe_deit_resumes_bit_for_bit(trainer_smoke, say):
    """`finetune.py --recipe deit --layer_decay 0.75 --bf16` (RandAugment, random erasing, Mixup/CutMix, label
    smoothing, stochastic depth, AdamW in layer-decay groups, EMA with warmup) for 60 steps, a checkpoint every 10:
    the saved model is the EMA, equal to the last checkpoint's EMA state and not to its raw weights; a second run,
    killed after its first checkpoint and resumed, ends bit for bit as the first (model, raw weights and EMA).
    Eager attention and `--full_determinism`: SDPA's fused backward kernels may sum with atomics, cuDNN may choose
    non-deterministic kernels, so that two uninterrupted runs would differ in the last bits without them."""
    from safetensors.torch import load_file

    from hf_vit.train.ema import EMA_FILE

    smoke = trainer_smoke
    extra = ["--recipe", "deit", "--layer_decay", "0.75", "--save_strategy", "steps", "--save_steps", "10"]
    extra += ["--attn_implementation", "eager", "--full_determinism", "True"] + (["--bf16"] if smoke.cuda else [])
    env = trainer_env(smoke)
    straight, killed = smoke.scratch / "deit", smoke.scratch / "deit_killed"
    start = time.perf_counter()
    args = finetune_args(straight, RECIPE_STEPS, extra, learning_rate=5e-4)
    said = run_logged(smoke, [sys.executable, *args, "--log_level", "info"], env, "deit")
    seconds = time.perf_counter() - start
    for words in ("Training with the recipe deit", "Layer-wise learning-rate decay 0.75"):
        assert words in said, f"the run's log does not say {words!r}: the recipe was not applied"
    metrics = final_metrics(straight)
    last = straight / f"checkpoint-{RECIPE_STEPS}"
    final, raw, average = (
        load_file(p) for p in (straight / "model.safetensors", last / "model.safetensors", last / EMA_FILE)
    )
    assert average and average.keys() <= final.keys(), (
        f"{EMA_FILE} holds {len(average)} tensors, not a subset of the model's {len(final)}"
    )
    assert not _differing({k: final[k] for k in average}, average), (
        "the saved model.safetensors is not the EMA state of the last checkpoint"
    )
    assert _differing({k: raw[k] for k in average}, average), (
        "the EMA equals the raw weights: the average did not average (or was never updated)"
    )
    killed_at = kill_and_resume(smoke, finetune_args(killed, RECIPE_STEPS, extra, learning_rate=5e-4), env, "deit")
    differing = {}
    for name in (
        "model.safetensors",
        *(f"checkpoint-{RECIPE_STEPS}/{file}" for file in ("model.safetensors", EMA_FILE)),
    ):
        if gaps := _differing(load_file(straight / name), load_file(killed / name)):
            differing[name] = {"tensors": len(gaps), "largest": max(gaps.values())}
    assert not differing, f"the resumed run differs from the uninterrupted one: {differing}"
    say(
        f"{RECIPE_STEPS} steps in {seconds:.0f} s, eval accuracy {metrics['eval_accuracy']:.3f}; the model is the "
        f"EMA ({len(average)} tensors); killed after checkpoint-{killed_at}, resumed: equal bit for bit",
        train_loss=metrics["train_loss"],
    )


def test_ema_update_cost(trainer_smoke, say):
    """The EMA update (`WeightAverage.update`) is one `_foreach_lerp_` over every trained tensor (on CUDA the
    multi-tensor kernels: far fewer launches than tensors), and its time as a fraction of a ViT-S/16 bf16 training
    step (`benchmarks/recipes_speed.py`'s `ema_cost` on the device, batch 256; on CPU batch 2, fp32)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.recipes_speed import ema_cost
    from benchmarks.timing import synchronize
    from hf_vit.train.ema import WeightAverage

    smoke = trainer_smoke
    average = WeightAverage(
        build_hf_vit(smoke.config(num_hidden_layers=12) if smoke.cuda else smoke.config()).to(smoke.device), 0.999
    )
    average.update(1)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if smoke.cuda else [])) as profiled:
        average.update(2)
        synchronize(smoke.device)
    events = profiled.events()
    calls = sum(event.name == "aten::_foreach_lerp_" for event in events)
    kernels = [event.name for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    tensors = len(average.params)
    assert calls == 1, f"the update made {calls} aten::_foreach_lerp_ calls, not 1"
    assert not smoke.cuda or (0 < len(kernels) < tensors / 4 and any("multi_tensor" in name for name in kernels)), (
        f"the update launched {len(kernels)} kernels for {tensors} tensors ({sorted(set(kernels))[:3]}): not the "
        "multi-tensor (foreach) path"
    )
    on, weights_on = {str(a.device) for a in average.averages}, [str(p.device) for p in average.params]
    assert on == set(weights_on), f"the averages are on {on}, the weights on {weights_on[:1]}"
    del average
    batch, dtype, rounds = (256, "bf16", 5) if smoke.cuda else (2, "fp32", 2)
    cost = ema_cost(batch, repeats=rounds, steps=rounds if smoke.cuda else 1, device=str(smoke.device), dtype=dtype)
    seconds = cost["seconds"]
    say(
        f"{tensors} tensors, {len(kernels)} kernels per update on {sorted(on)}; "
        f"ViT-S/16 {cost['dtype']} batch {batch}: "
        f"step {seconds['training step'] * 1e3:.1f} ms, EMA update {seconds['EMA update'] * 1e3:.2f} ms "
        f"({cost['update_over_step']:.2%} of the step; step + update / step {cost['with_over_without']:.3f})",
        ema_cost=cost,
    )


def test_fsdp_through_accelerate(smoke, say):
    """`accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 1 scripts/finetune.py`: the
    checkpoints are FSDP's sharded ones (the wrapper was FSDP), the final model.safetensors is whole."""
    if not smoke.cuda:
        pytest.skip(FSDP)
    output_dir = smoke.scratch / "fsdp"
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    assert accelerate is not None, "the accelerate command is not installed"
    command = [accelerate, "launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "1"]
    command += finetune_args(output_dir, 20, ["--save_strategy", "steps", "--save_steps", "10", "--bf16"])
    run_logged(smoke, command, trainer_env(smoke), "fsdp")
    checkpoints = sorted(output_dir.glob("checkpoint-*"))
    assert checkpoints, "no checkpoint was saved"
    held = sorted(p.name for p in checkpoints[-1].iterdir())
    sharded = [name for name in held if name.startswith(("pytorch_model_fsdp", "optimizer_0"))]
    assert sharded and "optimizer.pt" not in held, (
        f"{checkpoints[-1].name} holds {held}: not FSDP's sharded state (pytorch_model_fsdp_0/, optimizer_0/)"
    )
    assert (output_dir / "model.safetensors").is_file(), (
        f"no consolidated model.safetensors in {output_dir} (it holds {sorted(os.listdir(output_dir))}): "
        "Trainer.save_model writes the whole model under FSDP only with FULL_STATE_DICT, and "
        "configs/accelerate/fsdp.yaml asks for SHARDED_STATE_DICT (for the checkpoints)"
    )
    loaded = VisionTransformerForImageClassification.from_pretrained(output_dir)
    whole = VisionTransformerForImageClassification(loaded.config).state_dict()
    assert {name: t.shape for name, t in loaded.state_dict().items()} == {
        name: t.shape for name, t in whole.items()
    }, "the saved model's tensors are not the whole model's (not consolidated)"
    accuracy = final_metrics(output_dir)["eval_accuracy"]
    say(f"checkpoint {checkpoints[-1].name}: {sorted(sharded)}; consolidated model, eval accuracy {accuracy:.3f}")
