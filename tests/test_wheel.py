"""What `pip install hf-vit` gives: the wheel built from this repository, installed (not editable) into a fresh
virtual environment with the tested pins, run through its console commands from a folder outside the repository."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("hf-vit-pretrain", "hf-vit-finetune", "hf-vit-convert", "hf-vit-resize", "hf-vit-export")
COMMANDS += ("hf-vit-visualize", "hf-vit-push", "hf-vit-evaluate", "hf-vit-predict")
TINY = "hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32"


def run(command, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{command[:3]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh environment holding the wheel and what it depends on, and nothing of the checkout."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in ("hf_vit", "hf_vit_cli"):  # the package, and the console commands' entry points
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    isolation = [] if _has_setuptools() else ["--use-pep517"]
    flags = ["--no-build-isolation"] if not isolation else isolation
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *flags, "-w", str(base / "dist"), str(source)])
    (wheel,) = (base / "dist").glob("hf_vit-*.whl")
    env_dir = base / "env"
    run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    python = env_dir / "bin" / "python"
    # pip from this environment installs into the new one; --no-compile: the byte-code of torch alone takes a minute.
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    run([*install, "-c", str(ROOT / "constraints.txt"), "torch==2.13.0", str(wheel)])
    return wheel, env_dir


def _has_setuptools() -> bool:
    try:
        import setuptools  # noqa: F401
    except ImportError:
        return False
    return True


def outside_env() -> dict[str, str]:
    # Byte-code is written as a user's Python writes it: the environment is installed without it (--no-compile), and
    # where PYTHONDONTWRITEBYTECODE is set every command would compile torch's and transformers' modules again (about
    # 15 s of CPU each); the first command now caches what it imports for the ones after it.
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_the_wheel_holds_every_file_the_package_reads(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "hf_vit/outputs/templates/model_card.md" in names
    for package in (
        "model",
        "data",
        "data/augment",
        "tasks",
        "train",
        "infer",
        "outputs",
        "convert",
        "commands",
        "metrics",
    ):  # every subpackage is packaged
        local = {str(p.relative_to(ROOT)) for p in (ROOT / "hf_vit" / package).glob("*.py")}
        assert local and local <= names, package
    assert {"hf_vit/metrics/accuracy/accuracy.py", "hf_vit/metrics/multilabel/multilabel.py"} <= names
    entry_points = zipfile.ZipFile(wheel).read("hf_vit-0.1.0.dist-info/entry_points.txt").decode()
    assert all(f"{command} = hf_vit_cli:" in entry_points for command in COMMANDS)
    assert {f"hf_vit/commands/help/{command}.txt" for command in COMMANDS} <= names  # --help without the imports


def test_the_installed_commands_pretrain_and_the_folder_loads_with_the_auto_classes(installed, tmp_path):
    _, env_dir = installed
    bin_dir = env_dir / "bin"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = outside_env()
    assert all((bin_dir / command).is_file() for command in COMMANDS)
    helped = run([str(bin_dir / "hf-vit-finetune"), "--help"], cwd=elsewhere, env=env).stdout
    assert helped.startswith("usage: hf-vit-finetune") and "hf-vit's flags: the model" in helped
    flags = ["--output_dir", "run", "--image_size", "8", "--patch_size", "4", "--config_overrides", TINY]
    flags += ["--max_steps", "2", "--per_device_train_batch_size", "8", "--max_train_samples", "16"]
    flags += ["--eval_strategy", "no", "--save_strategy", "no", "--disable_tqdm", "True"]
    done = run([str(bin_dir / "hf-vit-pretrain"), *flags], cwd=elsewhere, env=env)
    out = elsewhere / "run"
    # the base install has no matplotlib: the curves are skipped in one line naming the extra, the run completes
    assert "hf-vit[plot]" in done.stderr and not (out / "training_curves.png").exists()
    assert {"model.safetensors", "config.json", "preprocessor_config.json", "README.md", "all_results.json"} <= {
        p.name for p in out.iterdir()
    }
    check = (
        "import json, sys, torch, hf_vit\n"
        "from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification\n"
        "folder = sys.argv[1]\n"
        "model = AutoModelForImageClassification.from_pretrained(folder).eval()\n"
        "processor = AutoImageProcessor.from_pretrained(folder)\n"
        "pixels = processor(torch.zeros(3, 12, 12), return_tensors='pt').pixel_values\n"
        "print(json.dumps({'file': hf_vit.__file__, 'model': type(model).__name__,\n"
        "    'config': type(AutoConfig.from_pretrained(folder)).__name__, 'processor': type(processor).__name__,\n"
        "    'logits': list(model(pixel_values=pixels).logits.shape)}))\n"
    )
    loaded = json.loads(run([str(env_dir / "bin" / "python"), "-c", check, str(out)], cwd=elsewhere, env=env).stdout)
    assert Path(loaded["file"]).is_relative_to(env_dir) and not Path(loaded["file"]).is_relative_to(ROOT)
    assert loaded["model"] == "VisionTransformerForImageClassification"
    assert (loaded["config"], loaded["processor"]) == ("VisionTransformerConfig", "VisionTransformerImageProcessor")
    assert loaded["logits"] == [1, 10]
    card = (out / "README.md").read_text()
    assert "Vision Transformer" in card and str(elsewhere) not in card
    listed = run(
        [str(bin_dir / "hf-vit-push"), "--model", "run", "--hub_model_id", "me/vit", "--dry_run"],
        cwd=elsewhere,
        env=env,
    )
    assert "model.safetensors" in listed.stdout and "README.md" in listed.stdout
