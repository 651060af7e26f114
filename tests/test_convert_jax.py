"""The authors' JAX `.npz` checkpoints: exact mapping, config inference, and logits against a numpy implementation of
the paper's equations that reads the npz arrays directly (independent of hf-vit's modules)."""

import importlib.util
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config
from scipy.special import erf

from hf_vit import VisionTransformerForImageClassification
from hf_vit.convert import (
    ConversionError,
    convert_jax_checkpoint,
    hf_vit_to_npz_arrays,
    infer_config_from_npz,
    load_npz,
    npz_to_hf_vit_state_dict,
)
from hf_vit.model.resolution import resample_position_embeddings

ROOT = Path(__file__).resolve().parents[1]
POS = "Transformer/posembed_input/pos_embedding"

# Tiny models: width, depth, heads, MLP, patch, image, classifier, representation size, classes.
SPECS = {
    "token": dict(width=32, depth=2, heads=4, mlp=64, patch=8, image=32, classifier="token", rep=None, classes=5),
    "token-pre-logits-patch4": dict(
        width=16, depth=1, heads=2, mlp=40, patch=4, image=16, classifier="token", rep=24, classes=7
    ),
    "gap": dict(width=24, depth=2, heads=3, mlp=48, patch=8, image=24, classifier="gap", rep=None, classes=6),
    "gap-pre-logits-no-head": dict(
        width=24, depth=1, heads=2, mlp=32, patch=6, image=18, classifier="gap", rep=20, classes=0
    ),
}


