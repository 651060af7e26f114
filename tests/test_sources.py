"""The checkpoints users have, loaded as they are: transformers' and timm's ViT by Hub id (through a Hugging Face
cache the tests fill in the Hub's layout, offline, so huggingface_hub's real resolution runs) or folder, and the
authors' .npz files, converted on load."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor, ViTModel

from hf_vit import (
    VisionTransformerConfig,
    VisionTransformerForImageClassification,
    VisionTransformerImageProcessor,
    VisionTransformerModel,
)
from hf_vit.convert import ConversionError, hf_vit_to_npz_arrays, hf_vit_to_timm_state_dict

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_repo(cache: Path, repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in a Hub cache (`models--org--name/snapshots/<commit>`, `refs/main`)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def transformers_vit(model_class, **extra):
    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, **SIZES, **extra)
    return model_class(config).eval()


def hf_vit_source(num_labels):
    """The tiny hf-vit classifier the timm and .npz sources are written from (a head that is not zero, so it shows)."""
    torch.manual_seed(0)
    config = VisionTransformerConfig(image_size=32, patch_size=8, num_labels=num_labels, zero_init_head=False, **SIZES)
    return VisionTransformerForImageClassification(config).eval()


def pixels(height=32, width=32, batch=2):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(1))


def test_a_transformers_classifier_loads_by_hub_id(hub_cache):
    source = transformers_vit(ViTForImageClassification, num_labels=3, id2label={0: "a", 1: "b", 2: "c"})
    snapshot = hub_repo(hub_cache, "google/vit-base-patch16-224")
    source.save_pretrained(snapshot)
    ViTImageProcessor(size={"height": 32, "width": 32}, resample=3).save_pretrained(snapshot)

    model = VisionTransformerForImageClassification.from_pretrained("google/vit-base-patch16-224")
    assert model.config.model_type == "hf_vit" and model.config.id2label == {0: "a", 1: "b", 2: "c"}
    assert model.config.hidden_act == "gelu"  # transformers' checkpoints keep their exact GELU
    x = pixels()
    with torch.no_grad():
        difference = (model(x).logits - source(x).logits).abs().max().item()
    print(f"transformers ViT by Hub id: max |logits difference| {difference:.1e}")
    assert difference < 1e-5
    processor = VisionTransformerImageProcessor.from_pretrained("google/vit-base-patch16-224")
    assert processor.size == {"height": 32, "width": 32} and int(processor.resample) == 3


def test_the_in21k_encoder_with_its_pooler_loads_by_hub_id(hub_cache, tmp_path):
    source = transformers_vit(ViTModel)  # the in21k checkpoints are ViTModel with a pooler
    source.save_pretrained(hub_repo(hub_cache, "google/vit-base-patch16-224-in21k"))
    encoder = VisionTransformerModel.from_pretrained("google/vit-base-patch16-224-in21k")
    x = pixels(48, 32)
    with torch.no_grad():
        ours = encoder(x, interpolate_pos_encoding=True).last_hidden_state
        theirs = source(x, interpolate_pos_encoding=True).last_hidden_state
    assert (ours - theirs).abs().max().item() < 1e-5
    classifier = VisionTransformerForImageClassification.from_pretrained("google/vit-base-patch16-224-in21k")
    assert classifier.config.representation_size == 32  # the pooler is the pre-logits layer
    encoder.save_pretrained(tmp_path / "saved")  # a normal hf-vit folder afterwards
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "hf_vit"
    reloaded = VisionTransformerModel.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x, interpolate_pos_encoding=True).last_hidden_state, ours)


def timm_repo(folder: Path, model, **cfg):
    save_file(hf_vit_to_timm_state_dict(model.state_dict(), model.config), folder / "model.safetensors")
    config = {
        "architecture": "vit_tiny_patch8_32",
        "num_classes": model.config.num_labels,
        "num_features": 32,
        "global_pool": "token",
        "model_args": {"num_heads": 2},
        "pretrained_cfg": {
            "input_size": [3, 32, 32],
            "interpolation": "bicubic",
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
            **cfg,
        },
    }
    (folder / "config.json").write_text(json.dumps(config))


def test_a_timm_checkpoint_loads_by_hub_id_with_its_preprocessing(hub_cache):
    source = hf_vit_source(num_labels=4)
    timm_repo(hub_repo(hub_cache, "timm/vit_tiny_patch8_32.test"), source)
    model = VisionTransformerForImageClassification.from_pretrained("timm/vit_tiny_patch8_32.test")
    x = pixels()
    with torch.no_grad():
        assert (model(x).logits - source(x).logits).abs().max().item() < 1e-5
    processor = VisionTransformerImageProcessor.from_pretrained("timm/vit_tiny_patch8_32.test")
    assert processor.image_mean == pytest.approx([0.485, 0.456, 0.406]) and int(processor.resample) == 3


def test_the_authors_npz_loads_with_their_activation(tmp_path):
    source = hf_vit_source(num_labels=5)
    np.savez(tmp_path / "ViT-T_8.npz", **hf_vit_to_npz_arrays(source.state_dict(), source.config))
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "ViT-T_8.npz")
    assert model.config.hidden_act == "gelu_pytorch_tanh"  # flax.linen.gelu's default, the authors' activation
    source.config.hidden_act = "gelu_pytorch_tanh"
    tanh_source = VisionTransformerForImageClassification(source.config).eval()
    tanh_source.load_state_dict(source.state_dict())
    x = pixels()
    with torch.no_grad():
        assert (model(x).logits - tanh_source(x).logits).abs().max().item() < 1e-5
    exact = VisionTransformerForImageClassification.from_pretrained(tmp_path / "ViT-T_8.npz", hidden_act="gelu")
    assert exact.config.hidden_act == "gelu"
    processor = VisionTransformerImageProcessor.from_pretrained(tmp_path / "ViT-T_8.npz")
    assert processor.image_mean == [0.5, 0.5, 0.5] and processor.size == {"height": 32, "width": 32}
    cut = tmp_path / "cut.npz"
    cut.write_bytes((tmp_path / "ViT-T_8.npz").read_bytes()[:5000])  # a download that stopped
    with pytest.raises(ConversionError, match="cut.npz as an .npz archive: it is truncated or corrupted"):
        VisionTransformerForImageClassification.from_pretrained(cut)


def test_a_checkpoint_that_does_not_fit_is_an_error_naming_it(hub_cache):
    source = transformers_vit(ViTForImageClassification, num_labels=3)
    snapshot = hub_repo(hub_cache, "google/vit-broken")
    source.save_pretrained(snapshot)
    from safetensors.torch import load_file

    weights = load_file(snapshot / "model.safetensors")
    del weights["vit.encoder.layer.1.intermediate.dense.weight"]
    save_file(weights, snapshot / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="vit.encoder.layer.1.intermediate.dense.weight"):
        VisionTransformerForImageClassification.from_pretrained("google/vit-broken")


def split_qkv_unevenly(weights):
    """Block 0's query, key and value of 16, 16 and 64 rows: together the 96 rows of the fused weight."""
    prefix = "vit.encoder.layer.0.attention.attention."
    fused = torch.cat([weights[f"{prefix}{part}.weight"] for part in ("query", "key", "value")])
    fused_bias = torch.cat([weights[f"{prefix}{part}.bias"] for part in ("query", "key", "value")])
    for part, rows in zip(("query", "key", "value"), fused.split([16, 16, 64])):
        weights[f"{prefix}{part}.weight"] = rows.clone()
    for part, rows in zip(("query", "key", "value"), fused_bias.split([16, 16, 64])):
        weights[f"{prefix}{part}.bias"] = rows.clone()


