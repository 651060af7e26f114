"""LoRA fine-tuning with peft: adapters on the fused qkv (or on its query/value parts only), the head in full, saved
as peft's safetensors adapter that merges back into the base model."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_training import QUIET, pretrained_folder

from hf_vit.lora import apply_lora, load_lora_model
from hf_vit.training import load_for_finetuning, parse_args, train


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
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(source)
    assert f"base_model: {source.name}" not in (out / "README.md").read_text()  # a local path: named in the text
    assert "LoRA adapter" in (out / "README.md").read_text()

    id2label = {i: str(i) for i in range(10)}
    x = torch.randn(4, 3, 8, 8)
    adapted = PeftModel.from_pretrained(load_for_finetuning(str(source), id2label, image_size=8), out).eval()
    merged = load_lora_model(out)
    base = load_for_finetuning(str(source), id2label, image_size=8).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, adapted(x).logits, atol=1e-5, rtol=1e-5)
        assert (merged(x).logits - base(x).logits).abs().max() > 1e-3
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0


def test_query_value_parts_leave_the_keys_untouched(tmp_path):
    source, out, _ = lora_run(tmp_path, "--lora_target_modules", "query,value")
    adapter = load_file(out / "adapter_model.safetensors")
    b = next(value for key, value in adapter.items() if "qkv.lora_B" in key)
    width = b.shape[0] // 3
    assert b[width : 2 * width].abs().max() == 0  # key rows stayed zero
    assert b[:width].abs().max() > 0 and b[2 * width :].abs().max() > 0
    merged = load_lora_model(out)
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
