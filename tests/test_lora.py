"""LoRA fine-tuning with peft: adapters on the fused qkv (or on its query/value parts only), the head in full, saved
as peft's safetensors adapter that merges back into the base model."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_training import QUIET, pretrained_folder

from hf_vit.lora import load_lora_model
from hf_vit.outputs.files import LOCAL_BASE_FILE
from hf_vit.tasks.model_setup import load_checkpoint as load_for_finetuning
from hf_vit.train.arguments import parse_args
from hf_vit.train.lora import apply_lora
from hf_vit.train.training import train


def lora_run(tmp_path, *flags):
    source = pretrained_folder(tmp_path / "pre")
    out = tmp_path / "lora"
    args = ["--model_name_or_path", str(source), "--output_dir", str(out), "--image_size", "8", "--max_steps", "20"]
    args += ["--per_device_train_batch_size", "16", "--eval_strategy", "no", "--save_strategy", "no"]
    args += ["--learning_rate", "0.05", "--max_train_samples", "64", "--lora_rank", "4", *flags, *QUIET]
    metrics = train("finetune", *parse_args("finetune", args))
    return source, out, metrics


def test_a_lora_run_saves_an_adapter_that_merges_into_the_base(tmp_path):
    from peft import PeftModel

    source, out, metrics = lora_run(tmp_path)
    files = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "config.json", "README.md"} <= files
    assert "model.safetensors" not in files  # the adapter, not a copy of the base model
    adapter = load_file(out / "adapter_model.safetensors")
    assert any("lora_B" in key and value.abs().max() > 0 for key, value in adapter.items())  # it was trained
    assert any("classifier" in key for key in adapter)  # the new head is saved with it, in full
    # a local base is named by its plain name: no path of this machine in the adapter's files, only in the file
    # that records where the base is on this machine (which no push carries)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == source.name
    local = json.loads((out / LOCAL_BASE_FILE).read_text())
    assert local == {"base_model_name_or_path": str(source.resolve())}
    for path in out.iterdir():
        if path.is_file() and path.suffix in (".json", ".md", ".txt") and path.name != LOCAL_BASE_FILE:
            assert str(tmp_path) not in path.read_text(), path.name
    card = (out / "README.md").read_text()
    assert f"base_model: {source.name}" not in card  # a local folder: named in the text, not the Hub metadata
    assert "LoRA adapter" in card and f"local model `{source.name}`" in card and "base=" in card

    id2label = {i: str(i) for i in range(10)}
    x = torch.randn(4, 3, 8, 8)
    adapted = PeftModel.from_pretrained(load_for_finetuning(str(source), id2label, image_size=8), out).eval()
    merged = load_lora_model(out)  # on the machine that trained it, the base is found where it was
    base = load_for_finetuning(str(source), id2label, image_size=8).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, adapted(x).logits, atol=1e-5, rtol=1e-5)
        assert (merged(x).logits - base(x).logits).abs().max() > 1e-3
    moved = source.rename(tmp_path / "moved")
    with pytest.raises(OSError, match="base=<that folder>"):
        load_lora_model(out)  # named "pre" only, and no longer where it was: where it is, the caller says
    with torch.no_grad():
        torch.testing.assert_close(load_lora_model(out, base=moved)(x).logits, adapted(x).logits)
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0


def test_query_value_parts_leave_the_keys_untouched(tmp_path):
    source, out, _ = lora_run(tmp_path, "--lora_target_modules", "query,value")
    adapter = load_file(out / "adapter_model.safetensors")
    b = next(value for key, value in adapter.items() if "qkv.lora_B" in key)
    width = b.shape[0] // 3
    assert b[width : 2 * width].abs().max() == 0  # key rows stayed zero
    assert b[:width].abs().max() > 0 and b[2 * width :].abs().max() > 0
    merged = load_lora_model(out, base=source)
    base = load_for_finetuning(str(source), {i: str(i) for i in range(10)}, image_size=8)
    merged_qkv, base_qkv = merged.vit.layers[0].attention.qkv.weight, base.vit.layers[0].attention.qkv.weight
    torch.testing.assert_close(merged_qkv[width : 2 * width], base_qkv[width : 2 * width])
    assert (merged_qkv[:width] - base_qkv[:width]).abs().max() > 0


def test_fused_qkv_at_rank_r_has_the_parameters_of_query_value_at_rank_r(tmp_path):
    source = pretrained_folder(tmp_path / "pre")
    id2label = {0: "a", 1: "b"}
    fused = apply_lora(load_for_finetuning(str(source), id2label), rank=4, target_modules=["qkv"])
    parts = apply_lora(load_for_finetuning(str(source), id2label), rank=4, target_modules=["query", "value"])

    def adapter_parameters(model):
        return sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)

    width, layers, rank = 32, 2, 4
    assert adapter_parameters(fused) == layers * rank * (width + 3 * width) == layers * 2 * rank * (width + width)
    assert adapter_parameters(parts) == adapter_parameters(fused)  # the masked key rows are stored, kept at zero
    with pytest.raises(ValueError, match="choose from"):
        apply_lora(load_for_finetuning(str(source), id2label), rank=4, target_modules=["queries"])


def test_the_merged_model_is_the_runs_model_with_its_settings(tmp_path):
    """--interpolation bilinear, a pre-logits layer and another image size: the merge rebuilds the same model (it
    resampled bicubic and had no pre-logits layer: logits off, or a size-mismatch error)."""
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from hf_vit.lora import save_merged_model

    flags = ("--interpolation", "bilinear", "--representation_size", "16", "--image_size", "12")
    source, out, _ = lora_run(tmp_path, *flags)
    id2label = {i: str(i) for i in range(10)}
    run_model = load_for_finetuning(
        str(source), id2label, image_size=12, representation_size=16, interpolation="bilinear"
    )
    adapted = PeftModel.from_pretrained(run_model, out).eval()
    merged = load_lora_model(out, base=source)
    assert merged.config.image_size == 12 and merged.config.representation_size == 16
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, adapted(x).logits, atol=1e-5, rtol=1e-5)
    save_merged_model(out, tmp_path / "merged", base=source)
    reloaded = AutoModelForImageClassification.from_pretrained(tmp_path / "merged").eval()
    processor = AutoImageProcessor.from_pretrained(tmp_path / "merged")
    assert processor.size == {"height": 12, "width": 12}
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, adapted(x).logits, atol=1e-5, rtol=1e-5)
    assert str(tmp_path) not in (tmp_path / "merged" / "config.json").read_text()


def test_multi_label_lora_keeps_its_problem_type(tmp_path):
    from test_training import multi_label_dataset

    data = multi_label_dataset(tmp_path / "tags")
    flags = ("--dataset_name", str(data), "--label_column_name", "tags", "--max_train_samples", "96")
    source, out, metrics = lora_run(tmp_path, *flags)
    assert json.loads((out / "config.json").read_text())["problem_type"] == "multi_label_classification"
    merged = load_lora_model(out, base=source)
    assert merged.config.problem_type == "multi_label_classification"
    assert "eval_mean_average_precision" in metrics


def test_lora_on_a_hub_id_in_transformers_layout_names_the_hub_id(tmp_path, monkeypatch):
    """The base converted on load: the adapter names the Hub id (it named a deleted conversion folder), and merges."""
    import huggingface_hub.constants
    from test_sources import hub_repo
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = hub_repo(cache, "google/vit-tiny-test")
    torch.manual_seed(0)
    config = ViTConfig(image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    ViTForImageClassification(config).save_pretrained(snapshot)
    ViTImageProcessor(size={"height": 8, "width": 8}).save_pretrained(snapshot)

    out = tmp_path / "lora"
    args = ["--model_name_or_path", "google/vit-tiny-test", "--output_dir", str(out), "--max_steps", "4"]
    args += ["--per_device_train_batch_size", "16", "--eval_strategy", "no", "--save_strategy", "no"]
    args += ["--max_train_samples", "32", "--lora_rank", "2", *QUIET]
    train("finetune", *parse_args("finetune", args))
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "google/vit-tiny-test"
    merged = load_lora_model(out)
    assert merged.config.num_labels == 10
    assert "the Hub model `google/vit-tiny-test`" in (out / "README.md").read_text()


@pytest.mark.parametrize(
    "flags, missing, named",
    [
        (["--lora_target_modules", "qvk"], None, "--lora_target_modules qvk: not a layer LoRA can adapt"),
        ([], "peft", 'needs peft, which is not installed: pip install "hf-vit[lora]"'),
    ],
)
def test_a_refused_lora_start_writes_nothing_and_the_corrected_command_runs(
    tmp_path, monkeypatch, capsys, flags, missing, named
):
    import sys

    from hf_vit.train.training import main

    source = pretrained_folder(tmp_path / "pre")
    out = tmp_path / "lora"
    args = ["--model_name_or_path", str(source), "--output_dir", str(out), "--image_size", "8", "--max_steps", "1"]
    args += ["--per_device_train_batch_size", "8", "--eval_strategy", "no", "--save_strategy", "no"]
    args += ["--max_train_samples", "8", "--lora_rank", "2", *QUIET]
    with monkeypatch.context() as patch:
        if missing:
            patch.setitem(sys.modules, missing, None)  # as if the extra were not installed
        with pytest.raises(SystemExit) as stopped:
            main("finetune", args + flags)
    errors = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and errors[-1].startswith("error: ") and named in errors[-1]
    assert "Traceback" not in "\n".join(errors)
    assert not out.exists()  # nothing written: the corrected command is not refused as "not empty"
    main("finetune", args)
    assert (out / "adapter_model.safetensors").is_file() and (out / "config.json").is_file()


def test_a_lora_runs_folder_loads_with_from_pretrained_and_pipeline_and_pushes_no_local_path(tmp_path, hub):
    from PIL import Image
    from transformers import AutoModelForImageClassification, pipeline

    import hf_vit  # noqa: F401  (registers the classes and the LoRA folder reader)
    from hf_vit.outputs.push import push_folder_to_hub

    source, out, _ = lora_run(tmp_path)
    merged = load_lora_model(out, base=source)
    x = torch.randn(2, 3, 8, 8)
    auto = AutoModelForImageClassification.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(auto(x).logits, merged(x).logits)
    image = Image.fromarray((torch.rand(8, 8, 3) * 255).byte().numpy())
    answers = pipeline("image-classification", model=str(out), trust_remote_code=False)(image, top_k=3)
    from hf_vit import VisionTransformerImageProcessor

    pixels = VisionTransformerImageProcessor.from_pretrained(out)(image, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = merged(pixels).logits.softmax(-1)[0].topk(3)
    assert [a["label"] for a in answers] == [merged.config.id2label[int(i)] for i in expected.indices]
    torch.testing.assert_close(torch.tensor([a["score"] for a in answers]), expected.values, atol=1e-5, rtol=1e-5)

    push_folder_to_hub(out, "alice/lora-digits")
    sent = hub["files"]
    assert LOCAL_BASE_FILE not in sent and "adapter_config.json" in sent
    assert json.loads(sent["adapter_config.json"])["base_model_name_or_path"] == source.name
    for name, data in sent.items():
        if name.endswith((".json", ".md", ".txt", ".py")):
            assert str(tmp_path).encode() not in data, name
