import math

import numpy as np
import pytest
import torch
from conftest import tiny_config
from torch.nn import functional as F

from hf_vit import VisionTransformerForImageClassification, VisionTransformerModel


def pixels(batch=2, height=32, width=32, seed=0):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def model_for(config, seed=0):
    torch.manual_seed(seed)
    return VisionTransformerForImageClassification(config).eval()


def test_shapes_and_optional_outputs(config):
    model = model_for(config)
    out = model(pixels(), output_hidden_states=True, output_attentions=True)
    tokens = 1 + config.num_patches
    assert out.logits.shape == (2, config.num_labels)
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert all(h.shape == (2, tokens, config.hidden_size) for h in out.hidden_states)
    assert len(out.attentions) == config.num_hidden_layers
    assert out.attentions[0].shape == (2, config.num_attention_heads, tokens, tokens)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, config.num_attention_heads, tokens))
    as_tuple = model(pixels(), return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.logits)


def test_base_model_pools_the_class_token_after_the_final_norm(config):
    torch.manual_seed(0)
    model = VisionTransformerModel(config).eval()
    out = model(pixels())
    assert torch.equal(out.pooler_output, out.last_hidden_state[:, 0])
    # Equation (4): y = LN(z_L^0); the final LayerNorm is applied, so each token has zero mean.
    torch.testing.assert_close(
        out.last_hidden_state.mean(-1), torch.zeros(2, 1 + config.num_patches), atol=1e-5, rtol=0
    )


def test_gap_classifier_has_no_class_token_and_averages_patches():
    config = tiny_config(classifier="gap")
    model = model_for(config)
    assert model.vit.embeddings.cls_token is None
    assert model.vit.embeddings.position_embedding.shape[1] == config.num_patches
    out = model.vit(pixels())
    assert out.last_hidden_state.shape[1] == config.num_patches
    torch.testing.assert_close(out.pooler_output, out.last_hidden_state.mean(1))


def test_sdpa_and_eager_attention_agree(config):
    model = model_for(config)
    x = pixels()
    sdpa = model(x).logits
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(model(x).logits, sdpa, atol=1e-5, rtol=1e-5)


def test_paper_initialisation(config):
    config = tiny_config(hidden_size=64, intermediate_size=256, representation_size=48)
    model = model_for(config)
    emb = model.vit.embeddings
    assert torch.count_nonzero(emb.cls_token) == 0
    assert torch.count_nonzero(model.classifier.weight) == 0 and torch.count_nonzero(model.classifier.bias) == 0
    assert abs(emb.position_embedding.std().item() - 0.02) < 0.004
    block = model.vit.layers[0]
    bound = math.sqrt(6 / (64 + 64))  # each of q, k, v is its own D x D Xavier-uniform matrix
    for part in block.attention.qkv.weight.chunk(3):
        assert part.abs().max() <= bound and part.abs().max() > 0.9 * bound
    assert block.mlp.fc1.bias.abs().max() < 1e-4 and block.mlp.fc1.bias.abs().max() > 0
    fc1_bound = math.sqrt(6 / (64 + 256))
    assert block.mlp.fc1.weight.abs().max() <= fc1_bound
    # LeCun normal for the patch embedding: std sqrt(1 / fan_in), fan_in = 3 * P * P.
    assert abs(emb.patch_embedding.weight.std().item() - math.sqrt(1 / (3 * 8 * 8))) < 0.01
    assert torch.count_nonzero(model.pre_logits.bias) == 0


def test_zero_init_head_can_be_turned_off():
    model = model_for(tiny_config(zero_init_head=False))
    assert torch.count_nonzero(model.classifier.weight) > 0


def test_pre_logits_layer_is_tanh_dense():
    config = tiny_config(representation_size=16, zero_init_head=False)
    model = model_for(config)
    x = pixels()
    y = model.vit(x).pooler_output
    expected = model.classifier(torch.tanh(model.pre_logits(y)))
    torch.testing.assert_close(model(x).logits, expected)


@pytest.mark.parametrize(
    "problem_type, labels, loss_fn",
    [
        ("single_label_classification", torch.tensor([1, 3]), lambda logits, y: F.cross_entropy(logits, y)),
        (
            "multi_label_classification",
            torch.tensor([[1.0, 0, 0, 1, 0], [0, 1, 1, 0, 0]]),
            lambda logits, y: F.binary_cross_entropy_with_logits(logits, y),
        ),
    ],
)
def test_loss_follows_problem_type(problem_type, labels, loss_fn):
    model = model_for(tiny_config(zero_init_head=False))
    out = model(pixels(), labels=labels)
    assert model.config.problem_type == problem_type  # inferred from the labels' dtype
    torch.testing.assert_close(out.loss, loss_fn(out.logits, labels))


