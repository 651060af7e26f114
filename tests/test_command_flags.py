"""What the installed commands say about their own flags: every flag `--help` lists has a description, a flag's bad
value is one `error:` line naming it (exit 2) before any model is loaded, and `--help` points to what an installed
package has (console commands, not the repository's scripts)."""

import pytest

from hf_vit.commands import predict, resize


def help_text(command, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        command.main(["--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "0"])
def test_predict_refuses_a_batch_size_below_one_by_name(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        predict.main(["--model", str(tmp_path / "no-model"), str(tmp_path / "no-image.png"), "--batch_size", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --batch_size must be at least 1, got ") and err.count("\n") == 1, err


def test_predicts_batch_size_has_help(capsys):
    text = help_text(predict, capsys)
    options = text[text.index("\noptions:") :]
    flag = options[options.index("--batch_size BATCH_SIZE") :].split("\n  --")[0]
    assert "images per forward pass" in " ".join(flag.split()), flag


def test_resizes_help_names_the_console_command_not_a_script(capsys):
    text = help_text(resize, capsys)
    assert "scripts/" not in text and ".py" not in text
    assert "hf-vit-convert --help" in text and "--overwrite replaces only a folder hf-vit wrote" in text