@pytest.mark.parametrize(
    "break_weights, named",
    [
        (
            lambda w: w.pop("vit.encoder.layer.1.output.dense.bias"),
            r"lacks: \['vit.encoder.layer.1.output.dense.bias'\]",
        ),
        (
            lambda w: w.update({"vit.layernorm.weight": torch.ones(33)}),
            r"vit.layernorm.weight: shape \(33,\) does not fit",
        ),
        (
            lambda w: w.update({"vit.encoder.layer.0.attention.attention.key.weight": torch.ones(32, 31)}),
            r"layer.0.attention.attention.key.weight: shape \(32, 31\) does not fit",
        ),
        (lambda w: w.update({"vit.extra.weight": torch.ones(2)}), r"no place in hf-vit: \['vit.extra.weight'\]"),
        (lambda w: w.update({"vit.layernorm.bias": torch.ones(32, dtype=torch.int64)}), "not a floating point array"),
        (split_qkv_unevenly, r"layer.0.attention.attention.key.weight: shape \(16, 32\) does not fit"),
        (
            lambda w: w.update({"vit.embeddings.position_embeddings": torch.ones(1, 37, 32)}),
            r"hold 36 positions, but config.json's image_size 32 with patch_size 8 makes a 4x4 grid: pass "
            r"image_size=48",
        ),
    ],
    ids=["missing", "shape", "fused-part-shape", "unplaced", "integer", "fused-parts-summing-to-fit", "position-grid"],
)
def test_what_does_not_fit_is_named_in_the_checkpoints_own_names(hub_cache, monkeypatch, break_weights, named):
    """A clean load builds no model to check the weights against (transformers' loading reports what does not fit,
    then the check names it); every way a checkpoint can fail to fit still ends in one report in its own names."""
    from safetensors.torch import load_file

    from hf_vit.convert import common

    source = transformers_vit(ViTForImageClassification, num_labels=3)
    source.save_pretrained(hub_repo(hub_cache, "google/vit-fits"))
    snapshot = hub_repo(hub_cache, "google/vit-does-not-fit")
    source.save_pretrained(snapshot)
    weights = load_file(snapshot / "model.safetensors")
    break_weights(weights)
    save_file(weights, snapshot / "model.safetensors", metadata={"format": "pt"})

    checks = []
    check = common.check_state_dict
    monkeypatch.setattr(common, "check_state_dict", lambda *args, **kwargs: checks.append(1) or check(*args, **kwargs))
    VisionTransformerForImageClassification.from_pretrained("google/vit-fits")
    assert checks == []
    with pytest.raises(ValueError, match=rf"google/vit-does-not-fit \(transformers' ViT layout\)(.|\n)*{named}"):
        VisionTransformerForImageClassification.from_pretrained("google/vit-does-not-fit")
    assert checks == [1]


