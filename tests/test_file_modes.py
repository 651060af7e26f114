"""Files and folders the project writes get the user's umask, the weights included (safetensors writes through a
private temporary file, mode 0600, renamed into place)."""

import os
import stat

import pytest
from conftest import tiny_config

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor


def modes(folder) -> dict[str, int]:
    entries = {".": folder, **{path.name: path for path in folder.iterdir()}}
    return {name: stat.S_IMODE(path.stat().st_mode) for name, path in entries.items()}


# Under 022 the weights' 0600 and the staging folder's 0700 would show; under 077 they are what the umask gives.
@pytest.fixture(params=[0o022, 0o077], ids=["umask-022", "umask-077"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def test_saved_weights_get_the_umask_mode(tmp_path, umask):
    folder = tmp_path / "model"
    VisionTransformerForImageClassification(tiny_config()).save_pretrained(folder)
    files = {name: mode for name, mode in modes(folder).items() if name != "."}
    assert "model.safetensors" in files and set(files.values()) == {0o666 & ~umask}, {
        k: oct(v) for k, v in files.items()
    }


def test_a_resized_folder_gets_the_umask_mode(tmp_path, umask):
    from hf_vit.commands import resize

    source = tmp_path / "model"
    VisionTransformerForImageClassification(tiny_config()).save_pretrained(source)
    VisionTransformerImageProcessor(size=32).save_pretrained(source)
    assert resize.main(["--model", str(source), "--image_size", "48", "--output", str(tmp_path / "resized")]) == 0
    found = modes(tmp_path / "resized")
    expected = {name: (0o777 if name == "." else 0o666) & ~umask for name in found}
    assert found == expected, {k: oct(v) for k, v in found.items()}


def test_a_runs_folder_and_checkpoints_get_the_umask_mode(tmp_path, umask):
    """A run with LoRA and the weights' EMA: the model, the adapter, the average and the checkpoint's weights."""
    from test_training import QUIET, pretrained_folder

    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    source, out = pretrained_folder(tmp_path / "pre"), tmp_path / "run"
    args = ["--model_name_or_path", str(source), "--output_dir", str(out), "--image_size", "8", "--max_steps", "2"]
    args += ["--max_train_samples", "16", "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "2"]
    train("finetune", *parse_args("finetune", args + ["--lora_rank", "2", "--ema_decay", "0.5", *QUIET]))
    weights = sorted(out.rglob("*.safetensors"))
    names = {str(path.relative_to(out)) for path in weights}
    assert {"adapter_model.safetensors", "checkpoint-2/adapter_model.safetensors"} <= names
    assert "checkpoint-2/ema_state.safetensors" in names
    assert {oct(stat.S_IMODE(path.stat().st_mode)) for path in weights} == {oct(0o666 & ~umask)}


def test_only_the_weights_a_save_writes_change_mode(tmp_path):
    """A file of the user's beside the weights keeps its mode: only what the save wrote is given the umask's."""
    folder = tmp_path / "model"
    folder.mkdir()
    theirs = folder / "mine.safetensors"
    theirs.write_bytes(b"x")
    theirs.chmod(0o600)
    VisionTransformerForImageClassification(tiny_config()).save_pretrained(folder)
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o600
    from hf_vit.model.loading import current_umask

    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o666 & ~current_umask()
