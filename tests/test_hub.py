"""Model cards and pushing (the Hub itself is unreachable here: the push goes to a recording stand-in of HfApi)."""

import pytest
from conftest import tiny_config
from huggingface_hub import ModelCard
from huggingface_hub.utils import filter_repo_objects

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.hub import push_folder_to_hub, write_model_card


@pytest.fixture
def folder(tmp_path):
    model = VisionTransformerForImageClassification(tiny_config())
    model.save_pretrained(tmp_path)
    VisionTransformerImageProcessor(size=32).save_pretrained(tmp_path)
    return tmp_path, model


def test_card_renders_with_parseable_metadata(folder):
    path, model = folder
    metrics = {"eval_accuracy": 0.9722, "eval_top5_accuracy": 0.9972, "eval_split": "test", "eval_loss": 0.1}
    write_model_card(
        path, model, metrics, task="finetune", dataset_name="digits", repo_id="hf-vit/tiny", base_model="hf-vit/base"
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
    assert "32x32" in text and "Limitations" in text


def test_push_needs_a_repo_id(folder):
    with pytest.raises(ValueError, match="hub_model_id"):
        push_folder_to_hub(folder[0], None)


def test_push_uploads_only_safetensors_configs_code_and_card(folder, monkeypatch):
    path, model = folder
    (path / "training_args.bin").write_bytes(b"pickle")
    (path / "pytorch_model.bin").write_bytes(b"pickle")
    (path / "checkpoint-5").mkdir()
    (path / "checkpoint-5" / "optimizer.pt").write_bytes(b"pickle")
    calls = {}

    class RecordingApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, **kwargs):
            calls["create_repo"] = repo_id

        def upload_folder(self, repo_id, folder_path, allow_patterns, ignore_patterns, **kwargs):
            files = [p.relative_to(folder_path).as_posix() for p in path.rglob("*") if p.is_file()]
            calls["uploaded"] = sorted(
                filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
            )
            return "https://huggingface.co/me/vit/commit/0"

    monkeypatch.setattr("huggingface_hub.HfApi", RecordingApi)
    assert push_folder_to_hub(path, "me/vit").endswith("/commit/0")
    assert calls["create_repo"] == "me/vit"
    uploaded = calls["uploaded"]
    assert {"model.safetensors", "config.json", "preprocessor_config.json", "modeling_vit.py"} <= set(uploaded)
    assert not [f for f in uploaded if f.endswith((".bin", ".pt", ".pth")) or f.startswith("checkpoint-")]


def test_push_refuses_a_folder_without_safetensors(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        push_folder_to_hub(tmp_path, "me/vit")
