import pytest
from conftest import tiny_config

from hf_vit import PRESETS, VisionTransformerConfig
from hf_vit.model.configuration_vit import MODEL_SIZES, PATCH_SIZES


def test_presets_cover_the_papers_table():
    assert len(PRESETS) == len(MODEL_SIZES) * len(PATCH_SIZES) == 20
    base = VisionTransformerConfig.from_preset("vit-base-patch16-224")
    assert (base.hidden_size, base.num_hidden_layers, base.intermediate_size, base.num_attention_heads) == (
        768,
        12,
        3072,
        12,
    )
    huge = VisionTransformerConfig.from_preset("vit-huge-patch14-224")
    assert (huge.hidden_size, huge.num_hidden_layers, huge.intermediate_size, huge.num_attention_heads) == (
        1280,
        32,
        5120,
        16,
    )
    assert huge.grid_size == (16, 16)


def test_preset_overrides_and_resolution_suffix():
    config = VisionTransformerConfig.from_preset("vit-small-patch32-384", num_labels=10, drop_path_rate=0.1)
    assert config.image_size == 384 and config.patch_size == 32 and config.hidden_size == 384
    assert config.num_labels == 10 and config.drop_path_rate == 0.1
    with pytest.raises(ValueError, match="Unknown preset"):
        VisionTransformerConfig.from_preset("vit-gigantic-patch16-224")


def test_save_load_round_trip(tmp_path):
    config = tiny_config(image_size=(32, 48), representation_size=16, classifier="gap")
    config.save_pretrained(tmp_path)
    loaded = VisionTransformerConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.image_hw == (32, 48) and loaded.grid_size == (4, 6) and loaded.num_prefix_tokens == 0
    assert loaded.auto_map["AutoModelForImageClassification"].startswith("modeling_vit.")


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
        (dict(image_size=36), "image_size"),
        (dict(image_size=(32, 36)), "image_size"),
        (dict(classifier="cls"), "classifier"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(num_hidden_layers=-1), "num_hidden_layers"),
        (dict(patch_size=0), "patch_size"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(representation_size=0), "representation_size"),
        (dict(drop_path_rate=1.5), "drop_path_rate"),
        (dict(image_size=(1, 2, 3)), "image_size"),
        (dict(num_register_tokens=-1), "num_register_tokens"),
        (dict(layer_scale_init_value=0), "layer_scale_init_value"),
        (dict(pre_norm="yes"), "pre_norm"),
        (dict(fc_norm=1), "fc_norm"),
        (dict(classifier="token", use_class_token=False), "use_class_token"),
        (dict(classifier="gap", use_distillation_token=True), "use_distillation_token"),
        (dict(interpolation_mode="nearest"), "interpolation_mode"),
        (dict(interpolation_antialias=None), "interpolation_antialias"),
        (dict(hidden_act="quick_gleu"), "hidden_act"),
        (dict(qkv_bias="no"), "qkv_bias"),
        (dict(zero_init_head="no"), "zero_init_head"),
        (dict(qkv_bias=None), "qkv_bias"),
        (dict(use_class_token="yes"), "use_class_token"),
        (dict(num_labels=-1), "num_labels"),
        (dict(num_labels="3"), "num_labels"),
        (dict(layer_norm_eps="1e-6"), "layer_norm_eps"),
        (dict(layer_norm_eps=0), "layer_norm_eps"),
        (dict(hidden_dropout_prob="0.1"), "hidden_dropout_prob"),
        (dict(initializer_range=-0.02), "initializer_range"),
        (dict(mpp_color_bits=True), "mpp_color_bits"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "value, expected", [(True, True), (False, False), ("False", False), ("false", False), ("0", False), ("TRUE", True),
                        (" 1 ", True)],
)  # fmt: skip
def test_booleans_are_read_as_booleans(value, expected):
    config = tiny_config(qkv_bias=value, zero_init_head=value, pre_norm=value)
    assert config.qkv_bias is config.zero_init_head is config.pre_norm is expected


