"""The converters' shared engine: a fourth layout is one table, converted both ways; one check and one report."""

import pytest
import torch
from conftest import tiny_config

from hf_vit import VisionTransformerForImageClassification
from hf_vit.convert import (
    FUSED_QKV,
    JAX_LAYOUT,
    TIMM_LAYOUT,
    TRANSFORMERS_LAYOUT,
    ConversionError,
    Layout,
    Transform,
    check_state_dict,
)

# A made-up layout: kernels stored (in, out), query/key/value kernels separate and transposed, "gain" for LayerNorm
# weights. Nothing else is needed to convert it both ways.
TRANSPOSED = Transform(lambda kernel: kernel.T, lambda weight, config: (weight.T,))
TRANSPOSED_QKV = Transform(
    lambda q, k, v: torch.cat([q.T, k.T, v.T]), lambda weight, config: tuple(p.T for p in weight.chunk(3))
)
TOY = Layout(
    "toy checkpoint",
    [
        ("stem.kernel", "vit.embeddings.patch_embedding.weight"),
        ("stem.bias", "vit.embeddings.patch_embedding.bias"),
        ("cls", "vit.embeddings.cls_token"),
        ("pos", "vit.embeddings.position_embedding"),
        ("enc.{i}.ln1.gain", "vit.layers.{i}.norm1.weight"),
        ("enc.{i}.ln1.bias", "vit.layers.{i}.norm1.bias"),
        (("enc.{i}.q.kernel", "enc.{i}.k.kernel", "enc.{i}.v.kernel"), "vit.layers.{i}.attention.qkv.weight",
         TRANSPOSED_QKV),
        (("enc.{i}.q.bias", "enc.{i}.k.bias", "enc.{i}.v.bias"), "vit.layers.{i}.attention.qkv.bias", FUSED_QKV),
        ("enc.{i}.o.kernel", "vit.layers.{i}.attention.proj.weight", TRANSPOSED),
        ("enc.{i}.o.bias", "vit.layers.{i}.attention.proj.bias"),
        ("enc.{i}.ln2.gain", "vit.layers.{i}.norm2.weight"),
        ("enc.{i}.ln2.bias", "vit.layers.{i}.norm2.bias"),
        ("enc.{i}.up.kernel", "vit.layers.{i}.mlp.fc1.weight", TRANSPOSED),
        ("enc.{i}.up.bias", "vit.layers.{i}.mlp.fc1.bias"),
        ("enc.{i}.down.kernel", "vit.layers.{i}.mlp.fc2.weight", TRANSPOSED),
        ("enc.{i}.down.bias", "vit.layers.{i}.mlp.fc2.bias"),
        ("final.gain", "vit.norm.weight"),
        ("final.bias", "vit.norm.bias"),
        ("logits.kernel", "classifier.weight", TRANSPOSED),
        ("logits.bias", "classifier.bias"),
    ],
)  # fmt: skip


def model_and_state(**overrides):
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(zero_init_head=False, **overrides)).eval()
    return model, model.state_dict()


def test_a_fourth_layout_is_one_table():
    model, state = model_and_state()
    config, d = model.config, model.config.hidden_size
    toy = TOY.from_hf(state, config)
    # 12 weights per block; query, key and value split into 3 each: 16 arrays per block.
    assert len(toy) == len(state) + 4 * config.num_hidden_layers
    qkv = state["vit.layers.1.attention.qkv.weight"]
    assert torch.equal(toy["enc.1.k.kernel"], qkv[d : 2 * d].T)  # the transform, checked by hand
    assert torch.equal(toy["logits.kernel"], state["classifier.weight"].T)
    back = TOY.to_hf(toy, config)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    reloaded = VisionTransformerForImageClassification(config).eval()
    reloaded.load_state_dict(back, strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, model(x).logits)


def test_every_problem_is_reported_once_in_the_layouts_own_names():
    model, state = model_and_state()
    toy = TOY.from_hf(state, model.config)
    del toy["enc.1.k.kernel"]  # missing
    toy["enc.0.mystery.kernel"] = torch.zeros(2)  # no row places it
    toy["enc.2.ln1.gain"] = torch.ones(32)  # placed, but the model has two blocks
    toy["enc.0.up.kernel"] = torch.zeros(32, 50)  # the wrong shape, reported as stored
    toy["cls"] = torch.zeros(1, 1, 32, dtype=torch.int64)  # not floating point
    with pytest.raises(ConversionError) as error:
        TOY.to_hf(toy, model.config, problems=["a finding of the format's own"])
    message = str(error.value)
    print(message)
    lines = message.splitlines()
    assert lines[0] == "Cannot convert the toy checkpoint:" and lines[1] == "- a finding of the format's own"
    assert "- arrays with no place in hf-vit: ['enc.0.mystery.kernel']" in lines
    assert "- arrays the model needs but the checkpoint lacks: ['enc.1.k.kernel']" in lines
    assert "- arrays the model (as configured) has no place for: ['enc.2.ln1.gain']" in lines
    assert "- enc.0.up.kernel: shape (32, 50) does not fit the model's (32, 64)" in lines
    assert "- cls: torch.int64 is not a floating point array" in lines
    assert len(lines) == 7


def test_without_a_config_only_the_table_is_checked():
    _, state = model_and_state()
    toy = TOY.from_hf(state)  # no transform of this table needs the config
    del toy["enc.0.v.bias"]
    with pytest.raises(ConversionError, match=r"lacks: \['enc\.0\.v\.bias'\]"):
        TOY.to_hf(toy)
    with pytest.raises(
        ConversionError, match=r"toy checkpoint layout has no place for the hf-vit weights \['extra'\]"
    ):
        TOY.from_hf({**state, "extra": torch.zeros(1)})


def test_check_state_dict_in_hf_vit_names():
    model, state = model_and_state(representation_size=16)
    check_state_dict(state, model.config)  # builds the model on the meta device: nothing allocated
    broken = {k: v for k, v in state.items() if k != "pre_logits.bias"}
    broken["vit.embeddings.position_embedding"] = torch.zeros(1, 5, 32)
    with pytest.raises(ConversionError) as error:
        check_state_dict(broken, model.config)
    message = str(error.value)
    assert "lacks: ['pre_logits.bias']" in message
    assert "vit.embeddings.position_embedding: shape (1, 5, 32) does not fit the model's (1, 17, 32)" in message


def test_ambiguous_tables_are_refused():
    with pytest.raises(ValueError, match="appear twice"):
        Layout("bad", [("a.{p}", "vit.norm.{p}"), ("b.{p}", "vit.norm.{p}")])


@pytest.mark.parametrize("layout", [JAX_LAYOUT, TIMM_LAYOUT, TRANSFORMERS_LAYOUT], ids=lambda layout: layout.name)
@pytest.mark.parametrize("overrides", [{}, {"classifier": "gap", "representation_size": 16, "qkv_bias": False}])
def test_the_tables_cover_the_model_both_ways(layout, overrides):
    model, state = model_and_state(**overrides)
    source = layout.from_hf(state, model.config)
    check_state_dict(source, model.config, layout)
    back = layout.to_hf(source, model.config)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
