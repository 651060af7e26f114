"""Where the converters and resize_resolution.py write: `--output .`, what `--overwrite` may replace, crash-safe
replacement, one-line errors for bad input, and the model card every written folder carries."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file
from test_convert_jax import SPECS, random_npz, save_npz

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor

ROOT = Path(__file__).resolve().parents[1]
SPEC = SPECS["gap"]  # 24x24 images, patch 8


def script(name):
    """A script's main(), run in-process (no new interpreter's import time)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda *args: module.main([str(a) for a in args])


convert, resize = script("convert_checkpoint"), script("resize_resolution")


def npz(path, seed=0):
    return save_npz(path, random_npz(**SPEC, seed=seed))


def listing(folder):
    return sorted(p.name for p in Path(folder).iterdir())


def hf_vit_folder(path, num_labels=5):
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(zero_init_head=False, num_labels=num_labels))
    model.save_pretrained(path)
    VisionTransformerImageProcessor(size=32).save_pretrained(path)
    return path


def error_line(capsys):
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # earlier lines: progress bars of the set-up
    assert last.startswith("error: ") and "Traceback" not in err
    return last


# Case 1: `--output .`
def test_output_dot_writes_into_an_empty_working_folder(tmp_path, monkeypatch):
    source = npz(tmp_path / "c.npz")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert convert("--source", "jax", "--input", source, "--output", ".") == 0
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "README.md"} <= set(listing(work))
    assert Path.cwd() == work and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # Replacing it in place works too; the folder hf-vit wrote is swapped, nothing else is touched.
    assert convert("--source", "jax", "--input", npz(tmp_path / "d.npz", seed=1), "--output", ".", "--overwrite") == 0
    assert VisionTransformerForImageClassification.from_pretrained(tmp_path / "work").config.image_size == 24

    variant = tmp_path / "variant"
    variant.mkdir()
    monkeypatch.chdir(variant)
    assert resize("--model", hf_vit_folder(tmp_path / "src"), "--image_size", "48", "--output", ".") == 0
    assert json.loads((variant / "config.json").read_text())["image_size"] == 48


def test_output_dot_holding_the_input_is_refused_and_nothing_is_deleted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    npz(tmp_path / "c.npz")
    (tmp_path / "notes.txt").write_text("mine")
    before = listing(tmp_path)
    assert convert("--source", "jax", "--input", "c.npz", "--output", ".", "--overwrite") == 2
    assert "contains the input" in error_line(capsys)
    assert listing(tmp_path) == before and (tmp_path / "notes.txt").read_text() == "mine"


# Case 2: what --overwrite may replace
def test_overwrite_refuses_a_folder_holding_the_input(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    source = npz(tmp_path / "m" / "c.npz")
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "hf_vit"}))
    assert convert("--source", "jax", "--input", source, "--output", tmp_path / "m", "--overwrite") == 2
    assert "contains the input" in error_line(capsys) and source.is_file()
    # The output may not lie inside an input folder either (resize_resolution.py reads a folder).
    src = hf_vit_folder(tmp_path / "src")
    assert resize("--model", src, "--image_size", "48", "--output", src / "v48") == 2
    assert "inside the input folder" in error_line(capsys) and not (src / "v48").exists()