def random_npz(width, depth, heads, mlp, patch, image, classifier, rep, classes, channels=3, seed=0, lazy=False):
    """Random arrays in the `vit_jax` layout, written from the Flax module tree, not from hf-vit. `lazy`: zero views
    of the right shapes, free to make at any size (for checks that read shapes only)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        if lazy:
            return np.broadcast_to(np.float32(0), shape)
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hd = width // heads
    grid = image // patch
    w = {
        "embedding/kernel": normal(patch, patch, channels, width, scale=(patch * patch * channels) ** -0.5),
        "embedding/bias": normal(width, scale=0.1),
        POS: normal(1, grid * grid + (classifier == "token"), width, scale=0.5),
    }
    if classifier == "token":
        w["cls"] = normal(1, 1, width, scale=0.5)
    for i in range(depth):
        b = f"Transformer/encoderblock_{i}/"
        for ln in ("LayerNorm_0", "LayerNorm_2"):
            w[f"{b}{ln}/scale"] = 1 + normal(width, scale=0.1)
            w[f"{b}{ln}/bias"] = normal(width, scale=0.1)
        a = f"{b}MultiHeadDotProductAttention_1/"
        for name in ("query", "key", "value"):
            w[f"{a}{name}/kernel"] = normal(width, heads, hd, scale=width**-0.5)
            w[f"{a}{name}/bias"] = normal(heads, hd, scale=0.1)
        w[f"{a}out/kernel"] = normal(heads, hd, width, scale=width**-0.5)
        w[f"{a}out/bias"] = normal(width, scale=0.1)
        w[f"{b}MlpBlock_3/Dense_0/kernel"] = normal(width, mlp, scale=width**-0.5)
        w[f"{b}MlpBlock_3/Dense_0/bias"] = normal(mlp, scale=0.1)
        w[f"{b}MlpBlock_3/Dense_1/kernel"] = normal(mlp, width, scale=mlp**-0.5)
        w[f"{b}MlpBlock_3/Dense_1/bias"] = normal(width, scale=0.1)
    w["Transformer/encoder_norm/scale"] = 1 + normal(width, scale=0.1)
    w["Transformer/encoder_norm/bias"] = normal(width, scale=0.1)
    features = width
    if rep:
        w["pre_logits/kernel"] = normal(width, rep, scale=width**-0.5)
        w["pre_logits/bias"] = normal(rep, scale=0.1)
        features = rep
    if classes:
        w["head/kernel"] = normal(features, classes, scale=features**-0.5)
        w["head/bias"] = normal(classes, scale=0.1)
    return w


def to_big_vision(w):
    """The same model as big_vision names it: `params/` prefix, its sub-module numbers, `pos_embedding` at the top
    level and added before the class token is prepended (so the class token has no position)."""
    renames = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0", "LayerNorm_2": "LayerNorm_1"}
    renames["MlpBlock_3"] = "MlpBlock_0"
    out = {}
    for key, value in w.items():
        if key == POS:
            key, value = "pos_embedding", value[:, 1:] if "cls" in w else value
        for old, new in renames.items():
            key = key.replace(f"/{old}/", f"/{new}/")
        out[f"params/{key}"] = value
    out["opt/state/step"] = np.array(3)  # optimizer state beside the params: not weights, skipped
    return out


# --- An independent reference: the paper's equations in float64 numpy, on the npz arrays as Flax uses them. ---


def layer_norm(x, scale, bias, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def gelu(x, approximate=False):
    if approximate:  # jax.nn.gelu(approximate=True), what flax.linen.gelu computes
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def reference_logits(w, images, classifier, approximate=True, cls_has_position=True):
    """`images` (B, C, H, W) float -> logits, following vit_jax's `VisionTransformer.__call__`."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
    x = images.astype(np.float64).transpose(0, 2, 3, 1)  # NHWC, as Flax convolutions take it
    kernel = w["embedding/kernel"]
    p = kernel.shape[0]
    b, h, wd, c = x.shape
    patches = x.reshape(b, h // p, p, wd // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p, p, c)
    x = np.einsum("bnijc,ijcd->bnd", patches, kernel) + w["embedding/bias"]  # row-major over the patch grid
    pos = w[POS] if POS in w else w["pos_embedding"]
    if not cls_has_position:
        x = x + pos
    if classifier == "token":
        x = np.concatenate([np.repeat(w["cls"], b, axis=0), x], axis=1)
    if cls_has_position:
        x = x + pos
    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in w:
        blk = f"Transformer/encoderblock_{i}/"
        a = f"{blk}MultiHeadDotProductAttention_1/"
        y = layer_norm(x, w[f"{blk}LayerNorm_0/scale"], w[f"{blk}LayerNorm_0/bias"])
        q, k, v = (
            np.einsum("bnd,dhk->bnhk", y, w[f"{a}{n}/kernel"]) + w[f"{a}{n}/bias"] for n in ("query", "key", "value")
        )
        scores = np.einsum("bqhk,bshk->bhqs", q / np.sqrt(q.shape[-1]), k)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        attended = np.einsum("bhqs,bshk->bqhk", probs, v)
        x = x + np.einsum("bqhk,hkd->bqd", attended, w[f"{a}out/kernel"]) + w[f"{a}out/bias"]
        y = layer_norm(x, w[f"{blk}LayerNorm_2/scale"], w[f"{blk}LayerNorm_2/bias"])
        m = f"{blk}MlpBlock_3/"
        y = gelu(y @ w[f"{m}Dense_0/kernel"] + w[f"{m}Dense_0/bias"], approximate)
        x = x + y @ w[f"{m}Dense_1/kernel"] + w[f"{m}Dense_1/bias"]
        i += 1
    x = layer_norm(x, w["Transformer/encoder_norm/scale"], w["Transformer/encoder_norm/bias"])
    x = x[:, 0] if classifier == "token" else x.mean(axis=1)
    if "pre_logits/kernel" in w:
        x = np.tanh(x @ w["pre_logits/kernel"] + w["pre_logits/bias"])
    if "head/kernel" in w:
        x = x @ w["head/kernel"] + w["head/bias"]
    return x


def images_for(spec, batch=3, seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, (batch, 3, spec["image"], spec["image"])).astype(np.float32)


def save_npz(path, arrays):
    np.savez(path, **arrays)
    return path


def logits_of(model, images):
    with torch.no_grad():
        return model(torch.from_numpy(images)).logits.double().numpy()


# --- Tests ---


@pytest.mark.parametrize("name", sorted(SPECS))
def test_converted_logits_match_numpy_reference(tmp_path, name):
    spec = SPECS[name]
    arrays = random_npz(**spec)
    convert_jax_checkpoint(save_npz(tmp_path / "ckpt.npz", arrays), tmp_path / "out")
    model = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out").eval()
    images = images_for(spec)
    expected = reference_logits(arrays, images, spec["classifier"])
    got = logits_of(model, images)
    err = np.abs(got - expected).max()
    print(f"{name}: max |logits - numpy reference| = {err:.2e} (logit scale {np.abs(expected).max():.2f})")
    assert got.shape == expected.shape and err < 1e-4


def test_big_vision_names_and_class_token_without_position(tmp_path):
    spec = SPECS["token"]
    arrays = to_big_vision(random_npz(**spec, seed=3))
    model = convert_jax_checkpoint(save_npz(tmp_path / "bv.npz", arrays), tmp_path / "out")
    assert model.vit.embeddings.position_embedding[0, 0].abs().max() == 0  # the class token's zero position
    images = images_for(spec)
    plain = {k.removeprefix("params/"): v for k, v in arrays.items() if k.startswith("params/")}
    renames = {"_0/query": "_1/query", "_0/key": "_1/key", "_0/value": "_1/value", "_0/out": "_1/out"}
    renames.update({"LayerNorm_1": "LayerNorm_2", "MlpBlock_0": "MlpBlock_3"})
    flax_names = {}
    for key, value in plain.items():
        for old, new in renames.items():
            key = key.replace(old, new)
        flax_names[key] = value
    expected = reference_logits(flax_names, images, "token", cls_has_position=False)
    err = np.abs(logits_of(model, images) - expected).max()
    print(f"big_vision layout: max |logits - numpy reference| = {err:.2e}")
    assert err < 1e-4


def test_the_default_activation_is_the_flax_one_and_exact_gelu_is_an_option(tmp_path):
    spec = SPECS["token"]
    arrays = random_npz(**spec, seed=5)
    images = images_for(spec)
    tanh_reference = reference_logits(arrays, images, "token", approximate=True)
    erf_reference = reference_logits(arrays, images, "token", approximate=False)
    default = logits_of(convert_jax_checkpoint(save_npz(tmp_path / "c.npz", arrays), tmp_path / "out"), images)
    exact = logits_of(convert_jax_checkpoint(tmp_path / "c.npz", tmp_path / "exact", hidden_act="gelu"), images)
    tanh_err, erf_err = np.abs(default - tanh_reference).max(), np.abs(exact - erf_reference).max()
    print(f"default (tanh) GELU vs the flax reference {tanh_err:.2e}; hidden_act='gelu' vs the erf one {erf_err:.2e}")
    assert tanh_err < 1e-4 and erf_err < 1e-4
    assert np.abs(default - erf_reference).max() > 10 * tanh_err  # the two activations do differ


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"classifier": "gap"},
        {"representation_size": 24, "num_labels": 9},
        {"classifier": "gap", "representation_size": 16, "patch_size": 4, "image_size": 16},
        {"num_labels": 0, "qkv_bias": False},
    ],
)
def test_round_trips_are_bitwise_exact(overrides):
    torch.manual_seed(0)
    config = tiny_config(zero_init_head=False, **overrides)
    state = VisionTransformerForImageClassification(config).state_dict()
    arrays = hf_vit_to_npz_arrays(state, config)
    back = npz_to_hf_vit_state_dict(arrays, config)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    again = hf_vit_to_npz_arrays(back, config)  # and npz -> hf-vit -> npz
    assert set(again) == set(arrays) and all(np.array_equal(again[k], arrays[k]) for k in arrays)
    inferred = infer_config_from_npz(arrays)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size"):
        assert getattr(inferred, field) == getattr(config, field)
    assert (inferred.classifier, inferred.representation_size, inferred.num_labels, inferred.qkv_bias) == (
        config.classifier,
        config.representation_size,
        config.num_labels,
        config.qkv_bias,
    )


