"""The section 4.5 analysis: captured probabilities equal eager attention's, rollout, mean attention distance,
position similarity and filter components against numpy computations written here, and properties that pin the
definitions (rows sum to 1, uniform attention's analytic distance, self-attention's distance 0, a sinusoid's peak)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config
from torch import nn

from hf_vit import VisionTransformerForImageClassification, VisionTransformerModel
from hf_vit.analysis import (
    attention_probabilities,
    attention_summary,
    capture_attention,
    components_as_images,
    mean_attention_distance,
    mean_attention_distances,
    patch_embedding_components,
    position_embedding_similarity,
    rollout_map,
    rollout_maps,
    write_analysis_figures,
)

ROOT = Path(__file__).resolve().parents[1]


def model_for(config, seed=0, cls=VisionTransformerForImageClassification, sharpen=4.0):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        # Sharper than the initialisation's near-uniform attention, so the maps differ from layer to layer.
        for block in model.base_model.layers:
            block.attention.qkv.weight.mul_(sharpen)
    return model


def pixels(batch=2, height=32, width=32, seed=0):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


# Captured probabilities


@pytest.mark.parametrize(
    "dtype, size, atol",
    [(torch.float32, (32, 32), 1e-4), (torch.bfloat16, (32, 32), 2e-2), (torch.float32, (24, 40), 1e-4)],
)
def test_captured_probabilities_equal_eager_attention_for_the_chosen_layers(dtype, size, atol):
    # bf16 eager attention rounds its scores to bf16: scores of the initialisation's size keep that error small.
    model = model_for(tiny_config(num_hidden_layers=3), sharpen=4.0 if dtype == torch.float32 else 1.0).to(dtype)
    x = pixels(height=size[0], width=size[1]).to(dtype)
    interpolate = size != (32, 32)
    tokens = 1 + (size[0] // 8) * (size[1] // 8)
    with torch.no_grad():
        with capture_attention(model, layers=[0, -1]) as same_input:
            eager = model(x, output_attentions=True, interpolate_pos_encoding=interpolate).attentions
        with capture_attention(model, layers=[0, -1]) as probs:
            model(x, interpolate_pos_encoding=interpolate)
    assert sorted(probs) == [0, 2]
    for layer in (0, 2):
        assert probs[layer].dtype == torch.float32 and probs[layer].shape == (2, 4, tokens, tokens)
        # On the same layer input, only the eager function's own rounding differs (bf16 scores there).
        exact = atol / 100 if dtype == torch.float32 else atol
        torch.testing.assert_close(same_input[layer], eager[layer].float(), atol=exact, rtol=0)
        # Under SDPA the later layers' inputs differ from the eager run's by the kernels' rounding.
        torch.testing.assert_close(probs[layer], eager[layer].float(), atol=atol, rtol=0)


def test_captured_probabilities_of_a_converted_checkpoint_equal_transformers_own(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    from hf_vit.commands import convert

    torch.manual_seed(0)
    fields = dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96, num_labels=3)
    theirs = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, **fields)).eval()
    theirs.save_pretrained(tmp_path / "transformers")
    # the converter's command (scripts/convert_checkpoint.py), run in this process
    arguments = ["--source", "transformers", "--input", str(tmp_path / "transformers")]
    assert convert.main([*arguments, "--output", str(tmp_path / "converted")]) == 0
    ours = VisionTransformerForImageClassification.from_pretrained(tmp_path / "converted").eval()
    theirs.set_attn_implementation("eager")
    x = pixels()
    with torch.no_grad():
        expected = theirs(x, output_attentions=True).attentions
    probs = attention_probabilities(ours, x)
    for layer in range(3):
        torch.testing.assert_close(probs[layer], expected[layer], atol=1e-6, rtol=0)


def test_capture_keeps_the_models_attention_and_outputs_and_removes_its_hooks():
    model = model_for(tiny_config(attn_implementation="sdpa"))
    x = pixels()
    returned = []
    for block in model.vit.layers:
        # The attention functions other than eager return no probabilities: None here means SDPA ran.
        block.attention.register_forward_hook(lambda module, args, output: returned.append(output[1]))
    with torch.no_grad():
        plain = model(x).logits
        returned.clear()
        with capture_attention(model, layers=1) as probs:
            captured = model(x).logits
    assert returned == [None, None] and list(probs) == [1]
    assert torch.equal(plain, captured)
    assert all(not block.attention._forward_pre_hooks for block in model.vit.layers)


def test_capture_under_autograd_keeps_no_graph_and_rejects_unknown_layers():
    model = model_for(tiny_config()).train()
    with capture_attention(model) as probs:
        model(pixels()).logits.sum().backward()
    assert sorted(probs) == [0, 1] and not probs[0].requires_grad
    with pytest.raises(ValueError, match="layers"):
        attention_probabilities(model, pixels(), layers=[2])
    with pytest.raises(TypeError, match="hf-vit"):
        attention_probabilities(nn.Linear(2, 2), pixels())


# Rollout


def numpy_rollout(attentions, fusion="mean", discard=0.0):
    attentions = [a.double().numpy() for a in attentions]
    batch, _, tokens, _ = attentions[0].shape
    result = np.stack([np.eye(tokens)] * batch)
    for probs in attentions:
        for b in range(batch):
            fused = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](probs[b], axis=0)
            flat = fused.flatten()
            flat[np.argsort(flat)[: int(flat.size * discard)]] = 0.0
            joint = 0.5 * flat.reshape(tokens, tokens) + 0.5 * np.eye(tokens)
            joint /= joint.sum(axis=1, keepdims=True)
            result[b] = joint @ result[b]
    return result


@pytest.mark.parametrize("fusion, discard", [("mean", 0.0), ("max", 0.0), ("min", 0.0), ("mean", 0.9)])
def test_rollout_matches_numpy(fusion, discard):
    config = tiny_config(num_hidden_layers=3)
    model, x = model_for(config), pixels(height=24, width=40)
    probs = attention_probabilities(model, x, interpolate_pos_encoding=True)  # the probabilities the rollout reads
    reference = numpy_rollout([probs[layer] for layer in range(3)], fusion, discard)
    maps = rollout_maps(model, x, head_fusion=fusion, discard_ratio=discard, interpolate_pos_encoding=True)
    np.testing.assert_allclose(maps.numpy(), reference[:, 0, 1:].reshape(2, 3, 5), atol=1e-5)
    with pytest.raises(ValueError, match="head_fusion"):
        rollout_maps(model, x, head_fusion="median")


@pytest.mark.parametrize("classifier, registers", [("token", 0), ("gap", 0), ("token", 4), ("gap", 4)])
def test_model_rollout_is_the_class_tokens_row_or_the_patch_rows_mean(classifier, registers):
    """The map is the class token's row (or the patch rows' mean) over the patch columns only: register tokens'
    columns and rows are left out of it."""
    config = tiny_config(num_hidden_layers=3, classifier=classifier, num_register_tokens=registers)
    model, x = model_for(config), pixels(height=24, width=40)
    with torch.no_grad():
        eager = model(x, output_attentions=True, interpolate_pos_encoding=True).attentions
    reference = numpy_rollout(eager)
    prefix = config.num_prefix_tokens
    assert reference.shape[-1] == 15 + prefix
    token = classifier == "token"
    expected = reference[:, 0, prefix:] if token else reference[:, prefix:, prefix:].mean(axis=1)
    maps = rollout_maps(model, x, interpolate_pos_encoding=True)
    assert maps.shape == (2, 3, 5)
    np.testing.assert_allclose(maps.numpy(), expected.reshape(2, 3, 5), atol=1e-5)
    computed = rollout_map(torch.from_numpy(reference).float(), (3, 5), prefix, class_token=token)
    torch.testing.assert_close(computed, maps, atol=1e-5, rtol=0)


# Mean attention distance


def numpy_mean_distance(probs, rows, cols, patch, prefix):
    """Per (image, head): for each query patch, the attention-weighted distance to the key patches (weights over
    patches renormalised), averaged over query patches."""
    probs = probs.double().numpy()[..., prefix:, prefix:]
    batch, heads, n, _ = probs.shape
    result = np.zeros((batch, heads))
    for b in range(batch):
        for h in range(heads):
            total = 0.0
            for q in range(n):
                weights = probs[b, h, q] / probs[b, h, q].sum()
                qy, qx = divmod(q, cols)
                total += sum(weights[k] * patch * np.hypot(qy - k // cols, qx - k % cols) for k in range(n))
            result[b, h] = total / n
    return result


def test_mean_attention_distance_matches_numpy_on_captured_probabilities():
    config = tiny_config(num_hidden_layers=3)
    model, x = model_for(config), pixels(height=24, width=40)
    probs = attention_probabilities(model, x, interpolate_pos_encoding=True)
    per_image = [mean_attention_distance(probs[layer], (3, 5), 8, 1) for layer in range(3)]
    for layer in range(3):
        np.testing.assert_allclose(per_image[layer].numpy(), numpy_mean_distance(probs[layer], 3, 5, 8, 1), atol=1e-4)
    distances = mean_attention_distances(model, x, interpolate_pos_encoding=True)
    assert distances.shape == (3, 4)
    torch.testing.assert_close(distances, torch.stack([d.mean(0) for d in per_image]))
    summary = attention_summary(model, x, interpolate_pos_encoding=True)
    torch.testing.assert_close(summary.mean_distances, torch.stack(per_image, dim=1))
    rollout = numpy_rollout([probs[layer] for layer in range(3)])  # the same forward's probabilities, rolled out
    expected = rollout_map(torch.from_numpy(rollout).float(), (3, 5), config.num_prefix_tokens)
    torch.testing.assert_close(summary.rollout, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("classifier, image_size", [("token", 32), ("gap", [16, 32])])
def test_uniform_attention_gives_the_grids_mean_pairwise_distance(classifier, image_size):
    config = tiny_config(classifier=classifier, image_size=image_size)
    model = model_for(config)
    with torch.no_grad():
        for block in model.vit.layers:
            block.attention.qkv.weight.zero_()  # every score 0: uniform attention over all tokens
            block.attention.qkv.bias.zero_()
    rows, cols = config.grid_size
    ys, xs = np.divmod(np.arange(rows * cols), cols)
    analytic = 8 * np.mean(np.hypot(ys[:, None] - ys[None, :], xs[:, None] - xs[None, :]))
    distances = mean_attention_distances(model, pixels(height=config.image_hw[0], width=config.image_hw[1]))
    np.testing.assert_allclose(distances.numpy(), np.full((2, 4), analytic), rtol=1e-5)


class SelfOnlyQueriesAndKeys(nn.Module):
    """A stand-in for `qkv` whose queries and keys are a large multiple of one-hot token codes: each token's
    attention goes to itself."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = hidden_states.shape
        codes = torch.zeros(tokens, self.head_dim)
        codes[torch.arange(tokens), torch.arange(tokens)] = 30.0
        qkv = torch.zeros(batch, tokens, 3, self.heads, self.head_dim)
        qkv[:, :, 0] = qkv[:, :, 1] = codes[None, :, None]
        return qkv.flatten(2)