@pytest.mark.parametrize(
    "make, blocker",
    [
        (lambda d: (d / "data.csv").write_text("1,2"), "has no config.json"),
        (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "vit"})), "model_type 'vit'"),
        (lambda d: (d / "config.json").write_text("{broken"), "not a readable JSON"),
    ],
)
def test_overwrite_refuses_a_folder_hf_vit_did_not_write(tmp_path, capsys, make, blocker):
    out = tmp_path / "out"
    out.mkdir()
    make(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert convert("--source", "jax", "--input", npz(tmp_path / "c.npz"), "--output", out, "--overwrite") == 2
    assert blocker in error_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("extra", ["notes.txt", "secrets.py", "checkpoint-10", "link"])
def test_overwrite_names_a_foreign_file_in_an_hf_vit_folder(tmp_path, capsys, extra):
    source, out = npz(tmp_path / "c.npz"), tmp_path / "out"
    assert convert("--source", "jax", "--input", source, "--output", out) == 0
    if extra == "checkpoint-10":
        (out / extra).mkdir()
    elif extra == "link":
        (out / extra).symlink_to(source)
    else:
        (out / extra).write_text("mine")
    assert convert("--source", "jax", "--input", source, "--output", out, "--overwrite") == 2
    assert f"{out / extra} is a" in error_line(capsys)
    assert (out / extra).exists()


def test_overwrite_replaces_a_folder_hf_vit_wrote(tmp_path):
    out = tmp_path / "out"
    assert convert("--source", "jax", "--input", npz(tmp_path / "c.npz"), "--output", out) == 0
    (out / "all_results.json").write_text("{}")  # what an evaluated variant adds
    assert convert("--source", "jax", "--input", npz(tmp_path / "d.npz", seed=1), "--output", out, "--overwrite") == 0
    assert "all_results.json" not in listing(out)
    assert listing(tmp_path) == ["c.npz", "d.npz", "out"]  # no staging or aside folder left


# Case 3: a killed replacement leaves the old or the new result complete, and the next run tidies up
def _weights(folder):
    return load_file(Path(folder) / "model.safetensors")["vit.embeddings.patch_embedding.weight"]


@pytest.mark.parametrize("step", ["aside", "replaced"])
def test_a_killed_replacement_keeps_one_complete_result(tmp_path, step):
    out = tmp_path / "out"
    old_source, new_source = npz(tmp_path / "old.npz"), npz(tmp_path / "new.npz", seed=1)
    assert convert("--source", "jax", "--input", old_source, "--output", out) == 0
    old = _weights(out)
    cmd = [sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"), "--source", "jax"]
    cmd += ["--input", str(new_source), "--output", str(out), "--overwrite"]
    env = {**os.environ, "HF_VIT_TEST_CRASH_AT": step, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.hf-vit-")]
    assert leftovers  # what the killed run left beside the target
    complete = [p for p in [out, *leftovers] if (p / "config.json").is_file() and (p / "model.safetensors").is_file()]
    if step == "aside":  # killed between the two renames: the old result sits complete beside the target
        assert not out.exists() and any(torch.equal(_weights(p), old) for p in complete)
    else:
        assert not torch.equal(_weights(out), old)
    # The next run restores or removes the leftovers before it decides anything.
    assert convert("--source", "jax", "--input", old_source, "--output", out) == 2  # not empty: restored / new
    assert listing(tmp_path) == ["new.npz", "old.npz", "out"]
    assert torch.equal(_weights(out), old) == (step == "aside")
    assert convert("--source", "jax", "--input", new_source, "--output", out, "--overwrite") == 0
    assert listing(tmp_path) == ["new.npz", "old.npz", "out"] and not torch.equal(_weights(out), old)


# Case 18: one `error:` line, exit 2
def test_output_that_is_a_file(tmp_path, capsys):
    (tmp_path / "out").write_text("mine")
    assert convert("--source", "jax", "--input", npz(tmp_path / "c.npz"), "--output", tmp_path / "out") == 2
    assert "is a file, not a folder" in error_line(capsys) and (tmp_path / "out").read_text() == "mine"
    src = hf_vit_folder(tmp_path / "src")
    assert resize("--model", src, "--image_size", "48", "--output", tmp_path / "out") == 2
    assert "is a file, not a folder" in error_line(capsys)


def test_unwritable_output_is_named_before_any_work(tmp_path, capsys):
    if os.geteuid() == 0:  # root ignores permissions: use a location the kernel refuses
        if not Path("/sys").is_dir():
            pytest.skip("no unwritable location for root")
        out = Path("/sys/hf-vit-test-output")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        out = locked / "out"
    # The input does not exist: an error about the output shows it was checked before the input was read.
    assert convert("--source", "jax", "--input", tmp_path / "missing.npz", "--output", out) == 2
    err = error_line(capsys)
    assert "cannot write to" in err and "missing.npz" not in err


@pytest.mark.parametrize("name", ["config.json", "preprocessor_config.json"])
def test_broken_json_in_a_transformers_source(tmp_path, capsys, name):
    from transformers import ViTConfig, ViTForImageClassification

    source = tmp_path / "source"
    vit = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32)
    ViTForImageClassification(vit).save_pretrained(source)
    (source / name).write_text('{"image_mean": [0.5,')
    assert convert("--source", "transformers", "--input", source, "--output", tmp_path / "out") == 2
    assert f"{source / name} is not readable JSON" in error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_huge_image_size_is_bounded(tmp_path, capsys):
    out = tmp_path / "out"
    assert convert("--source", "jax", "--input", npz(tmp_path / "c.npz"), "--output", out, "--image_size", 100000) == 2
    assert "at most 65536 patch positions" in error_line(capsys) and not out.exists()
    src = hf_vit_folder(tmp_path / "src")
    assert resize("--model", src, "--image_size", "100000", "--output", out) == 2
    assert "at most 65536 patch positions" in error_line(capsys) and not out.exists()


# Case 19: every written folder carries a card naming its base model, never a local path
def _card(folder):
    from huggingface_hub import ModelCard

    return ModelCard.load(Path(folder) / "README.md")


def test_converted_folder_has_a_card(tmp_path):
    out = tmp_path / "out"
    assert convert("--source", "jax", "--input", npz(tmp_path / "ViT-T_8.npz"), "--output", out) == 0
    card = _card(out)
    assert card.data.base_model == "ViT-T_8.npz" and str(tmp_path) not in card.content
    assert "converted from the authors' JAX .npz layout" in card.text and not card.data.datasets
    assert convert("--source", "jax", "--input", npz(tmp_path / "c.npz"), "--output", tmp_path / "hub",
                   "--base_model", "google/vit-tiny")  == 0  # fmt: skip
    assert _card(tmp_path / "hub").data.base_model == "google/vit-tiny"


def test_resolution_variant_has_a_card_with_measured_metrics(tmp_path):
    src = hf_vit_folder(tmp_path / "src", num_labels=10)  # the digits' classes
    out = tmp_path / "v48"
    args = ["--model", src, "--image_size", "48", "--output", out, "--hub_model_id", "me/vit-48"]
    assert resize(*args) == 0
    card = _card(out)
    assert card.data.base_model == "src" and str(tmp_path) not in card.content
    assert "me/vit-48" in card.content and "32x32 to 48x48" in card.text
    assert resize(*args, "--overwrite", "--base_model", "me/vit-32", "--dataset_name", "digits") == 0
    card, results = _card(out), json.loads((out / "all_results.json").read_text())
    assert card.data.base_model == "me/vit-32" and card.data.datasets == ["digits"]
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and f"{results['eval_accuracy']:.4f}" in card.text


def test_overwrite_refuses_a_users_module_named_like_an_hf_vit_one(tmp_path):
    # hf-vit writes its model's code files beside checkpoints, not every module of the package: data.py is the user's
    from hf_vit.outputs.output_folders import check_replaceable

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "hf_vit"}))
    (folder / "modeling_vit.py").write_text("# written by save_pretrained")
    check_replaceable(folder)
    (folder / "data.py").write_text("# the user's own loader")
    with pytest.raises(ValueError, match="data.py"):
        check_replaceable(folder)


