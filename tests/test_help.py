"""Each command's --help: saved as text that says what the flags say now, printed by the console commands without
importing the package, hf-vit's own flags and examples first, Trainer's ~110 behind --help_trainer."""

import subprocess
import sys
import types
from pathlib import Path

import pytest

from hf_vit.commands.help import HELP_FOLDER, command_help
from hf_vit_cli import COMMANDS


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_saved_help_is_what_the_flags_say(command):
    saved = (HELP_FOLDER / f"{command}.txt").read_text(encoding="utf-8")
    assert saved == command_help(command), f"run `python -m hf_vit.commands.help` to write {command}'s help again"


def test_the_console_command_answers_help_without_importing_the_package():
    probe = (
        "import sys, hf_vit_cli\n"
        "sys.argv = ['hf-vit-finetune', '--help']\n"
        "code = hf_vit_cli.finetune()\n"
        "print('imported:', sorted(m for m in ('torch', 'transformers', 'hf_vit') if m in sys.modules), code)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("imported: [] 0\n")
    assert done.stdout.startswith("usage: hf-vit-finetune") and "hf-vit's flags: the model" in done.stdout


def test_hf_vits_flags_and_examples_come_first_and_trainers_behind_a_flag(capsys, monkeypatch):
    """What `python scripts/finetune.py --help` prints (the command's function, the package imported): the same."""
    from hf_vit.commands.train import finetune

    for flag in ("--help", "-h"):
        monkeypatch.setattr(sys, "argv", ["finetune.py", "--output_dir", "x", flag])
        assert finetune() == 0
        shown = capsys.readouterr().out
        assert shown == (HELP_FOLDER / "hf-vit-finetune.txt").read_text(encoding="utf-8")
    assert shown.index("examples:") < shown.index("\n  --model_name_or_path") < shown.index("\n  --recipe")
    assert "--gradient_accumulation_steps" not in shown and "--help_trainer" in shown
    assert "--learning_rate 0.01" in shown and "--optim sgd" in shown  # the paper's fine-tuning defaults
    assert len(shown.splitlines()) < 250
    monkeypatch.setattr(sys, "argv", ["finetune.py", "--help_trainer"])
    assert finetune() == 0
    everything = capsys.readouterr().out
    assert "--gradient_accumulation_steps" in everything and "--recipe" in everything


def test_list_presets_names_every_preset_without_importing_the_package():
    from hf_vit import VisionTransformerConfig
    from hf_vit.commands.help import presets_text
    from hf_vit_cli import PRESETS_FILE

    saved = (HELP_FOLDER / PRESETS_FILE).read_text(encoding="utf-8")
    assert saved == presets_text(), "run `python -m hf_vit.commands.help` to write the presets again"
    assert all(f"  {name} " in saved for name in VisionTransformerConfig.preset_names())
    probe = (
        "import sys, hf_vit_cli\n"
        "sys.argv = ['hf-vit-pretrain', '--list_presets']\n"
        "code = hf_vit_cli.pretrain()\n"
        "print('imported:', sorted(m for m in ('torch', 'transformers', 'hf_vit') if m in sys.modules), code)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == saved + "imported: [] 0\n"


def test_the_training_helps_say_where_presets_and_image_folders_are_described(capsys, monkeypatch):
    from hf_vit.commands.train import pretrain

    pretraining = (HELP_FOLDER / "hf-vit-pretrain.txt").read_text(encoding="utf-8")
    finetuning = (HELP_FOLDER / "hf-vit-finetune.txt").read_text(encoding="utf-8")
    assert "--list_presets" in pretraining and "PRESETS" not in pretraining + finetuning
    assert "--preset" not in finetuning  # fine-tuning starts from --model_name_or_path only
    for text in (pretraining, finetuning):
        assert "root/<class>/*.jpg" in text  # --dataset_name says the image folder's layout
    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--list_presets"])  # scripts/pretrain.py, the package imported
    assert pretrain() == 0
    assert "vit-base-patch16-224" in capsys.readouterr().out


@pytest.mark.parametrize(
    "command, argv, said",
    [
        ("finetune", ["--lerning_rate", "0.1"], "--lerning_rate: did you mean --learning_rate?"),
        ("finetune", ["--data", "images"], "--data: the data set is --dataset_name"),
        ("pretrain", ["--dataset_name", "./no-such-images"], "--dataset_name ./no-such-images: no such folder"),
        ("finetune", ["--model_name_or_path", "outputs/quick/typo"], "--model_name_or_path outputs/quick/typo: no"),
        ("predict", ["--model", "~/no-such-model", "cat.jpg"], "--model ~/no-such-model: no such folder"),
        ("evaluate", ["--model", "m", "--dataset_nme", "x"], "--dataset_nme: did you mean --dataset_name?"),
    ],
)
def test_a_typo_in_a_flag_or_a_path_is_told_before_the_package_loads(command, argv, said):
    probe = (
        "import sys, hf_vit_cli\n"
        f"sys.argv = ['hf-vit-{command}', *{argv!r}]\n"
        f"code = hf_vit_cli.{command}()\n"
        "print('imported:', sorted(m for m in ('torch', 'transformers', 'hf_vit') if m in sys.modules), code)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout == "imported: [] 2\n", done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and said in line, line


@pytest.mark.parametrize(
    "command, argv, said",
    [
        ("pretrain", ["--preset", "vit-tny-patch16-224"], "--preset vit-tny-patch16-224: no such preset; did you mean "
         "vit-tiny-patch16-224?"),
        ("pretrain", ["--preset", "vit-tiny-patch16-22"], "its resolution 22 is not a multiple of its patch size 16; "
         "did you mean vit-tiny-patch16-224?"),
        ("finetune", ["--model_name_or_path", "run/checkpoint-9"], "--model_name_or_path run/checkpoint-9: no such"),
        ("pretrain", ["--learning_rate", "3e"], "--learning_rate 3e: not a number"),
        ("pretrain", ["--keep_head", "maybe"], "--keep_head maybe: not True or False"),
        ("pretrain", ["--optim", "adamw"], "--optim adamw: did you mean adamw_torch?"),
        ("predict", ["--model", "run", "cat.jpg", "photos"], "no such image file or folder: cat.jpg."),
        ("pretrain", ["--packed_sequence_length", "64"], "--packed_sequence_length packs native-aspect images: give "
         "--max_num_patches"),
        ("pretrain", ["--output_dir", "notes"], "--output_dir notes is not empty (it holds todo.txt). Pass "
         "--overwrite_output_dir True"),
        ("finetune", ["--model_name_or_path", "run", "--image_size", "63"], "--image_size 63 is not a multiple of the "
         "patch size 4 (--model_name_or_path run)"),
        ("pretrain", ["--image_size", "63"], "(--preset vit-tiny-patch16-224) in both height and width: use e.g. "
         "--image_size 64"),
        ("pretrain", ["--preset", "r50-vit-small-patch16-224", "--patch_size", "8", "--image_size", "20"],
         "patch size 8 (--patch_size)"),
        ("pretrain", ["--dataset_name", "cats"], "--dataset_name cats: cats holds one class folder (tabby)"),
        ("pretrain", ["--max_steps", "-5", "--num_train_epochs", "0"], "--num_train_epochs 0 trains nothing: give a "
         "positive number of epochs (or --max_steps N)."),
        ("finetune", ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be at least 1."),
        ("pretrain", ["--learning_rate", "-0.1"], "--learning_rate -0.1: must be at least 0."),
        ("pretrain", ["--image_size", "64", "-32"], "--image_size -32: must be at least 1."),
        ("predict", ["--model", "run", "photos", "--output", "notes/todo.txt"], "--output notes/todo.txt exists: name "
         "a new file"),
    ],
)  # fmt: skip
def test_what_needs_no_torch_is_told_before_torch_loads(tmp_path, command, argv, said):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"patch_size": 4}')
    (tmp_path / "photos").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "cats" / "tabby").mkdir(parents=True)
    (tmp_path / "cats" / "tabby" / "a.png").write_bytes(b"")
    probe = (
        "import sys, hf_vit_cli\n"
        "sys.modules['torch'] = None  # importing torch fails\n"
        f"sys.argv = ['hf-vit-{command}', *{argv!r}]\n"
        f"code = hf_vit_cli.{command}()\n"
        "print('imported:', sorted(m for m in ('transformers', 'hf_vit') if m in sys.modules), code)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.stdout == "imported: [] 2\n", done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and said in line, line


def test_what_is_right_is_not_refused_before_the_package_loads(tmp_path, monkeypatch):
    from hf_vit_cli import early_problem

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    (tmp_path / "out" / "hf_vit_run.json").write_text('{"files": ["config.json"]}')
    (tmp_path / "out" / "checkpoint-2").mkdir()
    (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (tmp_path / "out" / "checkpoint-2" / "model.safetensors").write_bytes(b"")
    (tmp_path / "out" / "checkpoint-2" / "optimizer.pt").write_bytes(b"")
    (tmp_path / "images" / "a").mkdir(parents=True)
    (tmp_path / "images" / "b").mkdir()
    (tmp_path / "labelled" / "images").mkdir(parents=True)  # one folder, its labels in the metadata file
    (tmp_path / "labelled" / "images" / "a.png").write_bytes(b"")
    (tmp_path / "labelled" / "images" / "metadata.jsonl").write_text('{"file_name": "a.png", "label": "cat"}\n')
    for argv in (
        ["--preset", "vit-base-patch16-384", "--image_size", "64", "32", "--learning_rate", "3e-4", "--keep_head"],
        ["--preset", "r50-vit-small-patch16-224", "--keep_head", "no", "--optim", "sgd", "--cutmix_minmax", ".2", "1"],
        ["--output_dir", "out", "--overwrite_output_dir"],
        ["--output_dir", "out", "--resume_from_checkpoint", "True", "--dataset_name", "images"],
        ["--dataset_name", "labelled"],
        ["--max_steps", "1_000", "--seed", " 7", "--learning_rate", "1_0e-3"],  # as int() and float() read them
        ["--output_dir", "out", "--do_train", "False", "--do_eval"],  # measures a checkpoint: writes its results only
        ["--num_train_epochs", "0", "--max_steps", "5"],  # the steps decide
        ["--num_train_epochs", "0", "--do_train", "False"],
        ["--preset", "vit-tiny-patch16-22", "--image_size", "32", "--max_num_patches", "4", "--packed_sequence_length",
         "8"],
    ):  # fmt: skip
        assert early_problem("hf-vit-pretrain", argv) is None, argv
    assert "--overwrite_output_dir True" in early_problem("hf-vit-pretrain", ["--output_dir", "out"])
    assert "--resume_from_checkpoint True" in early_problem("hf-vit-pretrain", ["--output_dir", "out"])
    assert early_problem("hf-vit-predict", ["--model", "out", "images", "--top_k", "3"]) is None
    (tmp_path / "google" / "vit-base-patch16-224").mkdir(parents=True)  # one model of an owner downloaded here
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online: the Hub answers for it
    assert early_problem("hf-vit-finetune", ["--model_name_or_path", "google/vit-large-patch16-224"]) is None


def test_a_non_empty_output_dir_is_told_only_the_ways_the_run_would_take(tmp_path):
    import torch
    from safetensors.torch import save_file

    from hf_vit.outputs.output_folders import OutputDirError, claim_output_dir, release
    from hf_vit.train.checkpoints import resolve_resume, resumable_checkpoint
    from hf_vit_cli import early_problem

    def ways(folder):  # what the run itself does: claim the folder with --overwrite_output_dir, resume from it
        said = early_problem("hf-vit-finetune", ["--output_dir", str(folder)])
        try:
            release(claim_output_dir(folder, resume_from=None, overwrite=True, main_process=True))
            overwrites = True
        except OutputDirError:
            overwrites = False
        return said, overwrites, resumable_checkpoint(folder) is not None

    mine = tmp_path / "project"  # a user's own README and config: --overwrite_output_dir refuses them
    mine.mkdir()
    (mine / "README.md").write_text("my notes")
    (mine / "config.json").write_text("{}")
    said, overwrites, resumes = ways(mine)
    assert not overwrites and not resumes and "--overwrite_output_dir True" not in said, said
    assert "Move README.md, config.json away (no hf_vit_run.json says an hf-vit run wrote them" in said, said
    cut = mine / "checkpoint-4"  # killed while saving: no weights, no trainer_state.json
    cut.mkdir()
    (cut / "optimizer.pt").write_bytes(b"")
    said, overwrites, resumes = ways(mine)
    assert not resumes and "--resume_from_checkpoint" not in said, said
    weights_only = mine / "checkpoint-6"  # saved with --save_only_model: resuming it is refused
    weights_only.mkdir()
    (weights_only / "trainer_state.json").write_text("{}")
    save_file({"weight": torch.zeros(1)}, weights_only / "model.safetensors")
    assert "--resume_from_checkpoint" not in ways(mine)[0]
    with pytest.raises(ValueError, match="holds the weights only"):
        resolve_resume(True, mine)
    (mine / "hf_vit_run.json").write_text('{"files": ["README.md", "config.json"]}')  # an earlier run wrote them
    said, overwrites, resumes = ways(mine)
    assert overwrites and "Pass --overwrite_output_dir True to train a new model there" in said, said
    assert (mine / "README.md").exists()  # the check itself removes nothing
    real_iterdir = Path.iterdir

    def unreadable(path):  # a checkpoint folder this user may not list
        if path.name == "checkpoint-4":
            raise PermissionError(13, "Permission denied", str(path))
        return real_iterdir(path)

    (tmp_path / "cats" / "checkpoint-4").mkdir(parents=True)  # a data set's one folder this user may not list
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "iterdir", unreadable)
        assert early_problem("hf-vit-finetune", ["--output_dir", str(mine)]) is None  # the run says what, no traceback
        assert early_problem("hf-vit-finetune", ["--dataset_name", str(tmp_path / "cats")]) is None
    (mine / "checkpoint-2").symlink_to(cut)  # a link the run would write through: the run names it, not told here
    assert early_problem("hf-vit-finetune", ["--output_dir", str(mine)]) is None
    with pytest.raises(OutputDirError, match="checkpoint-2 is a symlink"):
        claim_output_dir(mine, resume_from=None, overwrite=True, main_process=True)


@pytest.mark.parametrize("command", ["hf-vit-pretrain", "hf-vit-finetune"])
def test_the_saved_flag_lists_are_every_flag_the_training_commands_take(command):
    from hf_vit.commands.help import all_flags
    from hf_vit_cli import flags_file

    saved = (HELP_FOLDER / flags_file(command)).read_text(encoding="utf-8")
    assert saved == all_flags(command), "run `python -m hf_vit.commands.help` to write the flag lists again"
    assert {"--learning_rate", "--local-rank", "--dataset_name", "--hflip"} <= set(saved.split())


def test_a_hub_id_the_offline_cache_lacks_is_told_before_the_package_loads(tmp_path, monkeypatch):
    from hf_vit_cli import early_problem

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub" / "models--google--vit-base-patch16-224").mkdir(parents=True)
    said = early_problem("hf-vit-finetune", ["--model_name_or_path", "my-run"])
    assert said.startswith("--model_name_or_path my-run: no such folder, and with HF_HUB_OFFLINE=1 a Hub model"), said
    assert "datasets--" not in said and early_problem("hf-vit-pretrain", ["--dataset_name", "digits"]) is None
    assert "Hub dataset" in early_problem("hf-vit-pretrain", ["--dataset_name", "someone/images"])
    assert early_problem("hf-vit-finetune", ["--model_name_or_path", "google/vit-base-patch16-224"]) is None  # cached
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "prepared"))  # load_dataset offline reads its own cache
    (tmp_path / "prepared" / "someone___cat_photos" / "default" / "0.0.0" / "abc").mkdir(parents=True)
    assert early_problem("hf-vit-pretrain", ["--dataset_name", "someone/cat_photos"]) is None
    assert "Hub dataset" in early_problem("hf-vit-pretrain", ["--dataset_name", "someone/dog_photos"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online: the Hub answers for it
    assert early_problem("hf-vit-finetune", ["--model_name_or_path", "my-run"]) is None


def test_ctrl_c_ends_a_run_with_one_line_naming_the_checkpoint_to_resume_from(tmp_path, monkeypatch, capsys):
    import hf_vit_cli

    def interrupted():
        for step in (4, 12, 13):  # 12 saved before the interruption, 13 being saved when it came (no state yet)
            (tmp_path / "out" / f"checkpoint-{step}").mkdir(parents=True)
            (tmp_path / "out" / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"")
        for step in (4, 12):
            (tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
        raise KeyboardInterrupt

    command = types.ModuleType("interrupted_command")
    command.main = interrupted
    monkeypatch.setitem(sys.modules, "interrupted_command", command)
    monkeypatch.setitem(hf_vit_cli.COMMANDS, "hf-vit-finetune", ("interrupted_command", "main"))
    assert hf_vit_cli.run("hf-vit-finetune", ["--output_dir", str(tmp_path / "out")]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"interrupted. The newest checkpoint is {tmp_path / 'out' / 'checkpoint-12'}: the same command with "
        "--resume_from_checkpoint True goes on from it."
    ]
    assert "No complete checkpoint was saved" in hf_vit_cli.early.resume_hint(["--output_dir", str(tmp_path / "none")])