def test_finetune_starts_from_a_hub_ids_weights(hub_cache, tmp_path):
    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    torch.manual_seed(0)
    vit = ViTModel(ViTConfig(image_size=8, patch_size=4, **SIZES)).eval()
    vit.save_pretrained(hub_repo(hub_cache, "google/vit-base-patch16-224-in21k"))
    args = ["--model_name_or_path", "google/vit-base-patch16-224-in21k", "--output_dir", str(tmp_path / "out")]
    args += ["--max_steps", "1", "--learning_rate", "0", "--warmup_steps", "0", "--eval_strategy", "no"]
    args += ["--save_strategy", "no", "--max_train_samples", "16", "--per_device_train_batch_size", "8"]
    args += ["--disable_tqdm", "True", "--report_to", "none", "--dataloader_num_workers", "0"]
    train("finetune", *parse_args("finetune", args))
    tuned = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out").eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():  # learning rate 0: the encoder is the checkpoint's
        torch.testing.assert_close(tuned.vit(x).last_hidden_state, vit(x).last_hidden_state, atol=1e-5, rtol=1e-5)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: google/vit-base-patch16-224-in21k" in card


def test_a_timm_checkpoint_of_unusual_width_takes_the_heads_from_the_caller(hub_cache):
    source = hf_vit_source(num_labels=4)
    folder = hub_repo(hub_cache, "timm/vit_tiny_patch8_32.noheads")
    timm_repo(folder, source)
    config = json.loads((folder / "config.json").read_text())
    del config["model_args"]  # timm's config says nothing of the heads of a width-32 model
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_attention_heads"):
        VisionTransformerForImageClassification.from_pretrained("timm/vit_tiny_patch8_32.noheads")
    model = VisionTransformerForImageClassification.from_pretrained(
        "timm/vit_tiny_patch8_32.noheads", num_attention_heads=2
    )
    with torch.no_grad():
        assert (model(pixels()).logits - source(pixels()).logits).abs().max().item() < 1e-5


