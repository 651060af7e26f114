"""The edges of a training run: what its output folder may hold and what a run may replace there, unreadable and
unsuitable data named before training, checkpoints cut off or unwritable, and resuming from them."""

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_training import (
    QUIET,
    ROOT,
    TINY,
    labelled_dataset,
    multi_label_dataset,
    pretrained_folder,
    split_image_folder,
    tiny_pretrain,
)

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.data.transforms import CorruptImageError
from hf_vit.train.arguments import parse_args
from hf_vit.train.checkpoints import last_complete_checkpoint
from hf_vit.train.training import train


def test_a_second_run_into_a_finished_runs_folder_is_refused(tmp_path, caplog):
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="hf_vit"):
        train("pretrain", *tiny_pretrain(out))
    # the run's set-up, as transformers' example scripts print it
    assert "Run set-up: 16 training examples" in caplog.text
    assert "batch 8 per device x 1 process(es) x 1 accumulation step(s) = global batch 8, 2 optim" in caplog.text
    first = (out / "model.safetensors").read_bytes()
    assert not (out / ".hf-vit-run.lock").exists()  # the lock goes with the run
    with pytest.raises(FileExistsError, match="is not empty.*--overwrite_output_dir True") as refused:
        train("pretrain", *tiny_pretrain(out, "--seed", "1"))
    assert "--resume_from_checkpoint" not in str(refused.value)  # no checkpoint to resume: not advised
    assert (out / "model.safetensors").read_bytes() == first
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "trainer_state.json").write_text("{}")  # what a run leaves there
    (out / "notes.txt").write_text("mine")
    train("pretrain", *tiny_pretrain(out, "--seed", "1", "--overwrite_output_dir", "True"))
    assert (out / "model.safetensors").read_bytes() != first
    assert (out / "notes.txt").read_text() == "mine" and not (out / "checkpoint-1").exists()


def test_overwrite_output_dir_refuses_a_users_model_folder_named_like_a_checkpoint(tmp_path):
    # A `save_pretrained` output (config and weights, no training state) is a user's model, not a checkpoint.
    out = tmp_path / "out"
    pretrained_folder(out / "checkpoint-7")
    kept = sorted(p.name for p in (out / "checkpoint-7").iterdir())
    with pytest.raises(FileExistsError, match="checkpoint-7 is not a checkpoint of a run.*no training state"):
        train("pretrain", *tiny_pretrain(out, "--overwrite_output_dir", "True"))
    assert sorted(p.name for p in (out / "checkpoint-7").iterdir()) == kept


def test_a_run_into_the_folder_of_its_own_base_model_is_refused(tmp_path):
    base = pretrained_folder(tmp_path / "base")
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    fine = ["--output_dir", str(base), "--model_name_or_path", str(base), "--image_size", "8", "--max_steps", "1"]
    fine += ["--eval_strategy", "no", "--save_strategy", "no", "--max_train_samples", "16", *QUIET]
    for extra in (["--overwrite_output_dir", "True"], ["--overwrite_output_dir", "True", "--lora_rank", "2"]):
        with pytest.raises(FileExistsError, match=r"--output_dir .*base is the folder of --model_name_or_path"):
            train("finetune", *parse_args("finetune", fine + extra))
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before