@pytest.mark.parametrize("name", sorted(SPECS))
def test_config_inferred_from_shapes(name):
    spec = SPECS[name]
    config = infer_config_from_npz(random_npz(**spec))
    assert config.hidden_size == spec["width"] and config.num_hidden_layers == spec["depth"]
    assert config.num_attention_heads == spec["heads"] and config.intermediate_size == spec["mlp"]
    assert config.patch_size == spec["patch"] and config.image_size == spec["image"]
    assert config.classifier == spec["classifier"] and config.representation_size == spec["rep"]
    assert config.num_labels == spec["classes"] and config.layer_norm_eps == 1e-6
    assert config.hidden_act == "gelu_pytorch_tanh"  # what flax.linen.gelu computes
    assert config.num_channels == 3 and config.qkv_bias


def test_every_array_is_used_and_leftovers_or_gaps_are_listed():
    arrays = random_npz(**SPECS["token-pre-logits-patch4"])
    config = infer_config_from_npz(arrays)
    state = npz_to_hf_vit_state_dict(arrays, config)
    model = VisionTransformerForImageClassification(config)
    assert set(state) == set(model.state_dict())
    # 16 arrays per block collapse into 12 weights (query, key, value fuse): every array is accounted for.
    assert len(arrays) - len(state) == 4 * config.num_hidden_layers
    extra = dict(arrays, **{"Transformer/encoderblock_0/Mystery_9/kernel": np.zeros(3, np.float32)})
    with pytest.raises(ConversionError, match="Mystery_9"):
        npz_to_hf_vit_state_dict(extra, config)
    gone = "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/key/kernel"
    both = {k: v for k, v in extra.items() if k != gone}
    with pytest.raises(ConversionError) as error:
        npz_to_hf_vit_state_dict(both, config)
    assert "Mystery_9" in str(error.value) and gone in str(error.value)  # everything wrong, listed at once