def test_truncated_weights_of_a_transformers_folder_are_named(tmp_path):
    transformers_vit(ViTForImageClassification, num_labels=3).save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is truncated or corrupted"):
        VisionTransformerForImageClassification.from_pretrained(tmp_path)


# --- Conversion in memory, every field kept or refused by name -------------------------------------------------------


def test_a_conversion_writes_nothing_and_saves_an_hf_vit_folder(hub_cache, tmp_path, monkeypatch):
    import tempfile

    source = transformers_vit(ViTForImageClassification, num_labels=3)
    source.save_pretrained(hub_repo(hub_cache, "google/vit-in-memory"))

    def no_temporary_folder(*args, **kwargs):
        raise AssertionError("the conversion wrote a temporary folder")

    monkeypatch.setattr(tempfile, "mkdtemp", no_temporary_folder)
    monkeypatch.setattr(tempfile, "TemporaryDirectory", no_temporary_folder)
    model = VisionTransformerForImageClassification.from_pretrained("google/vit-in-memory")
    x = pixels()
    with torch.no_grad():
        assert (model(x).logits - source(x).logits).abs().max().item() < 1e-5
    monkeypatch.undo()
    model.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open

    with safe_open(tmp_path / "saved" / "model.safetensors", framework="pt") as saved:
        assert "vit.layers.0.attention.qkv.weight" in set(saved.keys())  # hf-vit's layout, not the source's


def test_an_fp16_source_loads_in_fp16_with_dtype_auto(hub_cache):
    source = transformers_vit(ViTForImageClassification, num_labels=3).half()
    source.save_pretrained(hub_repo(hub_cache, "google/vit-fp16"))
    model = VisionTransformerForImageClassification.from_pretrained("google/vit-fp16", dtype="auto")
    assert model.dtype == torch.float16
    assert VisionTransformerForImageClassification.from_pretrained("google/vit-fp16", dtype=torch.float32).dtype == (
        torch.float32
    )


