"""The README's Python blocks run as written, in order, as a reader would paste them into one session: every block
that needs no Hub access, with tiny stand-ins for the files they name (a photo, a LoRA run's folder and its base)
and tiny widths for the presets they build."""

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
# Blocks that load checkpoints by Hub id or from the authors' downloads: the Hub cannot be reached from the tests
# (tests/test_sources.py loads the same sources through a local Hub cache).
NEEDS_HUB = ('"google/vit', '"timm/', '.npz"')
TINY = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64)


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def lora_run_folder(folder: Path, base: Path) -> None:
    """What a LoRA run on the local `base` leaves in `folder`: the adapter, its config, processor and local base."""
    from hf_vit import (
        VisionTransformerConfig,
        VisionTransformerForImageClassification,
        VisionTransformerImageProcessor,
    )
    from hf_vit.outputs.files import LOCAL_BASE_FILE
    from hf_vit.train.lora import apply_lora

    config = VisionTransformerConfig(image_size=8, patch_size=4, num_hidden_layers=2, num_labels=4, **TINY)
    torch.manual_seed(0)
    VisionTransformerForImageClassification(config).save_pretrained(base)
    model = VisionTransformerForImageClassification.from_pretrained(base)
    model.reset_classifier({0: "a", 1: "b"})
    model.config.save_pretrained(folder)
    peft_model = apply_lora(model, 2, base_model_name_or_path=str(base))
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    peft_model.save_pretrained(folder)
    VisionTransformerImageProcessor(size=8).save_pretrained(folder)
    (folder / LOCAL_BASE_FILE).write_text(f'{{"base_model_name_or_path": "{base.resolve()}"}}')


def test_every_readme_python_block_without_hub_access_runs(tmp_path, monkeypatch):
    import hf_vit
    from hf_vit.model import configuration_vit

    blocks = python_blocks()
    offline = [block for block in blocks if not any(marker in block for marker in NEEDS_HUB)]
    assert len(blocks) - len(offline) == 1, "a new block needs the Hub: give it stand-ins here instead"
    monkeypatch.chdir(tmp_path)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save("photo.jpg")
    lora_run_folder(tmp_path / "out" / "lora", tmp_path / "out" / "pre")
    # The presets at a tiny width (their depth, size, patch and head kept), so the blocks run in seconds.
    from_preset = configuration_vit.VisionTransformerConfig.from_preset.__func__

    def tiny_preset(cls, name, **fields):
        return from_preset(cls, name, **{**TINY, **fields})

    monkeypatch.setattr(configuration_vit.VisionTransformerConfig, "from_preset", classmethod(tiny_preset))
    session: dict = {}
    for number, block in enumerate(offline):
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), session)
        except Exception as error:  # noqa: BLE001  (the failing block is named with its error)
            pytest.fail(f"README block {number} failed: {type(error).__name__}: {error}\n{block}")
        if "save_merged_model(" in block:  # the merged folder holds the model load_lora_model gave
            merged = hf_vit.VisionTransformerForImageClassification.from_pretrained(tmp_path / "out" / "lora-merged")
            x = torch.randn(2, 3, 8, 8)
            with torch.no_grad():
                torch.testing.assert_close(merged(x).logits, session["lora_model"](x).logits)
                assert merged(x).logits.shape == (2, 2)
    assert session["pixel_values"].shape == (1, 3, 224, 224)  # the processor's output at the preset's size
    assert session["distances"].shape == (12, 2)  # (layers, heads) of the tiny vit-base
    assert "merged" in locals()


def test_the_first_hour_after_the_quick_job():
    """After `make train QUICK=1` only outputs/quick exists: the README says it serves where outputs/main is named,
    what accuracy it reaches, how `make setup` installs torch (a CUDA build on Linux unless told otherwise)."""
    readme = (ROOT / "README.md").read_text()
    own_folder = readme[readme.index("### Your own image folder") : readme.index("```bash\n# From the main job")]
    assert "outputs/quick" in own_folder and "--list_presets" in own_folder
    start_here = readme[readme.index("## Start here") : readme.index("### Your own image folder")]
    assert (
        "0.63" in start_here
        and "dev" in start_here
        and "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in start_here
    )
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    assert "TORCH_INDEX" in (ROOT / "Makefile").read_text()


def test_make_test_takes_files_and_pytest_arguments_and_setup_asks_a_torch_index_once():
    readme, constraints = (ROOT / "README.md").read_text(), (ROOT / "constraints.txt").read_text()
    make = ["make", "--no-print-directory", "-n", "-B"]
    run = subprocess.run([*make, "test", "TESTS=tests/test_x.py", "PYTEST_ARGS=-k name"], cwd=ROOT,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert run.stdout.strip().splitlines()[-1].endswith("-m pytest -q -n 2 --dist loadfile -k name tests/test_x.py")
    assert 'make test TESTS=tests/test_data.py PYTEST_ARGS="-k corrupt"' in readme
    # torch alone from TORCH_INDEX, asked once; the README and constraints.txt say the same of the pin
    setup = subprocess.run([*make, "setup", "TORCH_INDEX=https://example.invalid/whl"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "--no-deps --retries 0 --timeout 30 --index-url https://example.invalid/whl" in setup
    assert "pins the version, not\n# the build" in constraints and "pins torch's version,\nnot its build" in readme