def test_position_embeddings_resized_at_load(tmp_path):
    spec = SPECS["token"]  # a 4x4 grid
    arrays = random_npz(**spec)
    model = convert_jax_checkpoint(save_npz(tmp_path / "c.npz", arrays), tmp_path / "out", image_size=48)
    assert model.config.image_size == 48 and model.config.grid_size == (6, 6)
    pos = model.vit.embeddings.position_embedding.detach()
    assert pos.shape == (1, 1 + 36, spec["width"])
    expected = resample_position_embeddings(torch.from_numpy(arrays[POS]), (4, 4), (6, 6), 1, mode="bilinear")
    assert torch.equal(pos, expected)
    assert torch.equal(pos[0, 0], torch.from_numpy(arrays[POS][0, 0]))  # the class position is kept
    assert json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())["size"] == {
        "height": 48,
        "width": 48,
    }
    gap = random_npz(**SPECS["gap"])  # no class token: the whole grid is resampled, non-square target
    state = npz_to_hf_vit_state_dict(gap, infer_config_from_npz(gap, image_size=(32, 16)))
    expected = resample_position_embeddings(torch.from_numpy(gap[POS]), (3, 3), (4, 2), 0, mode="bilinear")
    assert torch.equal(state["vit.embeddings.position_embedding"], expected)


def test_preset_fits_and_does_not_fit():
    base_size = dict(width=768, depth=12, heads=12, mlp=3072, patch=16, image=32, classifier="token", classes=2)
    base = random_npz(**base_size, rep=None, lazy=True)
    config = infer_config_from_npz(base, preset="vit-base-patch16-224")  # the preset's resolution is not used
    assert config.hidden_size == 768 and config.num_hidden_layers == 12 and config.image_size == 32
    with pytest.raises(ConversionError) as error:
        infer_config_from_npz(base, preset="vit-large-patch16-224")
    message = str(error.value)
    print(message)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        assert field in message
    assert "vit-large-patch16-224" in message and "patch_size" not in message
    with pytest.raises(ConversionError, match="patch_size: the checkpoint has 16, preset 'vit-base-patch32-224'"):
        infer_config_from_npz(base, preset="vit-base-patch32-224")
    with pytest.raises(ConversionError, match="Unknown preset"):
        infer_config_from_npz(base, preset="vit-gigantic")


def test_inconsistent_shapes_are_listed(tmp_path):
    arrays = random_npz(**SPECS["token"])
    arrays["Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel"] = np.zeros((32, 50), np.float32)
    with pytest.raises(ConversionError, match=r"encoderblock_1/MlpBlock_3/Dense_0/kernel: shape \(32, 50\)"):
        convert_jax_checkpoint(save_npz(tmp_path / "c.npz", arrays), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def resnet_arrays():
    rng = np.random.default_rng(0)
    return {
        "conv_root/kernel": rng.standard_normal((7, 7, 3, 64)).astype(np.float32),
        "gn_root/scale": np.ones(64, np.float32),
        "block1/unit1/conv1/kernel": rng.standard_normal((1, 1, 64, 64)).astype(np.float32),
        "head/kernel": np.zeros((2048, 1000), np.float32),
    }


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("resnet", r"not a ViT checkpoint.*ResNet"),
        ("hybrid", r"lacks.*'block1/unit1/conv2/kernel'.*gn_root/bias"),
        ("missing", r"lacks.*encoderblock_1/LayerNorm_2/scale"),
        ("extra", r"no place.*Transformer/extra/kernel"),
        ("pickled", r"pickled object arrays \['meta'\].*allow_pickle"),
        ("pickle-file", r"pickle file"),
        ("truncated", r"bad.npz as an .npz archive: it is truncated or corrupted.*fetch the file again"),
        ("corrupted", r"array '.*' of .*bad.npz: it is truncated or corrupted"),
    ],
)
def test_bad_checkpoints_raise_and_write_nothing(tmp_path, case, pattern):
    arrays = random_npz(**SPECS["token"])
    path = tmp_path / "bad.npz"
    if case == "resnet":
        save_npz(path, resnet_arrays())
    elif case == "hybrid":
        save_npz(path, {**arrays, **resnet_arrays()})
    elif case == "missing":
        save_npz(path, {k: v for k, v in arrays.items() if k != "Transformer/encoderblock_1/LayerNorm_2/scale"})
    elif case == "extra":
        save_npz(path, {**arrays, "Transformer/extra/kernel": np.zeros(2, np.float32)})
    elif case == "pickled":
        save_npz(path, {**arrays, "meta": np.array([{"note": "python object"}], dtype=object)})
    elif case in ("truncated", "corrupted"):  # a download cut short; bytes changed inside a member
        data = bytearray(save_npz(path, arrays).read_bytes())
        if case == "truncated":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 3 : len(data) // 3 + 64] = bytes(64)
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(pickle.dumps(arrays))
    with pytest.raises(ConversionError, match=pattern) as error:
        convert_jax_checkpoint(path, tmp_path / "out")
    print(f"{case}: {error.value}")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz"]  # no staging folder left behind