@pytest.mark.parametrize("where", ["run", "evaluate", "resize"])
def test_an_output_folder_inside_the_data_set_is_refused_and_the_data_set_untouched(tmp_path, capsys, where):
    """A data set is the user's: nothing hf-vit writes may land in it (an image folder holding a model folder, or a
    results file, no longer loads as it did)."""
    from test_inference import classifier_folder
    from test_training import QUIET, split_image_folder

    from hf_vit.commands import evaluate as evaluate_command
    from hf_vit.commands import resize as resize_command
    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    data = split_image_folder(tmp_path / "imgs")
    model = classifier_folder(tmp_path / "model")
    before = sorted(str(path.relative_to(data)) for path in data.rglob("*"))
    inside = data / "out"
    if where == "run":
        args = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(inside)]
        with pytest.raises(ValueError, match="--output_dir .*/out lies inside the data set --dataset_name"):
            train("finetune", *parse_args("finetune", args + ["--max_steps", "1", *QUIET]))
    else:
        command, flag = (evaluate_command, "--output_dir") if where == "evaluate" else (resize_command, "--output")
        argv = ["--model", str(model), "--dataset_name", str(data), flag, str(inside)]
        argv += ["--image_size", "16"] if where == "resize" else []
        capsys.readouterr()
        assert command.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag} {inside} lies inside the data set" in err[0], err
    assert sorted(str(path.relative_to(data)) for path in data.rglob("*")) == before


def test_an_output_dir_under_a_file_is_named_not_errno(tmp_path):
    from hf_vit.outputs.output_folders import OutputDirError, claim_output_dir

    (tmp_path / "notes.txt").write_text("mine")
    for output in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "run" / "deeper"):
        with pytest.raises(OutputDirError, match=r"notes.txt.* is a file") as refused:
            claim_output_dir(output, resume_from=None, overwrite=False, main_process=True)
        assert "Errno" not in str(refused.value)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_evaluate_names_a_file_in_the_way_of_its_output_dir(tmp_path, capsys):
    from test_inference import classifier_folder
    from test_training import split_image_folder

    from hf_vit.commands import evaluate as evaluate_command

    model, data = classifier_folder(tmp_path / "model"), split_image_folder(tmp_path / "data")
    (tmp_path / "notes.txt").write_text("mine")
    for output in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "eval"):
        capsys.readouterr()
        assert (
            evaluate_command.main(["--model", str(model), "--dataset_name", str(data), "--output_dir", str(output)])
            == 2
        )
        err = capsys.readouterr().err
        assert "notes.txt is a file" in err and "Errno" not in err, err


def test_the_one_writer_never_writes_through_a_link_and_never_leaves_a_torn_file(tmp_path):
    from hf_vit.infer.evaluate import write_evaluation
    from hf_vit.outputs.files import LinkInTheWayError, write_beside

    target, link = tmp_path / "user.txt", tmp_path / "out" / "eval_results.json"
    link.parent.mkdir()
    link.symlink_to(target)  # dangling: a plain open would create the user's file
    with pytest.raises(LinkInTheWayError, match=rf"{link} is a symlink \(to {target}\)"):
        write_beside(link, "{}")
    with pytest.raises(ValueError, match="eval_results.json exists"):  # evaluate refuses it as any file there
        write_evaluation(link.parent, "eval", {"accuracy": 1.0}, None, {})
    assert not target.exists() and link.is_symlink()
    path = write_beside(tmp_path / "out" / "a.json", b"old")

    def torn(file):
        file.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_beside(path, torn)
    assert path.read_bytes() == b"old" and sorted(p.name for p in path.parent.iterdir()) == [path.name, link.name]