def test_regression_loss():
    model = model_for(tiny_config(num_labels=1, zero_init_head=False))
    target = torch.tensor([0.5, -1.0])
    out = model(pixels(), labels=target)
    assert model.config.problem_type == "regression"
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), target))


def test_backward_reaches_every_parameter(config):
    model = model_for(tiny_config(zero_init_head=False)).train()
    model(pixels(), labels=torch.tensor([0, 1])).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def test_activation_checkpointing_recomputes_blocks_and_keeps_gradients(monkeypatch):
    import hf_vit.model.modeling_vit as modeling

    calls = []
    forward = modeling.VisionTransformerMLP.forward
    monkeypatch.setattr(modeling.VisionTransformerMLP, "forward", lambda self, x: calls.append(1) or forward(self, x))
    config = tiny_config(zero_init_head=False)
    reference, checkpointed = model_for(config).train(), model_for(config).train()
    checkpointed.activation_checkpointing_enable()
    assert checkpointed.is_activation_checkpointing
    for model in (reference, checkpointed):
        calls.clear()
        model(pixels(), labels=torch.tensor([0, 1])).loss.backward()
        runs = len(calls)
    assert runs == 2 * config.num_hidden_layers  # each block ran again in the backward pass
    for (name, a), (_, b) in zip(reference.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_stochastic_depth_rates_grow_linearly_and_act_only_in_training():
    config = tiny_config(num_hidden_layers=3, drop_path_rate=0.5)
    model = model_for(config)
    assert [block.drop_path.rate for block in model.vit.layers] == [0.0, 0.25, 0.5]
    x = pixels(batch=8)
    torch.testing.assert_close(model(x).logits, model(x).logits)
    model.train()
    torch.manual_seed(1)
    first = model.vit(x).last_hidden_state
    torch.manual_seed(2)
    second = model.vit(x).last_hidden_state
    assert not torch.allclose(first, second)


def test_interpolate_pos_encoding_at_native_and_non_square_sizes(config):
    model = model_for(config)
    x = pixels()
    torch.testing.assert_close(model(x, interpolate_pos_encoding=True).logits, model(x).logits)
    out = model.vit(pixels(height=48, width=24), interpolate_pos_encoding=True)
    assert out.last_hidden_state.shape == (2, 1 + 6 * 3, config.hidden_size)


def test_position_embeddings_are_resampled_in_2d(config):
    model = model_for(config)
    original = model.vit.embeddings.position_embedding.detach().clone()
    model.set_input_size(64)  # a 4x4 grid of patches becomes 8x8
    resampled = model.vit.embeddings.position_embedding
    assert resampled.shape == (1, 1 + 64, config.hidden_size)
    assert torch.equal(resampled[:, 0], original[:, 0])  # the class token's position is kept
    grid = original[0, 1:].reshape(4, 4, -1).permute(2, 0, 1)[None]
    expected = F.interpolate(grid, size=(8, 8), mode="bicubic", align_corners=False)
    torch.testing.assert_close(resampled[0, 1:], expected[0].permute(1, 2, 0).reshape(64, -1))


def test_non_square_model():
    config = tiny_config(image_size=(32, 48))
    model = model_for(config)
    assert model(pixels(height=32, width=48)).logits.shape == (2, 5)
    with pytest.raises(ValueError, match="interpolate_pos_encoding"):
        model(pixels(height=48, width=32))


@pytest.mark.parametrize(
    "x, error, match",
    [
        (torch.randn(2, 1, 32, 32), ValueError, "1 channels but the model expects 3"),
        (torch.randn(2, 3, 48, 48), ValueError, "interpolate_pos_encoding=True"),
        (torch.randn(2, 3, 36, 36), ValueError, "not divisible by the patch size 8"),
        (torch.randn(3, 32, 32), ValueError, "4 dimensions"),
        (torch.randn(0, 3, 32, 32), ValueError, "empty batch"),
        (torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8), TypeError, "floating point"),
    ],
)
def test_bad_pixel_values_get_clear_errors(config, x, error, match):
    model = model_for(config)
    with pytest.raises(error, match=match):
        model(x)


def test_not_divisible_is_reported_even_with_interpolation(config):
    with pytest.raises(ValueError, match="not divisible"):
        model_for(config)(pixels(height=36, width=40), interpolate_pos_encoding=True)


def test_bf16_autocast_runs_and_stays_close(config):
    model = model_for(tiny_config(zero_init_head=False))
    x = pixels()
    reference = model(x).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x).logits
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, atol=0.1, rtol=0.1)