def test_config_overrides_give_booleans_and_numbers(tmp_path):
    # the command line's "qkv_bias=False" is the string "False": a model without qkv biases, not one with them
    from hf_vit import VisionTransformerForImageClassification
    from hf_vit.tasks.model_setup import config_from_preset
    from hf_vit.train.arguments import parse_args

    overrides = "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,qkv_bias=False,"
    overrides += "zero_init_head=False,layer_norm_eps=1e-5"
    flags = ["--output_dir", str(tmp_path), "--image_size", "8", "--patch_size", "4", "--config_overrides", overrides]
    config = config_from_preset(parse_args("pretrain", flags)[0].settings())
    assert config.qkv_bias is False and config.zero_init_head is False and config.layer_norm_eps == 1e-5
    model = VisionTransformerForImageClassification(config)
    assert model.vit.layers[0].attention.qkv.bias is None
    assert '"qkv_bias": false' in config.to_json_string()
    with pytest.raises(ValueError, match="`qkv_bias` must be True or False, got 'no'"):
        config_from_preset(parse_args("pretrain", flags[:-1] + [overrides.replace("=False", "=no", 1)])[0].settings())


def test_unknown_preset_fields_are_named_with_a_suggestion():
    with pytest.raises(ValueError, match=r"'num_layers' \(did you mean 'num_hidden_layers'\?\)"):
        VisionTransformerConfig.from_preset("vit-tiny-patch16-224", num_layers=2)
    config = VisionTransformerConfig.from_preset("vit-tiny-patch16-224", num_labels=3, attn_implementation="eager")
    assert config.num_labels == 3


def test_the_family_blocks_are_off_by_default_and_round_trip(tmp_path):
    default = tiny_config()
    assert (default.use_class_token, default.num_register_tokens, default.layer_scale_init_value) == (True, 0, None)
    assert not (default.pre_norm or default.fc_norm or default.use_distillation_token)
    assert tiny_config(classifier="gap").use_class_token is False  # the paper's GAP model has no class token
    blocks = dict(
        classifier="map", use_class_token=True, use_distillation_token=True, num_register_tokens=4,
        layer_scale_init_value=1e-5, pre_norm=True, fc_norm=True, patch_embedding_bias=False,
        hidden_act="quick_gelu", interpolation_mode="bilinear", interpolation_antialias=True, layer_norm_eps=1e-5,
    )  # fmt: skip
    config = tiny_config(**blocks)
    assert (config.num_prefix_tokens, config.num_position_prefix_tokens) == (6, 2)
    config.save_pretrained(tmp_path)
    loaded = VisionTransformerConfig.from_pretrained(tmp_path)
    assert {name: getattr(loaded, name) for name in blocks} == blocks


def test_an_image_size_beyond_the_position_limit_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`image_size` 100000x100000 gives a 6250x6250 grid .* at most 65536 patch"):
        VisionTransformerConfig(image_size=100000, patch_size=16)
    assert VisionTransformerConfig(image_size=4096, patch_size=16).grid_size == (256, 256)  # exactly the limit


def test_config_json_holds_distillation_head_only_with_a_distillation_token(tmp_path):
    import json

    for token, head in ((False, True), (True, False), (True, True)):
        folder = tmp_path / f"{token}-{head}"
        tiny_config(use_distillation_token=token, distillation_head=head).save_pretrained(folder)
        saved = json.loads((folder / "config.json").read_text())
        assert ("distillation_head" in saved) == token and saved.get("distillation_head", head) == head
        loaded = VisionTransformerConfig.from_pretrained(folder)
        assert (loaded.use_distillation_token, loaded.distillation_head) == (token, head)
        assert loaded.to_dict() == tiny_config(use_distillation_token=token, distillation_head=head).to_dict()
    # a config.json written before (with the idle field) still loads, and is written again without it
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({**saved, "use_distillation_token": False, "distillation_head": True}))
    assert "distillation_head" not in VisionTransformerConfig.from_pretrained(old).to_dict()