def test_attention_to_the_token_itself_gives_distance_zero():
    config = tiny_config(hidden_size=64, num_attention_heads=2)  # head_dim 32 >= 17 tokens for one-hot codes
    model = model_for(config)
    for block in model.vit.layers:
        block.attention.qkv = SelfOnlyQueriesAndKeys(2, 32)
    x = pixels()
    probs = attention_probabilities(model, x)
    torch.testing.assert_close(probs[0], torch.eye(17).expand(2, 2, 17, 17), atol=1e-6, rtol=0)
    assert mean_attention_distances(model, x).abs().max() < 1e-6


# Position embeddings and filters


def sinusoid_2d(rows, cols, dim):
    """A 2D sine-cosine position embedding: half the channels encode the row, half the column."""
    quarter = dim // 4
    frequencies = 1.0 / 100.0 ** (np.arange(quarter) / quarter)
    ys, xs = np.divmod(np.arange(rows * cols), cols)
    parts = [f(c[:, None] * frequencies[None, :]) for c in (ys, xs) for f in (np.sin, np.cos)]
    return np.concatenate(parts, axis=1)


def test_position_similarity_of_a_2d_sinusoid_peaks_at_its_own_position_and_matches_numpy():
    config = tiny_config(image_size=[24, 40])  # a 3x5 grid
    model = model_for(config)
    table = sinusoid_2d(3, 5, config.hidden_size)
    with torch.no_grad():
        model.vit.embeddings.position_embedding[0, 1:] = torch.from_numpy(table).float()
    similarity = position_embedding_similarity(model)
    assert similarity.shape == (3, 5, 3, 5)
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    np.testing.assert_allclose(similarity.numpy(), (unit @ unit.T).reshape(3, 5, 3, 5), atol=1e-5)
    for i in range(3):
        for j in range(5):
            others = similarity[i, j].clone()
            others[i, j] = -2.0
            assert similarity[i, j, i, j] == pytest.approx(1.0) and others.max() < similarity[i, j, i, j] - 1e-3
    torch.testing.assert_close(position_embedding_similarity(torch.from_numpy(table).float(), (3, 5)), similarity)