def test_overwrite_output_dir_removes_only_what_a_run_recorded(tmp_path):
    from hf_vit.outputs.files import RUN_RECORD_FILE

    # model files no run recorded (a `save_pretrained` output): whose they are cannot be told, so nothing is removed
    out = pretrained_folder(tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError, match=rf"out holds .*config.json.* but no {RUN_RECORD_FILE}"):
        train("pretrain", *tiny_pretrain(out, "--overwrite_output_dir", "True"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # a run's folder: its files are replaced by the new run's; a file the earlier run did not write stays
    run = tmp_path / "run"
    train("pretrain", *tiny_pretrain(run))
    (run / "eval_results.json").write_text("{}")  # the user's, written after the run, under a name hf-vit uses
    record = json.loads((run / RUN_RECORD_FILE).read_text())
    assert "model.safetensors" in record["files"] and "eval_results.json" not in record["files"]
    record["found"] = ["eval_results.json"]  # as if it had been there before the run
    (run / RUN_RECORD_FILE).write_text(json.dumps(record))
    train("pretrain", *tiny_pretrain(run, "--overwrite_output_dir", "True", "--seed", "1"))
    assert (run / "eval_results.json").read_text() == "{}"
    # a run killed before it recorded its files: what appeared after it started is its own
    record = json.loads((run / RUN_RECORD_FILE).read_text())
    (run / RUN_RECORD_FILE).write_text(json.dumps({**record, "files": []}))
    (run / "compute_dial.json").write_text("{}")  # written by the killed run
    train("pretrain", *tiny_pretrain(run, "--overwrite_output_dir", "True", "--seed", "2"))
    assert not (run / "compute_dial.json").exists() and (run / "eval_results.json").read_text() == "{}"


def test_a_resume_from_another_runs_checkpoint_is_a_new_run_in_its_folder(tmp_path, caplog):
    other, project = tmp_path / "other-run", tmp_path / "project"
    checkpoints = ["--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "2"]
    train("pretrain", *tiny_pretrain(other, *checkpoints))
    project.mkdir()
    (project / "README.md").write_text("my project")
    mine = '{"mine": true}'
    (project / "config.json").write_text(mine)
    resume = ["--resume_from_checkpoint", str(other / "checkpoint-1")]
    with pytest.raises(FileExistsError, match=r"project is not empty \(it holds README.md, config.json\)") as refused:
        train("pretrain", *tiny_pretrain(project, *resume))
    assert "checkpoint-1 is another folder's" in str(refused.value)
    assert "--resume_from_checkpoint True" not in str(refused.value)  # the project holds no checkpoint to resume
    assert "--overwrite_output_dir" not in str(refused.value)  # it would refuse a config.json no run recorded
    with pytest.raises(FileExistsError, match=r"project holds README.md, config.json but no hf_vit_run.json"):
        train("pretrain", *tiny_pretrain(project, *resume, "--overwrite_output_dir", "True"))
    assert {p.name: p.read_text() for p in project.iterdir()} == {"README.md": "my project", "config.json": mine}
    # into an empty folder it continues the other run's state
    with caplog.at_level("INFO", logger="hf_vit"):
        train("pretrain", *tiny_pretrain(tmp_path / "fresh", *resume))
    assert f"Resuming from {other / 'checkpoint-1'}" in caplog.text
    assert json.loads((tmp_path / "fresh" / "trainer_state.json").read_text())["global_step"] == 2


def test_a_folder_holding_only_the_record_of_a_run_that_wrote_nothing_is_the_reruns(tmp_path):
    from transformers import TrainerCallback

    from hf_vit.train.checkpoints import resolve_resume

    class Stop(TrainerCallback):  # a run stopped at its first batch (a corrupt image, Ctrl-C) before writing anything
        def on_step_begin(self, args, state, control, **kwargs):
            raise CorruptImageError("train image 3 (broken.png) cannot be decoded")

    out = tmp_path / "out"
    with pytest.raises(CorruptImageError):
        train("pretrain", *tiny_pretrain(out), callbacks=[Stop()])
    assert sorted(p.name for p in out.iterdir()) == ["hf_vit_run.json"]
    (out / ".hf_vit_run.json.partial").write_text('{"files": [')  # and a later write of the record, killed half way
    assert resolve_resume(True, out) is None  # --resume_from_checkpoint True: nothing to resume, trains from the start
    train("pretrain", *tiny_pretrain(out))  # the same command, taken as it was: no flag needed
    assert (out / "model.safetensors").is_file()
    # a record beside anything else is not all there is: that folder is refused, with advice that works there
    with pytest.raises(FileExistsError, match="is not empty") as refused:
        train("pretrain", *tiny_pretrain(out))
    assert "--overwrite_output_dir True" in str(refused.value) and "--resume_from_checkpoint" not in str(refused.value)


def test_a_refusal_advises_no_resume_from_checkpoints_saved_with_the_model_only(tmp_path):
    from hf_vit.train.checkpoints import resolve_resume

    out = tmp_path / "out"
    weights_only = ["--save_strategy", "steps", "--save_steps", "1", "--save_only_model", "True"]
    train("pretrain", *tiny_pretrain(out, *weights_only))
    with pytest.raises(ValueError, match="holds the weights only"):  # what the advice would lead to
        resolve_resume(True, out)
    with pytest.raises(FileExistsError, match="is not empty") as refused:
        train("pretrain", *tiny_pretrain(out, *weights_only))
    assert "--overwrite_output_dir True" in str(refused.value) and "--resume_from_checkpoint" not in str(refused.value)


def test_no_file_a_run_writes_goes_through_a_link_planted_in_its_folder(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    train("pretrain", *tiny_pretrain(run))
    elsewhere.mkdir()
    users = ("hf_vit_run.json", "training_curves.png", "README.md", "lock")
    for name in users:
        (elsewhere / name).write_text("the user's own file")
    (run / ".hf_vit_run.json.partial").symlink_to(elsewhere / "hf_vit_run.json")
    (run / ".training_curves.png.partial").symlink_to(elsewhere / "training_curves.png")
    os.link(elsewhere / "README.md", run / ".README.md.partial")  # a hard link is written through as well
    train("pretrain", *tiny_pretrain(run, "--overwrite_output_dir", "True", "--seed", "1"))
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == dict.fromkeys(users, b"the user's own file")
    assert "model.safetensors" in json.loads((run / "hf_vit_run.json").read_text())["files"]
    assert (run / "training_curves.png").read_bytes()[:4] == b"\x89PNG" and "hf-vit" in (run / "README.md").read_text()
    assert not list(run.glob(".*.partial"))  # each link replaced by the run's own file, renamed into place
    (elsewhere / "lock").unlink()
    (run / ".hf-vit-run.lock").symlink_to(elsewhere / "lock")  # the lock is opened, never through a link
    with pytest.raises(FileExistsError, match=r"\.hf-vit-run\.lock is a symlink"):
        train("pretrain", *tiny_pretrain(run, "--overwrite_output_dir", "True"))
    assert not (elsewhere / "lock").exists()


def test_a_folder_another_run_is_writing_to_is_refused(tmp_path):
    from hf_vit.outputs.output_folders import claim_output_dir

    out = tmp_path / "out"
    lock = claim_output_dir(out, resume_from=None, overwrite=False, main_process=True)
    try:
        with pytest.raises(FileExistsError, match="Another run is writing to --output_dir"):
            claim_output_dir(out, resume_from=None, overwrite=False, main_process=True)
    finally:
        lock.close()
    claim_output_dir(out, resume_from=None, overwrite=False, main_process=True).close()  # released with the first run


def test_a_forked_data_loader_worker_does_not_keep_the_folder_locked(tmp_path):
    """A run killed while its forked workers are still exiting: the lock goes with the run's own process."""
    import signal

    from hf_vit.outputs.output_folders import claim_output_dir

    out = tmp_path / "out"
    lock = claim_output_dir(out, resume_from=None, overwrite=False, main_process=True)
    ready, tell = os.pipe()
    child = os.fork()
    if child == 0:  # a worker: alive, holding whatever it inherited
        os.write(tell, b"1")
        signal.pause()
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"
        lock.close()  # the run's process is killed: its files close, its workers live on
        claim_output_dir(out, resume_from=None, overwrite=False, main_process=True).close()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready), os.close(tell)


def test_a_corrupt_evaluation_image_stops_the_run_before_training(tmp_path):
    data = split_image_folder(tmp_path / "data", broken_split="test")
    out = tmp_path / "out"
    with pytest.raises(CorruptImageError, match="broken.png"):
        train("pretrain", *tiny_pretrain(out, "--dataset_name", str(data), "--max_train_samples", "8"))
    assert not (out / "model.safetensors").exists() and not list(out.glob("checkpoint-*"))


def test_every_unreadable_training_image_is_named_before_training_one_line_each(tmp_path):
    data = split_image_folder(tmp_path / "data", broken_split="train")
    (data / "train" / "cat" / "notes.jpg").write_text("not an image")
    (data / "train" / "cat" / "empty.png").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(CorruptImageError) as info:
        train("pretrain", *tiny_pretrain(out, "--dataset_name", str(data)))
    head, *lines = str(info.value).splitlines()
    assert head.startswith("3 image(s) cannot be read") and "--no_check_eval_images" in head
    expected = {data / "train" / name for name in ("dog/broken.png", "cat/notes.jpg", "cat/empty.png")}
    assert {Path(line.strip().removeprefix("train: ").split(": ")[0]) for line in lines} == expected
    assert all(line.endswith(": not an image file PIL can read") for line in lines), lines
    assert " object at 0x" not in str(info.value) and not (out / "model.safetensors").exists()


def test_the_model_is_saved_before_the_final_evaluation(tmp_path):
    data = split_image_folder(tmp_path / "data", broken_split="test")
    out = tmp_path / "out"
    flags = ["--dataset_name", str(data), "--max_train_samples", "8", "--check_eval_images", "False"]
    with pytest.raises(CorruptImageError, match="broken.png"):
        train("pretrain", *tiny_pretrain(out, *flags))  # the final evaluation on test fails...
    VisionTransformerForImageClassification.from_pretrained(out)  # ...after the trained model was saved


def test_finetuning_another_models_folder_is_an_error_not_a_random_backbone(tmp_path):
    from transformers import ResNetConfig, ResNetModel

    ResNetModel(ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8)).save_pretrained(tmp_path / "rn")
    args = ["--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(tmp_path / "rn"), "--max_steps", "1"]
    with pytest.raises(ValueError, match="holds a 'resnet' checkpoint"):
        train("finetune", *parse_args("finetune", args + QUIET))


def test_one_class_is_an_error_not_a_regression(tmp_path):
    data = labelled_dataset(tmp_path / "data", ["only"], {"train": [0] * 8, "validation": [0] * 2})
    with pytest.raises(ValueError, match=r"1 class\(es\) \(\['only'\]\): classification needs at least two"):
        train("pretrain", *tiny_pretrain(tmp_path / "out", "--dataset_name", str(data)))


def test_a_class_without_training_images_is_named(tmp_path, caplog):
    splits = {"train": [0, 1] * 4, "validation": [0, 1], "test": [0, 1, 2]}
    data = labelled_dataset(tmp_path / "data", ["ant", "bee", "cow"], splits)
    with caplog.at_level("WARNING", logger="hf_vit"):
        train("pretrain", *tiny_pretrain(tmp_path / "out", "--dataset_name", str(data)))
    assert "Class(es) ['cow'] have no training images" in caplog.text


def fake_checkpoint(path, state="{}", weights=True, optimizer=True):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(state)
    if weights:
        save_file({"w": torch.zeros(64)}, path / "model.safetensors")
    if optimizer:
        torch.save({"state": {}}, path / "optimizer.pt")
        torch.save({"python": 1, "cpu": torch.get_rng_state()}, path / "rng_state.pth")
    return path


def test_half_written_checkpoints_are_skipped_and_named(tmp_path, caplog):
    fake_checkpoint(tmp_path / "checkpoint-2")
    fake_checkpoint(tmp_path / "checkpoint-4", state='{"global_step": 4, "log_hi')  # killed while writing the state
    cut = fake_checkpoint(tmp_path / "checkpoint-6")
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:100])
    with caplog.at_level("WARNING", logger="hf_vit"):
        assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    assert "checkpoint-4" in caplog.text and "trainer_state.json is cut off" in caplog.text
    assert "checkpoint-6" in caplog.text and "model.safetensors is truncated" in caplog.text


def test_checkpoints_of_lora_runs_resume_and_cut_configs_are_skipped(tmp_path, caplog):
    from safetensors.torch import save_file

    lora = fake_checkpoint(tmp_path / "checkpoint-2", weights=False)
    save_file({"w": torch.zeros(4)}, lora / "adapter_model.safetensors")  # a LoRA run's weights
    (lora / "adapter_config.json").write_text("{}")
    assert last_complete_checkpoint(tmp_path) == str(lora)
    cut = fake_checkpoint(tmp_path / "checkpoint-4")
    (cut / "config.json").write_text('{"model_type": "hf-vit", "hidden_si')
    fake_checkpoint(tmp_path / "checkpoint-6", weights=False)  # no weights at all
    with caplog.at_level("WARNING", logger="hf_vit"):
        assert last_complete_checkpoint(tmp_path) == str(lora)
    assert f"{cut / 'config.json'} is cut off" in caplog.text and "checkpoint-6 holds no model weights" in caplog.text


@pytest.mark.parametrize("damage", ["model.safetensors", "optimizer.pt", "rng_state.pth"])
def test_resuming_from_a_truncated_checkpoint_names_the_file(tmp_path, damage):
    checkpoint = fake_checkpoint(tmp_path / "checkpoint-2")
    data = (checkpoint / damage).read_bytes()
    (checkpoint / damage).write_bytes(data[: len(data) // 2])
    _, _, args = tiny_pretrain(tmp_path, "--resume_from_checkpoint", str(checkpoint))
    from hf_vit.train.checkpoints import resolve_resume

    with pytest.raises(ValueError, match=f"Cannot resume from {checkpoint}: {checkpoint / damage} is truncated"):
        resolve_resume(args.resume_from_checkpoint, args.output_dir, args.overwrite_output_dir)


def test_resuming_a_weights_only_checkpoint_is_refused(tmp_path):
    from hf_vit.train.checkpoints import resolve_resume

    fake_checkpoint(tmp_path / "checkpoint-2", optimizer=False)
    _, _, args = tiny_pretrain(tmp_path, "--resume_from_checkpoint", "True")
    with pytest.raises(ValueError, match="weights only.*--save_only_model.*restart the optimizer state"):
        resolve_resume(args.resume_from_checkpoint, args.output_dir, args.overwrite_output_dir)


def test_a_checkpoint_that_cannot_be_written_names_the_folder_and_free_space(tmp_path, monkeypatch):
    import transformers.trainer

    def stream_error(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: iostream error")

    monkeypatch.setattr(transformers.trainer.torch, "save", stream_error)
    out = tmp_path / "out"
    with pytest.raises(
        OSError, match=r"Writing the checkpoint 1 in .*out failed: .*iostream error \(.*GiB free there"
    ):
        train("pretrain", *tiny_pretrain(out, "--save_strategy", "steps", "--save_steps", "1"))


@pytest.mark.parametrize(
    "code, cause",
    [
        (errno.EFBIG, r"a file is larger than this file system"),
        (errno.ENOSPC, r"the disk is full: \d+\.\d GiB free there\)\. Free space"),
        (errno.EACCES, r"permission denied\)\. Fix that"),
    ],
)
def test_a_failed_checkpoint_write_names_its_cause_once(tmp_path, monkeypatch, code, cause):
    import transformers.trainer

    def failing_write(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(transformers.trainer.torch, "save", failing_write)
    with pytest.raises(OSError) as error:
        train("pretrain", *tiny_pretrain(tmp_path / "out", "--save_strategy", "steps", "--save_steps", "1"))
    message = str(error.value)
    assert re.search(cause, message), message
    assert message.count("Writing the") == 1 and message.count("--resume_from_checkpoint") == 1
    assert ("disk is full" in message) == (code == errno.ENOSPC) and "Is the disk full" not in message
    assert error.value.errno == code


def test_resuming_a_folder_without_checkpoints_says_there_is_none(tmp_path):
    from hf_vit.train.checkpoints import resolve_resume

    out = tmp_path / "out"
    _, _, args = tiny_pretrain(out, "--resume_from_checkpoint", "True")
    assert (
        resolve_resume(args.resume_from_checkpoint, args.output_dir, args.overwrite_output_dir) is None
    )  # no folder yet: a first run, started with the flag it will resume with
    train("pretrain", *tiny_pretrain(out))  # a finished run's folder, no checkpoint-N
    with pytest.raises(ValueError) as error:
        resolve_resume(args.resume_from_checkpoint, args.output_dir, args.overwrite_output_dir)
    message = str(error.value)
    assert f"{out} holds no complete checkpoint-N folder" in message and "config.json" in message
    assert "--overwrite_output_dir True" in message and "Pass --resume_from_checkpoint True" not in message
    (out / "hf_vit_run.json").unlink()  # model files no record claims: --overwrite_output_dir would refuse them too
    with pytest.raises(ValueError) as error:
        resolve_resume(args.resume_from_checkpoint, args.output_dir, args.overwrite_output_dir)
    assert "--overwrite_output_dir" not in str(error.value) and "Choose another --output_dir." in str(error.value)


def test_config_overrides_take_lists_and_json_values():
    from hf_vit.tasks.model_setup import parse_config_overrides

    parsed = parse_config_overrides('resnet_layers=[1,1],hidden_size=32, hidden_act=gelu,image_size=[16, 24],x="a,b"')
    assert parsed == {
        "resnet_layers": [1, 1],
        "hidden_size": 32,
        "hidden_act": "gelu",
        "image_size": [16, 24],
        "x": "a,b",
    }
    with pytest.raises(ValueError, match="unclosed bracket"):
        parse_config_overrides("resnet_layers=[1,1")
    with pytest.raises(ValueError, match=r"resnet_layers=\[1,,1\] is not a valid JSON value"):
        parse_config_overrides("resnet_layers=[1,,1]")


def test_a_hybrid_from_scratch_takes_its_resnet_layers_from_the_overrides(tmp_path):
    from hf_vit.tasks.model_setup import config_from_preset

    model_args, _, _ = parse_args(
        "pretrain",
        ["--output_dir", str(tmp_path), "--preset", "r50-vit-base-patch16-224", "--image_size", "32", "--patch_size",
         "8", "--config_overrides", f"{TINY},resnet_layers=[1,1],resnet_width=32"],
    )  # fmt: skip
    config = config_from_preset(model_args.settings())
    assert config.resnet_layers == [1, 1] and config.hidden_size == 32 and config.grid_size == (4, 4)
    VisionTransformerForImageClassification(config)(torch.randn(1, 3, 32, 32))  # the stem of two stages runs


def test_a_timm_checkpoint_of_unusual_width_takes_the_heads_of_the_overrides(tmp_path, monkeypatch):
    import huggingface_hub.constants
    from test_sources import hf_vit_source, hub_repo, timm_repo

    from hf_vit.tasks.model_setup import ModelSettings, build_classifier, processor_for
    from hf_vit.tasks.objectives import Labels

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = hf_vit_source(num_labels=4)  # width 32, 2 heads
    folder = hub_repo(tmp_path / "hub", "timm/vit_narrow.test")
    timm_repo(folder, source)
    config = json.loads((folder / "config.json").read_text())
    del config["model_args"]  # nothing says the heads of a width-32 model
    (folder / "config.json").write_text(json.dumps(config))
    labels = Labels({0: "a", 1: "b"}, "single_label_classification")
    settings = ModelSettings(model_name_or_path="timm/vit_narrow.test")
    with pytest.raises(ValueError, match="num_attention_heads"):
        build_classifier("finetune", settings, labels)
    settings = ModelSettings(model_name_or_path="timm/vit_narrow.test", config_overrides="num_attention_heads=2")
    model = build_classifier("finetune", settings, labels).eval()
    assert model.config.num_attention_heads == 2
    # the run's processor is the checkpoint's (timm's normalisation), whatever its heads
    assert processor_for(settings.model_name_or_path, model.config).image_mean == pytest.approx([0.485, 0.456, 0.406])
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.vit(x).last_hidden_state, source.vit(x).last_hidden_state)


def test_a_number_of_channels_the_images_do_not_have_is_refused_before_training(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError) as error:
        train("pretrain", *tiny_pretrain(out, "--num_channels", "2"))  # digits: grey images
    message = str(error.value)
    assert message.startswith("--num_channels 2:") and "grey (1 channel)" in message
    assert "Pass --num_channels 1" in message
    assert not out.exists()  # refused before anything was written


def test_multi_label_fine_tuning_metrics_and_sigmoid_pipeline(tmp_path):
    from transformers import pipeline

    source = pretrained_folder(tmp_path / "pre")
    data = multi_label_dataset(tmp_path / "tags")
    args = ["--model_name_or_path", str(source), "--dataset_name", str(data), "--label_column_name", "tags"]
    args += ["--output_dir", str(tmp_path / "out"), "--image_size", "8", "--max_steps", "30", "--eval_strategy", "no"]
    args += ["--save_strategy", "no", "--per_device_train_batch_size", "32", "--learning_rate", "0.05", *QUIET]
    metrics = train("finetune", *parse_args("finetune", args + ["--problem_type", "multi_label_classification"]))
    assert {"eval_mean_average_precision", "eval_f1_micro", "eval_f1_macro"} <= set(metrics)
    assert metrics["eval_mean_average_precision"] > 0.6  # above chance (about the classes' frequency, ~0.45)
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"{metrics['eval_mean_average_precision']:.4f}" in card and "- mean_average_precision" in card
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert model.config.problem_type == "multi_label_classification"
    assert set(model.config.id2label.values()) == {"even", "odd", "round"}
    image = Image.new("RGB", (8, 8), (200, 200, 200))
    scores = {r["label"]: r["score"] for r in pipeline("image-classification", str(tmp_path / "out"), top_k=3)(image)}
    pixels = VisionTransformerImageProcessor.from_pretrained(tmp_path / "out")(image, return_tensors="pt").pixel_values
    with torch.no_grad():
        expected = model(pixels).logits.sigmoid()[0]  # independent sigmoid scores, not a softmax
    for index, name in model.config.id2label.items():
        assert scores[name] == pytest.approx(expected[index].item(), abs=1e-5)
    with pytest.raises(ValueError, match="holds a list of classes per image"):
        train(
            "finetune",
            *parse_args(
                "finetune", args + ["--problem_type", "single_label_classification", "--overwrite_output_dir", "True"]
            ),
        )


def test_overwrite_output_dir_keeps_the_starting_checkpoint_and_deletes_nothing_when_the_run_fails(tmp_path):
    out = tmp_path / "out"
    train("pretrain", *tiny_pretrain(out, "--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "2"))
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-1", "checkpoint-2"}
    with pytest.raises(Exception, match="typo_dataset"):  # a run that fails to start...
        train("pretrain", *tiny_pretrain(out, "--overwrite_output_dir", "True", "--dataset_name", "typo_dataset"))
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-1", "checkpoint-2"}  # ...deletes nothing
    fine = ["--output_dir", str(out), "--model_name_or_path", str(out / "checkpoint-2"), "--image_size", "8"]
    fine += ["--max_steps", "1", "--eval_strategy", "no", "--save_strategy", "no", "--overwrite_output_dir", "True"]
    train("finetune", *parse_args("finetune", fine + ["--max_train_samples", "16", *QUIET]))
    # the earlier run's other checkpoint is gone, the one this run started from is kept
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-2"}


def test_the_scripts_end_bad_input_in_one_error_line(tmp_path):
    script = [sys.executable, str(ROOT / "scripts" / "finetune.py"), "--output_dir", str(tmp_path / "out")]
    done = subprocess.run(script + ["--model_name_or_path", str(tmp_path / "missing")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error:") and "missing" in done.stderr