def test_load_npz_reads_plain_arrays_only(tmp_path):
    arrays = random_npz(**SPECS["gap"])
    loaded = load_npz(save_npz(tmp_path / "c.npz", arrays))
    assert set(loaded) == set(arrays) and all(np.array_equal(loaded[k], arrays[k]) for k in arrays)
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ConversionError, match="single .npy array"):
        load_npz(tmp_path / "one.npy")
    with pytest.raises(ConversionError, match="not a file"):
        load_npz(tmp_path / "nothing.npz")


def test_labels_and_existing_output(tmp_path):
    arrays = random_npz(**SPECS["gap"])
    path = save_npz(tmp_path / "c.npz", arrays)
    names = [f"class {i}" for i in range(6)]
    model = convert_jax_checkpoint(path, tmp_path / "out", labels=names)
    assert model.config.id2label == dict(enumerate(names))
    with pytest.raises(FileExistsError, match="not empty"):
        convert_jax_checkpoint(path, tmp_path / "out")
    with pytest.raises(ConversionError, match="3 labels"):
        convert_jax_checkpoint(path, tmp_path / "other", labels=names[:3])
    default = convert_jax_checkpoint(path, tmp_path / "out", overwrite=True)
    assert default.config.id2label[5] == "LABEL_5"


def run_cli(*args):
    """The script in-process (its error paths), without paying a new interpreter's import time."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in args])


def test_command_line(tmp_path, capsys):
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    import hf_vit  # noqa: F401 - registers the Auto classes

    spec = SPECS["token-pre-logits-patch4"]
    arrays = random_npz(**spec)
    path = save_npz(tmp_path / "c.npz", arrays)
    # the script in this process (test_convert_transformers.py runs it in its own)
    assert run_cli("--source", "jax", "--input", path, "--output", tmp_path / "out") == 0
    model = AutoModelForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert isinstance(model, VisionTransformerForImageClassification)
    processor = AutoImageProcessor.from_pretrained(tmp_path / "out")
    assert list(processor.image_mean) == [0.5] * 3 and list(processor.image_std) == [0.5] * 3
    images = images_for(spec)
    assert np.abs(logits_of(model, images) - reference_logits(arrays, images, "token")).max() < 1e-4

    code = run_cli("--source", "jax", "--input", path, "--output", tmp_path / "o2", "--preset", "vit-base-patch16-224")
    assert code == 2 and "hidden_size" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    code = run_cli("--source", "jax", "--input", path, "--output", tmp_path / "o3", "--image_size", "24")
    assert code == 0 and json.loads((tmp_path / "o3" / "config.json").read_text())["image_size"] == 24
    code = run_cli("--source", "transformers", "--input", tmp_path, "--output", tmp_path / "o4", "--image_size", 64)
    assert code == 2 and "--image_size cannot be used with --source transformers" in capsys.readouterr().err


def test_big_vision_class_token_without_position_on_a_grid_that_is_not_square(tmp_path):
    """big_vision adds the class token after the positions whatever the grid: a 3x4 one gets a zero class position."""
    spec = SPECS["token"]
    w = random_npz(**spec, seed=3)
    w[POS] = np.random.default_rng(0).standard_normal((1, 1 + 12, spec["width"])).astype(np.float32)
    arrays = to_big_vision(w)  # drops the class position: a (1, 12, D) table
    model = convert_jax_checkpoint(save_npz(tmp_path / "bv.npz", arrays), tmp_path / "out", image_size=(24, 32))
    table = model.vit.embeddings.position_embedding.detach().numpy()
    expected = np.concatenate([np.zeros((1, 1, spec["width"]), np.float32), arrays["params/pos_embedding"]], axis=1)
    np.testing.assert_array_equal(table, expected)