def test_filter_components_match_numpy_pca():
    weight = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    weight[:, 0] += 3 * torch.randn(32, 1, 1)  # one dominant direction: red brightness
    components, ratio = patch_embedding_components(weight, num_components=5)
    assert components.shape == (5, 3, 8, 8)
    flat = weight.double().numpy().reshape(32, -1)
    eigenvalues, eigenvectors = np.linalg.eigh(np.cov(flat, rowvar=False))
    order = np.argsort(eigenvalues)[::-1][:5]
    ours = components.double().numpy().reshape(5, -1)
    np.testing.assert_allclose(np.abs(np.sum(ours * eigenvectors[:, order].T, axis=1)), np.ones(5), atol=1e-4)
    np.testing.assert_allclose(ratio.numpy(), eigenvalues[order] / eigenvalues.sum(), rtol=1e-4)
    assert (ours[np.arange(5), np.abs(ours).argmax(1)] > 0).all()  # the fixed sign
    model = model_for(tiny_config())
    images = components_as_images(patch_embedding_components(model).components)
    assert images.shape == (28, 8, 8, 3) and images.min() == 0 and images.max() == 1


def test_visualize_writes_the_figures_for_a_saved_model(tmp_path):
    from hf_vit import VisionTransformerImageProcessor
    from hf_vit.commands import visualize

    config = tiny_config(image_size=16, patch_size=4, num_labels=10)
    model_for(config).save_pretrained(tmp_path / "model")
    VisionTransformerImageProcessor(size=16, crop_size=16, do_center_crop=False).save_pretrained(tmp_path / "model")
    # the command of scripts/visualize.py, run in this process
    argv = ["--model", str(tmp_path / "model"), "--output", str(tmp_path / "figures"), "--num_images", "3"]
    assert visualize.main([*argv, "--image_size", "24", "20", "--bf16"]) == 0
    written = sorted(p.name for p in (tmp_path / "figures").iterdir())
    assert written == ["embedding_and_attention_distance.png", "rollout.png"]
    assert (tmp_path / "figures" / "rollout.png").stat().st_size > 1000