def test_dtype_auto_without_a_dtype_in_config_json_takes_the_weights_dtype(hub_cache):
    """Older uploads record no dtype in config.json: "auto" then means the weights' dtype, as for transformers."""
    snapshot = hub_repo(hub_cache, "google/vit-no-dtype")
    transformers_vit(ViTForImageClassification, num_labels=3).to(torch.bfloat16).save_pretrained(snapshot)
    config = json.loads((snapshot / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (snapshot / "config.json").write_text(json.dumps(config))
    expected = ViTForImageClassification.from_pretrained("google/vit-no-dtype", dtype="auto")
    model = VisionTransformerForImageClassification.from_pretrained("google/vit-no-dtype", dtype="auto")
    assert model.dtype == expected.dtype == torch.bfloat16
    attention = expected.vit.layers[0].attention
    fused = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    assert torch.equal(model.vit.layers[0].attention.qkv.weight, fused)  # the weights as stored, not cast
    logits, expected_logits = model(pixels().bfloat16()).logits, expected(pixels().bfloat16()).logits
    assert (logits.float() - expected_logits.float()).abs().max().item() < 2e-2  # bf16 arithmetic


def test_query_key_and_value_of_different_dtypes_load_as_transformers_loads_them(hub_cache):
    from safetensors.torch import load_file

    snapshot = hub_repo(hub_cache, "google/vit-mixed-qkv")
    transformers_vit(ViTForImageClassification, num_labels=3).save_pretrained(snapshot)
    weights = load_file(snapshot / "model.safetensors")
    for name in ("query.weight", "key.bias"):
        key = f"vit.encoder.layer.1.attention.attention.{name}"
        weights[key] = weights[key].half()
    save_file(weights, snapshot / "model.safetensors", metadata={"format": "pt"})
    expected = ViTForImageClassification.from_pretrained("google/vit-mixed-qkv").eval()
    model = VisionTransformerForImageClassification.from_pretrained("google/vit-mixed-qkv").eval()
    assert model.dtype == torch.float32
    assert (model(pixels()).logits - expected(pixels()).logits).abs().max().item() < 1e-5


def test_a_multi_label_checkpoint_keeps_its_problem_type_and_labels(hub_cache):
    labels = {0: "cat", 1: "dog", 2: "grass"}
    source = transformers_vit(
        ViTForImageClassification, num_labels=3, id2label=labels, problem_type="multi_label_classification"
    )
    source.save_pretrained(hub_repo(hub_cache, "google/vit-multi-label"))
    model = VisionTransformerForImageClassification.from_pretrained("google/vit-multi-label")
    assert model.config.problem_type == "multi_label_classification"
    assert model.config.id2label == labels and model.config.label2id == {"cat": 0, "dog": 1, "grass": 2}
    config = VisionTransformerConfig.from_pretrained("google/vit-multi-label")
    assert config.problem_type == "multi_label_classification"


def test_a_pooler_that_is_not_tanh_is_refused_by_name(hub_cache):
    transformers_vit(ViTModel, pooler_act="relu").save_pretrained(hub_repo(hub_cache, "google/vit-relu-pooler"))
    with pytest.raises(ValueError, match=r"google/vit-relu-pooler.*pooler_act='relu'"):
        VisionTransformerModel.from_pretrained("google/vit-relu-pooler")


def test_a_deit_style_processor_keeps_its_resize_and_crop_and_needs_no_weights(hub_cache):
    snapshot = hub_repo(hub_cache, "facebook/deit-like")
    transformers_vit(ViTForImageClassification, num_labels=3).save_pretrained(snapshot)
    settings = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": 40, "width": 40},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 32, "width": 32},
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
    }
    (snapshot / "preprocessor_config.json").write_text(json.dumps(settings))
    (snapshot / "model.safetensors").unlink()  # a processor-only load reads the processor's files only
    processor = VisionTransformerImageProcessor.from_pretrained("facebook/deit-like")
    assert processor.size == {"height": 40, "width": 40} and processor.do_center_crop
    assert processor.crop_size == {"height": 32, "width": 32}
    image = torch.rand(3, 50, 60)
    assert processor(image, return_tensors="pt")["pixel_values"].shape == (1, 3, 32, 32)


def test_a_timm_repository_with_only_a_torch_file_loads(hub_cache):
    source = hf_vit_source(num_labels=4)
    snapshot = hub_repo(hub_cache, "timm/vit_tiny_patch8_32.bin_only")
    timm_repo(snapshot, source)
    (snapshot / "model.safetensors").unlink()
    torch.save(hf_vit_to_timm_state_dict(source.state_dict(), source.config), snapshot / "pytorch_model.bin")
    model = VisionTransformerForImageClassification.from_pretrained("timm/vit_tiny_patch8_32.bin_only")
    x = pixels()
    with torch.no_grad():
        assert (model(x).logits - source(x).logits).abs().max().item() < 1e-5


def test_timm_global_pool_none_is_refused_with_its_meaning(hub_cache):
    source = VisionTransformerForImageClassification(
        VisionTransformerConfig(image_size=32, patch_size=8, num_labels=4, **SIZES)
    )
    snapshot = hub_repo(hub_cache, "timm/vit_tiny_patch8_32.no_pool")
    timm_repo(snapshot, source)
    config = json.loads((snapshot / "config.json").read_text())
    config["global_pool"] = ""
    (snapshot / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"(?s)timm/vit_tiny_patch8_32.no_pool.*global_pool=''.*classifies every token"
    ):
        VisionTransformerForImageClassification.from_pretrained("timm/vit_tiny_patch8_32.no_pool")


def test_an_npz_loads_at_another_size_by_keyword_and_with_an_upper_case_suffix(tmp_path):
    source = hf_vit_source(num_labels=5)
    np.savez(tmp_path / "ViT-T_8.npz", **hf_vit_to_npz_arrays(source.state_dict(), source.config))
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "ViT-T_8.npz", image_size=48)
    assert model.config.image_size == 48
    assert model.vit.embeddings.position_embedding.shape == (1, 1 + 6 * 6, 32)
    with torch.no_grad():
        assert model(pixels(48, 48)).logits.shape == (2, 5)
    (tmp_path / "ViT-T_8.npz").rename(tmp_path / "VIT-T_8.NPZ")
    upper = VisionTransformerForImageClassification.from_pretrained(tmp_path / "VIT-T_8.NPZ")
    assert upper.config.image_size == 32 and upper.config.num_labels == 5