def test_torch_compile_fullgraph(config):
    model = model_for(tiny_config(zero_init_head=False))
    x = pixels()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x).logits, model(x).logits)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x).logits, model(x).logits)
    model.train()  # the matmul attention path of CPU half-precision training
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(x).logits, model(x).logits)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_inference_without_autograd_equals_inference_with_it(hidden_act):
    model = model_for(tiny_config(zero_init_head=False, hidden_act=hidden_act))
    x = pixels()
    tracked = model(x, output_hidden_states=True)
    with torch.no_grad():
        untracked = model(x, output_hidden_states=True)
    assert torch.equal(untracked.logits, tracked.logits)
    assert len(untracked.hidden_states) == len(tracked.hidden_states) == 3
    for free, kept in zip(untracked.hidden_states, tracked.hidden_states):
        assert torch.equal(free, kept)


def test_a_missing_checkpoint_folder_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    for path in (str(tmp_path / "run" / "final"), "./run"):
        with pytest.raises(OSError, match="is not a local folder"):
            VisionTransformerForImageClassification.from_pretrained(path)
    with pytest.raises(OSError, match="'weights.bin' is a file: pass the folder"):
        VisionTransformerForImageClassification.from_pretrained("weights.bin")
    # "org/name" could be a Hub id: the Hub is tried (offline in the tests), and the error still names the path
    with pytest.raises(OSError, match="HF_HUB_OFFLINE=1 forbids .*there is no local folder 'run/final' either"):
        VisionTransformerForImageClassification.from_pretrained("run/final")


def test_labels_outside_the_classes_are_named(config):
    model, x = model_for(config), pixels()
    with pytest.raises(IndexError, match="Target 5 is out of bounds"):  # transformers' loss, torch's message
        model(x, labels=torch.tensor([1, 5]))
    ignored = model(x, labels=torch.tensor([1, -100])).loss  # the usual "ignore this sample" label is fine
    torch.testing.assert_close(ignored, F.cross_entropy(model(x).logits[:1], torch.tensor([1])))


def test_a_folder_without_config_json_is_named(tmp_path, config):
    model_for(config).save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    # transformers alone builds a default (ViT-B/16) config for such a folder and fails on the weights' shapes
    with pytest.raises(OSError, match="has no config.json"):
        VisionTransformerForImageClassification.from_pretrained(tmp_path)


def test_another_models_checkpoint_is_refused_not_loaded_as_a_random_backbone(tmp_path):
    from transformers import ResNetConfig, ResNetModel

    ResNetModel(ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8)).save_pretrained(tmp_path)
    # transformers alone warns and builds a randomly initialised ViT from such a folder
    for model_class in (VisionTransformerForImageClassification, VisionTransformerModel):
        with pytest.raises(ValueError, match="holds a 'resnet' checkpoint, not an hf-vit one"):
            model_class.from_pretrained(tmp_path)


def test_weights_missing_from_the_checkpoint_are_an_error_except_a_new_head(tmp_path, config):
    from safetensors.torch import load_file, save_file

    model_for(config).vit.save_pretrained(tmp_path / "backbone")
    # a backbone checkpoint gives a classifier its encoder; only the head is new
    loaded, info = VisionTransformerForImageClassification.from_pretrained(
        tmp_path / "backbone", output_loading_info=True
    )
    assert set(info["missing_keys"]) == {"classifier.weight", "classifier.bias"}
    weights = load_file(tmp_path / "backbone" / "model.safetensors")
    del weights["layers.1.mlp.fc1.weight"]
    save_file(weights, tmp_path / "backbone" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"1 of its weights are not in the checkpoint \(vit.layers.1.mlp.fc1.weight\)"
    ):
        VisionTransformerForImageClassification.from_pretrained(tmp_path / "backbone")


def test_a_four_channel_model_fed_rgb_is_told_to_keep_the_channels():
    from hf_vit import VisionTransformerImageProcessor

    model = model_for(tiny_config(num_channels=4))
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 4), dtype=np.uint8)  # RGB + infrared
    rgb = VisionTransformerImageProcessor(size=32)(image, return_tensors="pt").pixel_values
    with pytest.raises(ValueError, match="3 channels but the model expects 4.*do_convert_rgb=False"):
        model(rgb)
    kept = VisionTransformerImageProcessor(size=32, do_convert_rgb=False, image_mean=[0.5] * 4, image_std=[0.5] * 4)
    assert model(kept(image, return_tensors="pt").pixel_values).logits.shape == (1, 5)