def test_figures_are_paged_eight_images_to_a_rollout_figure(tmp_path):
    import PIL.Image

    from hf_vit import VisionTransformerImageProcessor

    model = model_for(tiny_config(classifier="gap"))
    rng = np.random.default_rng(0)
    images = [PIL.Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)) for _ in range(9)]
    written = write_analysis_figures(
        model, VisionTransformerImageProcessor(size=32), images, tmp_path, image_size=(24, 40), batch_size=4
    )
    assert [path.name for path in written] == [
        "embedding_and_attention_distance.png",
        "rollout_1.png",
        "rollout_2.png",
    ]
    assert all(path.stat().st_size > 1000 for path in written)


def test_all_layer_functions_work_on_the_base_model_in_bf16():
    model = model_for(tiny_config(), cls=VisionTransformerModel).to(torch.bfloat16)
    x = pixels()
    assert rollout_maps(model, x, head_fusion="max", discard_ratio=0.5).dtype == torch.float32
    assert mean_attention_distances(model, x, layers=[-1]).shape == (1, 4)


@pytest.fixture
def saved_model(tmp_path):
    from hf_vit import VisionTransformerImageProcessor

    model_for(tiny_config(image_size=16, patch_size=4, num_labels=10)).save_pretrained(tmp_path / "model")
    VisionTransformerImageProcessor(size=16, do_center_crop=False).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_visualize_without_matplotlib_stops_before_the_analysis(saved_model, tmp_path, monkeypatch, capsys):
    import hf_vit.commands.visualize as visualize

    def analysis_ran(*args, **kwargs):
        raise AssertionError("the analysis ran although its figures cannot be drawn")

    monkeypatch.setattr(visualize, "write_analysis_figures", analysis_ran)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if hf-vit[plot] were not installed
    code = visualize.main(["--model", str(saved_model), "--output", str(tmp_path / "figures"), "--num_images", "1"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and len(errors) == 1
        and 'matplotlib, which is not installed: pip install "hf-vit[plot]"' in (errors[0])
    )
    assert not (tmp_path / "figures").exists()


@pytest.mark.parametrize(
    "case, named",
    [
        ("missing model", r"^error: --model .*nowhere: not an hf-vit model folder"),
        ("missing image", r"^error: --image .*absent\.png: no such file\.$"),
        ("corrupt image", r"^error: --image .*broken\.png: cannot be read as an image"),
        ("image size", r"^error: --image_size 18 16: the model's patches are 4x4; pass sizes divisible by 4\.$"),
    ],
)
def test_visualize_bad_input_is_one_error_line(saved_model, tmp_path, capsys, case, named):
    import re

    from hf_vit.commands.visualize import main

    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    args = {
        "missing model": ["--model", str(tmp_path / "nowhere")],
        "missing image": ["--model", str(saved_model), "--image", str(tmp_path / "absent.png")],
        "corrupt image": ["--model", str(saved_model), "--image", str(tmp_path / "broken.png")],
        "image size": ["--model", str(saved_model), "--image_size", "18", "16"],
    }[case]
    code = main([*args, "--output", str(tmp_path / "figures"), "--num_images", "1"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(errors) == 1 and re.search(named, errors[0]), errors
    assert not (tmp_path / "figures").exists()


@pytest.mark.parametrize("packing", [{}, {"packed_sequence_length": 24}], ids=["native", "packed"])
def test_visualize_draws_a_native_aspect_runs_folder_from_whole_images(saved_model, tmp_path, monkeypatch, packing):
    """A folder whose processor serves native-aspect patches (saved by a --max_num_patches run, packed or not) is
    drawn on the model's square grid: the analysis gets whole images at the model's size, not flattened patches."""
    import PIL.Image

    import hf_vit.commands.visualize as visualize
    from hf_vit import VisionTransformerImageProcessor

    VisionTransformerImageProcessor(size=16, max_num_patches=12, patch_size=4, **packing).save_pretrained(saved_model)
    seen = {}

    def analysis(model, processor, images, output, **kwargs):
        seen["pixels"] = processor(images, return_tensors="pt")["pixel_values"]
        return []

    monkeypatch.setattr(visualize, "write_analysis_figures", analysis)
    image = tmp_path / "wide.png"
    PIL.Image.fromarray(np.zeros((10, 30, 3), dtype=np.uint8)).save(image)
    assert visualize.main(["--model", str(saved_model), "--output", str(tmp_path / "f"), "--image", str(image)]) == 0
    assert tuple(seen["pixels"].shape) == (1, 3, 16, 16)


@pytest.mark.parametrize("where", ["beside the classes", "inside a class", "the image folder"])
def test_visualize_refuses_an_output_inside_the_image_folder_of_its_images(
    saved_model, tmp_path, capsys, monkeypatch, where
):
    """Figures written into an image folder would join the data set as a class of their own."""
    import PIL.Image

    import hf_vit.commands.visualize as visualize

    data = tmp_path / "data"
    for label in ("cat", "dog"):
        (data / label).mkdir(parents=True)
        for i in range(2):
            PIL.Image.fromarray(np.full((8, 8, 3), 40 * i, dtype=np.uint8)).save(data / label / f"{i}.png")
    before = sorted(data.rglob("*"))
    output = {"beside the classes": data / "figures", "inside a class": data / "cat" / "f", "the image folder": data}
    argv = ["--model", str(saved_model), "--image", str(data / "cat" / "0.png")]
    code = visualize.main([*argv, "--output", str(output[where])])
    errors = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and len(errors) == 1 and f"--output {output[where]} lies inside the image folder {data}" in errors[0]
    )
    assert sorted(data.rglob("*")) == before
    monkeypatch.setattr(visualize, "write_analysis_figures", lambda *args, **kwargs: [])
    assert visualize.main([*argv, "--output", str(tmp_path / "figures")]) == 0  # outside it: drawn
