"""Model cards and pushing (the Hub itself is unreachable here: HfApi's network methods are replaced by recorders)."""

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import tiny_config
from huggingface_hub import ModelCard

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.outputs.cards import card_reference, write_model_card
from hf_vit.outputs.files import remote_code_files
from hf_vit.outputs.push import push_folder_to_hub

ROOT = Path(__file__).resolve().parents[1]
METRICS = {"eval_accuracy": 0.9722, "eval_top5_accuracy": 0.9972, "eval_split": "test", "eval_loss": 0.1}
# The code files save_pretrained writes beside every checkpoint.
CLASSIFIER_CODE = set(remote_code_files())
PROJECT_FILES = {"model.safetensors", "config.json", "preprocessor_config.json", "README.md", *CLASSIFIER_CODE}


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "run"
    model = VisionTransformerForImageClassification(tiny_config())
    model.save_pretrained(path)
    VisionTransformerImageProcessor(size=32).save_pretrained(path)
    return path, model


def test_card_renders_with_parseable_metadata(folder):
    path, model = folder
    write_model_card(
        path, model, METRICS, task="finetune", dataset_name="digits", repo_id="hf-vit/tiny", base_model="hf-vit/base"
    )
    card = ModelCard.load(path / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "image-classification"
    assert data["license"] == "apache-2.0" and data["datasets"] == ["digits"] and data["base_model"] == "hf-vit/base"
    assert "hf-vit" in data["tags"]
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results == {"accuracy": 0.9722, "top5_accuracy": 0.9972}
    text = card.text
    assert "| test | accuracy | 0.9722 |" in text and "trust_remote_code=True" in text
    assert "32x32" in text and "Limitations" in text and "Base model: `hf-vit/base`" in text


def test_push_needs_a_repo_id(folder):
    with pytest.raises(ValueError, match="hub_model_id"):
        push_folder_to_hub(folder[0], None)


def test_push_sends_exactly_the_projects_top_level_files(folder, hub, caplog):
    path, model = folder
    write_model_card(path, model, METRICS, task="finetune", dataset_name="digits", repo_id="me/vit")
    (path / "training_curves.png").write_bytes(b"\x89PNG curves")
    (path / "all_results.json").write_text(json.dumps({"eval_accuracy": 0.97}))
    # What a user's run folder also holds: none of it may leave the machine unless named.
    (path / "trainer_state.json").write_text(json.dumps({"best_model_checkpoint": "outputs/run/checkpoint-5"}))
    (path / "credentials.json").write_text('{"token": "hf_secret"}')
    for name in ("notes/secrets.py", "wandb/run-config.json", "eval_outputs/predictions.json", "checkpoint-5/x.json"):
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_text("{}")
    (path / "training_args.bin").write_bytes(b"pickle")
    (path / "checkpoint-5" / "optimizer.pt").write_bytes(b"pickle")
    outside = path.parent / "private.json"
    outside.write_text('{"private": true}')
    (path / "leak.json").symlink_to(outside)

    with caplog.at_level("INFO", logger="hf_vit.outputs.push"):
        assert push_folder_to_hub(path, "me/vit").endswith("/commit/0")
    assert f"Uploading {len(PROJECT_FILES) + 2} files" in caplog.text and "credentials.json" not in caplog.text
    assert hub["repo"] == "me/vit"
    assert set(hub["files"]) == PROJECT_FILES | {"training_curves.png", "all_results.json"}
    assert hub["files"]["model.safetensors"] == (path / "model.safetensors").read_bytes()

    push_folder_to_hub(path, "me/vit", extra_files=["eval_outputs/predictions.json"])
    assert set(hub["files"]) == PROJECT_FILES | {
        "training_curves.png",
        "all_results.json",
        "eval_outputs/predictions.json",
    }


def test_push_sends_sharded_weights_with_their_index(tmp_path, hub):
    path = tmp_path / "sharded"
    VisionTransformerForImageClassification(tiny_config()).save_pretrained(path, max_shard_size="30KB")
    VisionTransformerImageProcessor(size=32).save_pretrained(path)
    shards = {p.name for p in path.glob("model-*.safetensors")}
    assert len(shards) > 1
    push_folder_to_hub(path, "me/vit")
    assert set(hub["files"]) == {
        "config.json",
        "preprocessor_config.json",
        "model.safetensors.index.json",
        *shards,
        *CLASSIFIER_CODE,
    }


def test_push_refuses_symlinks_and_files_outside_the_folder(folder, hub):
    path, _ = folder
    outside = path.parent / "elsewhere.png"
    outside.write_bytes(b"\x89PNG private")
    (path / "training_curves.png").symlink_to(outside)
    with pytest.raises(ValueError, match=r"training_curves\.png .*symlink"):
        push_folder_to_hub(path, "me/vit")
    (path / "training_curves.png").unlink()
    (path / "notes.txt").symlink_to(outside)
    with pytest.raises(ValueError, match=r"notes\.txt .*symlink"):
        push_folder_to_hub(path, "me/vit", extra_files=["notes.txt"])
    with pytest.raises(ValueError, match="outside"):
        push_folder_to_hub(path, "me/vit", extra_files=["../elsewhere.png"])
    with pytest.raises(FileNotFoundError, match="missing.json"):
        push_folder_to_hub(path, "me/vit", extra_files=["missing.json"])
    assert "files" not in hub and "repo" not in hub


def test_push_refuses_a_folder_without_safetensors(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        push_folder_to_hub(tmp_path, "me/vit")


def test_card_reference_keeps_hub_ids_and_drops_local_paths(tmp_path):
    ref = card_reference("google/vit-base-patch16-224")
    assert (ref.text, ref.hub_id) == ("google/vit-base-patch16-224", "google/vit-base-patch16-224")
    assert card_reference("digits").text == "digits" and card_reference("digits").hub_id == "digits"
    for local in (str(tmp_path / "runs" / "vit"), "./runs/vit", "~/runs/vit", "a/b/vit", tmp_path / "runs" / "vit"):
        ref = card_reference(local)
        assert (ref.text, ref.hub_id) == ("vit", None), local
    (tmp_path / "data").mkdir()
    ref = card_reference(str(tmp_path / "data"))
    assert (ref.text, ref.hub_id) == ("data", None)


def test_card_names_no_local_path_and_no_invented_repo(folder):
    path, model = folder
    base, data = path.parent / "pretrain-run", path.parent / "private-data"
    base.mkdir()
    data.mkdir()
    write_model_card(
        path,
        model,
        METRICS,
        task="finetune",
        dataset_name=str(data),
        base_model=str(base),
        summary=f"Fine-tuned from {base}.",
    )
    text = (path / "README.md").read_text()
    assert str(path.parent) not in text
    card = ModelCard.load(path / "README.md")
    assert card.data.base_model is None and card.data.datasets is None
    assert "Base model: `pretrain-run`" in card.text and "`private-data`" in card.text
    assert "Fine-tuned from pretrain-run." in card.text
    # Without repo_id the card names the folder, not an organisation it made up.
    assert card.data.model_name == "run" and '"hf-vit/' not in text and 'model="run"' in text


def test_push_sends_a_card_naming_the_repo_pushed_to_and_keeps_the_users_file(folder, hub):
    path, model = folder
    write_model_card(path, model, METRICS, task="finetune", dataset_name="digits")
    before = (path / "README.md").read_bytes()
    push_folder_to_hub(path, "my-org/vit-digits")
    sent = ModelCard(hub["files"]["README.md"].decode())
    assert sent.data.model_name == "my-org/vit-digits" and sent.data.eval_results
    assert 'model="my-org/vit-digits"' in sent.text and 'from_pretrained("my-org/vit-digits"' in sent.text
    assert "\n# vit-digits\n" in sent.text and 'model="run"' not in sent.text
    assert (path / "README.md").read_bytes() == before
    push_folder_to_hub(path, "vit-digits")
    assert ModelCard(hub["files"]["README.md"].decode()).data.model_name == "alice/vit-digits"


def test_push_refuses_text_files_naming_local_paths(folder, hub):
    path, model = folder
    write_model_card(path, model, METRICS, task="finetune", dataset_name="digits", repo_id="me/vit")
    state = {"best_model_checkpoint": str(path / "checkpoint-5"), "log_history": []}
    (path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=rf"trainer_state\.json contains the local path '{path}/checkpoint-5'"):
        push_folder_to_hub(path, "me/vit", extra_files=["trainer_state.json"])
    home_path = f"{Path.home()}/datasets/private-data"
    (path / "all_results.json").write_text(json.dumps({"dataset": home_path}))
    with pytest.raises(ValueError, match=rf"all_results\.json contains the local path '{home_path}'"):
        push_folder_to_hub(path, "me/vit")
    (path / "all_results.json").unlink()
    card = (path / "README.md").read_text()
    (path / "README.md").write_text(card.replace("datasets:\n- digits", f"base_model: {path.parent}/pretrain-run"))
    with pytest.raises(ValueError, match=rf"README\.md contains the local path '{path.parent}/pretrain-run'"):
        push_folder_to_hub(path, "me/vit")
    assert "files" not in hub


def _push_script():
    spec = importlib.util.spec_from_file_location("push_to_hub_script", ROOT / "scripts" / "push_to_hub.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_push_script_dry_run_lists_the_files_and_sends_nothing(folder, hub, capsys):
    path, model = folder
    write_model_card(path, model, METRICS, task="finetune", dataset_name="digits")
    (path / "credentials.json").write_text("{}")
    (path / "eval_outputs").mkdir()
    (path / "eval_outputs" / "predictions.json").write_text("{}")
    argv = [
        "--model",
        str(path),
        "--hub_model_id",
        "me/vit",
        "--dry_run",
        "--include",
        "eval_outputs/predictions.json",
    ]
    assert _push_script().main(argv) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed == PROJECT_FILES | {"eval_outputs/predictions.json"}
    assert hub == {}


def test_card_and_readme_say_remote_code_executes(folder):
    path, model = folder
    write_model_card(path, model, METRICS, task="finetune", dataset_name="digits", repo_id="me/vit")
    for text in ((path / "README.md").read_text(), (ROOT / "README.md").read_text()):
        flat = " ".join(text.split())
        assert "are loaded" not in flat
        assert "trust_remote_code=True" in flat and "execute" in flat and "Read them first" in flat
        assert "import hf_vit" in flat and "needs no remote code" in flat


def test_the_published_cards_name_no_local_path():
    cards = sorted((ROOT / "model_cards").glob("*/README.md"))
    assert cards
    for card in cards:
        text = card.read_text()
        assert not any(root in text for root in ("/home/", "/tmp/", "/root/", "/work/", str(Path.home()))), card
        assert "trust_remote_code=True" not in text or "execute" in text, card


def test_every_code_file_a_saved_folder_needs_is_uploaded(folder, hub):
    # trust_remote_code loads the model from the Hub copy alone: a code file save_pretrained wrote but the push left
    # out would break it there
    path, model = folder
    write_model_card(path, model, METRICS, task="finetune", dataset_name="digits", repo_id="me/vit")
    saved_code = {p.name for p in path.glob("*.py")}
    assert {"modeling_vit.py", "attention.py", "resolution.py"} <= saved_code
    push_folder_to_hub(path, "me/vit")
    assert saved_code <= set(hub["files"])


def test_a_lora_runs_folder_pushes_its_adapter(tmp_path, hub):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "lora"
    folder.mkdir()
    VisionTransformerForImageClassification(tiny_config()).config.save_pretrained(folder)
    save_file({"lora_A": torch.zeros(2, 2)}, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "google/vit-base-patch16-224"}))
    push_folder_to_hub(folder, "me/lora")
    assert {"adapter_model.safetensors", "adapter_config.json", "config.json"} <= set(hub["files"])


def test_the_security_note_lists_every_code_file_that_executes(folder):
    path, model = folder
    write_model_card(path, model, METRICS, task="finetune", dataset_name="digits", repo_id="me/vit")
    card, readme = (path / "README.md").read_text(), (ROOT / "README.md").read_text()
    assert {"hybrid.py", "modeling_mpp.py"} <= set(remote_code_files())
    assert {p.name for p in path.glob("*.py")} == CLASSIFIER_CODE
    for name in remote_code_files():
        assert f"`{name}`" in card and f"`{name}`" in readme, name


def test_cards_say_how_to_install_and_carry_no_placeholder_rows(tmp_path):
    from hf_vit.outputs.cards import write_card

    model = VisionTransformerForImageClassification(tiny_config())
    write_card(tmp_path, model, base_model="google/vit-base-patch16-224", summary="Converted.", recipe="none.")
    card = (tmp_path / "README.md").read_text()
    assert "not measured" not in card and "| split | metric | value | measured on |" not in card
    assert "No metrics were measured for this folder" in card and "as for the base model" in card
    assert "`pip install hf-vit`" not in card and "git+https://github.com/hf-vit/hf-vit" in card
    assert ModelCard.load(tmp_path / "README.md").data.to_dict().get("datasets") is None


def test_a_lora_adapters_card_says_how_to_apply_it_to_its_base(tmp_path):
    from hf_vit.train.lora import apply_lora

    model = apply_lora(VisionTransformerForImageClassification(tiny_config()), 2, None, 0.0, ["qkv"])
    write_model_card(tmp_path, model, METRICS, task="finetune", dataset_name="digits", repo_id="me/lora",
                     base_model="google/vit-base-patch16-224")  # fmt: skip
    card = ModelCard.load(tmp_path / "README.md")
    assert "PeftModel" not in card.text and "VisionTransformerForImageClassification with a LoRA adapter" in card.text
    assert card.data.library_name == "peft" and card.data.base_model == "google/vit-base-patch16-224"
    assert "load_lora_model(folder)" in card.text and 'snapshot_download("me/lora")' in card.text
    assert "trust_remote_code" not in card.text and 'pipeline("image-classification", model="me/lora"' not in card.text


def test_a_masked_patch_prediction_models_card_says_what_it_is_and_its_code_runs(tmp_path):
    import re

    import torch
    from PIL import Image

    import hf_vit  # noqa: F401 - the Auto classes, as the card's code imports them
    from hf_vit import VisionTransformerForMaskedPatchPrediction

    model = VisionTransformerForMaskedPatchPrediction(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    VisionTransformerImageProcessor(size=32).save_pretrained(tmp_path)
    metrics = {"eval_mpp_accuracy": 0.25, "eval_split": "test", "eval_loss": 4.2}
    write_model_card(tmp_path, model, metrics, task="pretrain", dataset_name="digits", repo_id="me/mpp")
    card = ModelCard.load(tmp_path / "README.md")
    data = card.data.to_dict()
    assert data["pipeline_tag"] == "image-feature-extraction" and "image-classification" not in data["tags"]
    assert "masked-patch-prediction" in data["tags"] and not card.data.eval_results  # no classification task
    assert "Classes:" not in card.text and "LABEL_0" not in card.text and "no classes" in card.text
    assert "| test | mpp_accuracy | 0.2500 |" in card.text
    assert "hf-vit-finetune --model_name_or_path me/mpp" in card.text and "pipeline(" not in card.text
    # the card's Python block runs as written, on this folder for "me/mpp", and gives the encoder's features
    code = re.search(r"```python\n(.*?)```", card.text, re.S).group(1).replace('"me/mpp"', repr(str(tmp_path)))
    image = Image.new("RGB", (40, 30), (200, 30, 60))
    scope = {"image": image}
    exec(code, scope)
    pixels = VisionTransformerImageProcessor.from_pretrained(tmp_path)(image, return_tensors="pt").pixel_values
    with torch.no_grad():
        torch.testing.assert_close(scope["features"], model.vit(pixels).last_hidden_state)