def test_a_config_only_load_builds_no_model_and_reads_no_weights(hub_cache, monkeypatch):
    import safetensors.torch

    from hf_vit import VisionTransformerPreTrainedModel

    transformers_vit(ViTForImageClassification, num_labels=3).save_pretrained(hub_repo(hub_cache, "google/vit-cfg"))
    source = VisionTransformerForImageClassification(
        VisionTransformerConfig(image_size=32, patch_size=8, num_labels=4, **SIZES)
    )
    timm_repo(hub_repo(hub_cache, "timm/vit_tiny_patch8_32.cfg"), source)

    def refuse(*args, **kwargs):
        raise AssertionError("a config-only load built a model or read weights")

    monkeypatch.setattr(VisionTransformerPreTrainedModel, "__init__", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    config = VisionTransformerConfig.from_pretrained("google/vit-cfg")
    assert (config.num_labels, config.hidden_size, config.image_size) == (3, 32, 32)
    timm = VisionTransformerConfig.from_pretrained("timm/vit_tiny_patch8_32.cfg")
    assert (timm.num_labels, timm.num_attention_heads) == (4, 2)


def test_dtype_and_device_map_work_as_for_a_folder(hub_cache):
    source = transformers_vit(ViTForImageClassification, num_labels=3)
    source.save_pretrained(hub_repo(hub_cache, "google/vit-bf16"))
    model = VisionTransformerForImageClassification.from_pretrained(
        "google/vit-bf16", dtype=torch.bfloat16, device_map="cpu"
    )
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    with torch.no_grad():
        difference = (model(pixels().bfloat16()).logits.float() - source(pixels()).logits).abs().max().item()
    assert difference < 0.1


def test_a_transformers_checkpoint_loads_at_another_size_by_keyword(hub_cache):
    source = transformers_vit(ViTForImageClassification, num_labels=3)
    source.save_pretrained(hub_repo(hub_cache, "google/vit-resized"))
    model = VisionTransformerForImageClassification.from_pretrained("google/vit-resized", image_size=48)
    assert model.config.image_size == 48
    assert model.vit.embeddings.position_embedding.shape == (1, 1 + 6 * 6, 32)
    with torch.no_grad():
        assert model(pixels(48, 48)).logits.shape == (2, 3)


def test_a_transformers_repository_without_safetensors_is_named_with_the_fix(hub_cache):
    snapshot = hub_repo(hub_cache, "google/vit-bin-only")
    transformers_vit(ViTForImageClassification, num_labels=3).save_pretrained(snapshot)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "pytorch_model.bin").write_bytes(b"a torch file")
    with pytest.raises(ValueError, match=r"google/vit-bin-only .*no model.safetensors.*save_pretrained"):
        VisionTransformerForImageClassification.from_pretrained("google/vit-bin-only")
