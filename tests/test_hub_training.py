"""What a training run sends to the Hub and leaves on disk, recorded at HfApi's write calls (never the network):
Trainer's own pushes go through the project's upload plan, the token reaches no byte sent or written, and the
output folder is never written through a link nor cleared of what the project did not write."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_vit.outputs.files import remote_code_files
from hf_vit.outputs.push import find_local_path, plan_upload
from hf_vit.train.arguments import parse_args
from hf_vit.train.training import train

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_FAKEtoken0123456789abcdefSECRET"
TINY = "hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32"
RUN = [
    *("--image_size", "8", "--patch_size", "4", "--config_overrides", TINY, "--per_device_train_batch_size", "8"),
    *("--max_train_samples", "16", "--eval_strategy", "no", "--disable_tqdm", "True", "--report_to", "none"),
    *("--dataloader_num_workers", "0"),
]
CODE_FILES = set(remote_code_files())  # every checkpoint carries all of them
MODEL_FILES = {"config.json", "model.safetensors", "preprocessor_config.json", *CODE_FILES}
FINAL_FILES = MODEL_FILES | {"README.md", "all_results.json", "training_curves.png"}


def assert_nothing_private(sent, *private: str) -> None:
    for commit in sent.commits:
        for name, data in commit.files.items():
            assert not name.endswith(("training_args.bin", ".lock", "notes.txt")), name
            for secret in private:
                assert secret.encode() not in data, (name, secret)
            if name.endswith((".json", ".md", ".py")):
                assert find_local_path(data.decode()) is None, (name, find_local_path(data.decode()))


def files_holding(folder: Path, needle: bytes) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints"])
def test_a_runs_pushes_send_only_the_plan_and_no_token(tmp_path, hub, strategy):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text(f"my notes, kept at {tmp_path}")
    flags = ["--output_dir", str(out), *RUN, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"]
    flags += ["--push_to_hub", "True", "--hub_model_id", "me/vit", "--hub_token", TOKEN, "--hub_strategy", strategy]
    train("pretrain", *parse_args("pretrain", flags + ["--overwrite_output_dir", "True"]))

    assert sent_repos(hub) == ["me/vit"] and hub.tokens == {TOKEN}
    # one commit per checkpoint (the model files, and the resume state for the checkpoint strategies), one final
    assert len(hub.commits) == 3
    final = hub.commits[-1]
    assert set(final.files) == FINAL_FILES and "final model" in final.message
    for step, commit in enumerate(hub.commits[:2], start=1):
        root = {name for name in commit.files if "/" not in name}
        assert root == MODEL_FILES, commit.files.keys()
        nested = {name for name in commit.files if "/" in name}
        if strategy == "every_save":
            assert not nested
        else:
            prefix = "last-checkpoint" if strategy == "checkpoint" else f"checkpoint-{step}"
            names = {name.removeprefix(prefix + "/") for name in nested}
            assert {n.split("/")[0] for n in nested} == {prefix}
            assert names == MODEL_FILES | {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}
    # what was sent is what the plan lists for the folder, and nothing private is among it
    assert set(final.files) == {item.path_in_repo for item in plan_upload(out, "me/vit")}
    assert_nothing_private(hub, TOKEN, str(tmp_path), str(Path.home()))
    # and the token is nowhere on disk: training_args.bin (a pickle of the arguments) is saved without it
    assert files_holding(out, TOKEN.encode()) == []
    assert (out / "notes.txt").exists() and (out / "checkpoint-2" / "training_args.bin").exists()


def sent_repos(hub):
    return sorted(set(hub.repos))


def test_trainer_push_to_hub_called_by_the_user_goes_through_the_plan(tmp_path, hub):
    from hf_vit.train.trainer import VisionTransformerTrainer

    out = tmp_path / "run"
    flags = ["--output_dir", str(out), *RUN, "--max_steps", "1", "--save_strategy", "no"]
    train("pretrain", *parse_args("pretrain", flags))
    (out / "notes.txt").write_text("mine")
    from hf_vit import VisionTransformerForImageClassification

    model = VisionTransformerForImageClassification.from_pretrained(out)
    _, _, args = parse_args("pretrain", flags + ["--hub_model_id", "me/again", "--hub_token", TOKEN])
    trainer = VisionTransformerTrainer(model=model, args=args)
    assert args.hub_token is None  # the arguments Trainer pickles hold no token
    trainer.push_to_hub(commit_message="by hand")
    assert sent_repos(hub) == ["me/again"] and hub.tokens == {TOKEN}
    (commit,) = hub.commits
    assert set(commit.files) <= FINAL_FILES and MODEL_FILES <= set(commit.files)
    assert_nothing_private(hub, TOKEN, str(tmp_path))


def test_a_push_that_cannot_reach_the_hub_ends_in_one_error_line(tmp_path):
    out = tmp_path / "run"
    flags = ["--output_dir", str(out), *RUN, "--max_steps", "1", "--save_strategy", "no", "--push_to_hub", "True"]
    flags += ["--hub_model_id", "me/vit", "--hub_token", TOKEN]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    script = ROOT / "scripts" / "pretrain.py"
    done = subprocess.run([sys.executable, str(script), *flags], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "me/vit" in errors[0] and "HF_HUB_OFFLINE=1" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and TOKEN not in done.stderr + done.stdout


def test_the_output_folder_is_never_written_through_a_link(tmp_path):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    for name in ("README.md", "all_results.json"):
        (elsewhere / name).write_text("the user's own file")
        (out / name).symlink_to(elsewhere / name)
    flags = ["--output_dir", str(out), *RUN, "--max_steps", "1", "--save_strategy", "no"]
    with pytest.raises(FileExistsError, match="README.md is a symlink"):
        train("pretrain", *parse_args("pretrain", flags + ["--overwrite_output_dir", "True"]))
    assert {p.read_text() for p in elsewhere.iterdir()} == {"the user's own file"}
    with pytest.raises(ValueError, match="holds no complete checkpoint-N folder"):  # nothing to resume: refused
        train("pretrain", *parse_args("pretrain", flags + ["--resume_from_checkpoint", "True"]))
    assert {p.read_text() for p in elsewhere.iterdir()} == {"the user's own file"}


def test_a_users_folder_named_like_a_checkpoint_is_never_deleted(tmp_path):
    out = tmp_path / "run"
    flags = ["--output_dir", str(out), *RUN, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"]
    flags += ["--save_total_limit", "2"]
    train("pretrain", *parse_args("pretrain", flags))
    assert (out / "checkpoint-1" / "optimizer.pt").exists()
    mine = out / "checkpoint-7"
    mine.mkdir()
    (mine / "photos.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="checkpoint-7 is not a checkpoint of a run.*photos.txt"):
        train("pretrain", *parse_args("pretrain", flags + ["--overwrite_output_dir", "True"]))
    assert (mine / "photos.txt").read_text() == "mine" and (out / "checkpoint-1").exists()
    (mine / "photos.txt").unlink()
    mine.rmdir()
    # real checkpoints of the earlier run are what --overwrite_output_dir removes
    train("pretrain", *parse_args("pretrain", flags + ["--overwrite_output_dir", "True", "--seed", "3"]))
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2


@pytest.mark.parametrize(
    "text",
    [
        '{"base_model_name_or_path": "/srv/models/base"}',
        "weights at /var/tmp/run/x",
        "C:\\Users\\bob\\model",
        "see ~/models/vit",
        "file:///data/x",
    ],
)
def test_the_push_scan_catches_any_absolute_path(tmp_path, text):
    from conftest import tiny_config

    from hf_vit import VisionTransformerForImageClassification

    folder = tmp_path / "m"
    VisionTransformerForImageClassification(tiny_config()).save_pretrained(folder)
    (folder / "all_results.json").write_text(json.dumps({"note": text}))
    with pytest.raises(ValueError, match="contains the local path"):
        plan_upload(folder, "me/vit")


def test_hf_vit_push_without_network_ends_in_one_error_line(tmp_path):
    from conftest import tiny_config

    from hf_vit import VisionTransformerForImageClassification

    VisionTransformerForImageClassification(tiny_config()).save_pretrained(tmp_path / "m")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "push_to_hub.py"), "--model", str(tmp_path / "m")]
    done = subprocess.run([*command, "--hub_model_id", "me/vit"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "me/vit" in errors[0], done.stderr[-2000:]


def test_an_overwritten_runs_folder_holds_and_pushes_only_what_the_new_run_wrote(tmp_path, hub):
    from test_training import pretrained_folder

    from hf_vit.outputs.files import TRAINER_FILES

    base = pretrained_folder(tmp_path / "base")
    out = tmp_path / "run"
    flags = ["--model_name_or_path", str(base), "--output_dir", str(out), "--image_size", "8", "--max_steps", "1"]
    flags += ["--per_device_train_batch_size", "8", "--max_train_samples", "16", "--eval_strategy", "no"]
    flags += ["--save_strategy", "no", "--disable_tqdm", "True", "--report_to", "none"]
    flags += ["--dataloader_num_workers", "0"]
    # a full fine-tune on native-aspect batches: its weights and its compute dial
    train("finetune", *parse_args("finetune", flags + ["--max_num_patches", "4"]))
    assert {"model.safetensors", "compute_dial.json", "compute_dial.png"} <= {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("mine")
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir() if p.is_file()}

    # a LoRA run over it, pushed
    lora = ["--lora_rank", "2", "--overwrite_output_dir", "True", "--push_to_hub", "True", "--hub_model_id", "me/lora"]
    train("finetune", *parse_args("finetune", flags + lora))
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir() if p.is_file()}
    wrote = {name for name, signature in after.items() if before.get(name) != signature}
    # the folder holds what this run wrote, and the user's file; nothing of the earlier run
    assert set(after) == wrote | {"notes.txt"} and after["notes.txt"] == before["notes.txt"]
    assert not {"model.safetensors", "compute_dial.json", "compute_dial.png"} & set(after)
    # the push sent what this run wrote (but the files never shared), byte for byte
    (final,) = hub.commits
    assert set(final.files) == wrote - set(TRAINER_FILES)
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(final.files)
    for name, data in final.files.items():
        assert name == "README.md" or data == after[name][1], name
