"""Masked image modeling as transformers' `AutoModelForMaskedImageModeling` runs it: SimMIM against transformers' own
model, any size and native-aspect batches, masked patch prediction without labels, the config field that chooses."""

import numpy as np
import pytest
import torch
from conftest import tiny_config
from PIL import Image
from transformers import AutoModelForMaskedImageModeling, ViTConfig, ViTForMaskedImageModeling

from hf_vit import (
    VisionTransformerConfig,
    VisionTransformerForMaskedImageModeling,
    VisionTransformerForMaskedPatchPrediction,
    VisionTransformerImageProcessor,
)
from hf_vit.convert import convert_transformers_checkpoint


def mim_config(**overrides):
    return tiny_config(num_labels=0, **overrides)


@pytest.fixture
def transformers_simmim(tmp_path):
    config = ViTConfig(
        image_size=32, patch_size=8, encoder_stride=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = ViTForMaskedImageModeling(config).eval()
    with torch.no_grad():  # transformers starts the [mask] embedding at zero: make it tell
        model.vit.embeddings.mask_token.normal_()
        model.decoder[0].bias.normal_()
    model.save_pretrained(tmp_path / "transformers")
    return tmp_path / "transformers", model


def test_simmim_equals_transformers_with_converted_weights(transformers_simmim, tmp_path):
    path, reference = transformers_simmim
    loaded = VisionTransformerForMaskedImageModeling.from_pretrained(path).eval()  # converted while loading
    auto = AutoModelForMaskedImageModeling.from_pretrained(path)
    assert type(auto).__name__ == "ViTForMaskedImageModeling"  # transformers' own folder stays transformers'
    converted = convert_transformers_checkpoint(path, tmp_path / "converted")
    assert isinstance(converted, VisionTransformerForMaskedImageModeling)
    again = AutoModelForMaskedImageModeling.from_pretrained(tmp_path / "converted").eval()
    assert isinstance(again, VisionTransformerForMaskedImageModeling)
    generator = torch.Generator().manual_seed(1)
    x, mask = torch.randn(3, 3, 32, 32, generator=generator), torch.rand(3, 16, generator=generator) < 0.6
    with torch.no_grad():
        expected = reference(x, bool_masked_pos=mask)
        for model in (loaded, converted, again):
            out = model(x, bool_masked_pos=mask)
            assert out.reconstruction.shape == (3, 3, 32, 32)
            torch.testing.assert_close(out.reconstruction, expected.reconstruction, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=0)
        torch.testing.assert_close(loaded(x).reconstruction, reference(x).reconstruction, atol=1e-5, rtol=0)
        assert loaded(x).loss is None


def masked_l1(reconstruction, pixels, mask, patch):
    """The mean absolute error over the masked patches' pixels, patch by patch in a loop."""
    total, count = 0.0, 0
    for b in range(pixels.shape[0]):
        cols = pixels.shape[-1] // patch
        for n in np.flatnonzero(mask[b].numpy()):
            row, col = divmod(int(n), cols)
            window = (slice(None), slice(row * patch, row * patch + patch), slice(col * patch, col * patch + patch))
            total += (reconstruction[b][window] - pixels[b][window]).abs().sum().item()
            count += pixels.shape[1] * patch * patch
    return total / count


def test_any_size_and_non_square_grid_loss_against_a_loop():
    torch.manual_seed(0)
    model = VisionTransformerForMaskedImageModeling(mim_config()).eval()
    x = torch.randn(2, 3, 24, 48)  # a 3x6 grid, the model's own being 4x4
    mask = torch.rand(2, 18, generator=torch.Generator().manual_seed(2)) < 0.5
    with torch.no_grad():
        out = model(x, bool_masked_pos=mask, interpolate_pos_encoding=True)
    assert out.reconstruction.shape == x.shape
    assert out.loss.item() == pytest.approx(masked_l1(out.reconstruction, x, mask, 8), rel=1e-5)
    # each token reconstructs its own patch: a patch's pixels are the decoder of its token's final state
    with torch.no_grad():
        token = model.vit(x, bool_masked_pos=mask, interpolate_pos_encoding=True).last_hidden_state[1, 1 + 7]
        block = model.decoder(token).reshape(3, 8, 8)
    torch.testing.assert_close(out.reconstruction[1, :, 8:16, 8:16], block)
    with pytest.raises(ValueError, match="encoder_stride"):
        VisionTransformerForMaskedImageModeling(mim_config(encoder_stride=4))(x, bool_masked_pos=mask)


def photo(seed, size):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def test_native_aspect_batch_each_image_equals_itself_alone():
    torch.manual_seed(0)
    model = VisionTransformerForMaskedImageModeling(mim_config()).eval()
    processor = VisionTransformerImageProcessor(patch_size=8, max_num_patches=24)
    images = [photo(0, (40, 90)), photo(1, (64, 48))]
    batch = processor(images, return_tensors="pt")
    valid = batch["pixel_attention_mask"].bool()
    assert valid.sum(1).tolist()[0] != valid.sum(1).tolist()[1]  # two grids, one padded
    mask = (torch.rand(valid.shape, generator=torch.Generator().manual_seed(3)) < 0.5) & valid
    with torch.no_grad():
        together = model(**batch, bool_masked_pos=mask)
    assert together.reconstruction.shape == batch["pixel_values"].shape
    errors, counts = [], []
    for index, image in enumerate(images):
        alone = processor([image], return_tensors="pt")
        count = int(alone["pixel_attention_mask"].sum())
        alone = {key: value[:, :count] if value.ndim > 1 and key != "spatial_shapes" else value
                 for key, value in alone.items()}  # fmt: skip
        with torch.no_grad():
            own = model(**alone, bool_masked_pos=mask[index : index + 1, :count])
        torch.testing.assert_close(together.reconstruction[index, :count], own.reconstruction[0], atol=1e-5, rtol=0)
        masked = int(mask[index].sum())
        errors.append(own.loss.item() * masked)
        counts.append(masked)
    # the batch's loss: every masked patch of both images weighs the same, the padding none
    assert together.loss.item() == pytest.approx(sum(errors) / sum(counts), rel=1e-5)
    with pytest.raises(ValueError, match="packed"):
        model(**batch, bool_masked_pos=mask, image_slot_index=torch.zeros_like(mask, dtype=torch.long))


def test_masked_patch_prediction_without_labels_computes_its_targets_from_the_pixels():
    torch.manual_seed(0)
    config = mim_config(masked_image_modeling="mpp", mpp_pixel_mean=[0.4, 0.5, 0.6], mpp_pixel_std=[0.2, 0.25, 0.3])
    model = VisionTransformerForMaskedPatchPrediction(config).eval()
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (2, 3, 32, 32)).astype(np.float64) / 255  # what the processor rescales to
    mean, std = np.array([0.4, 0.5, 0.6])[:, None, None], np.array([0.2, 0.25, 0.3])[:, None, None]
    x = torch.from_numpy((raw - mean) / std).float()
    mask = torch.rand(2, 16, generator=torch.Generator().manual_seed(4)) < 0.5
    # the targets, independently: each patch's mean colour, 3 bits per channel, red most significant
    labels = torch.full((2, 16), -100)
    for b in range(2):
        for n in range(16):
            row, col = divmod(n, 4)
            means = raw[b, :, row * 8 : row * 8 + 8, col * 8 : col * 8 + 8].mean(axis=(1, 2))
            bins = np.minimum(np.floor(means * 8 + 1e-9), 7).astype(int)
            labels[b, n] = int(bins[0] * 64 + bins[1] * 8 + bins[2])
    with torch.no_grad():
        out = model(x, bool_masked_pos=mask)
        given = model(x, bool_masked_pos=mask, labels=labels)
    torch.testing.assert_close(out.loss, given.loss)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits[mask], labels[mask]))
    assert model(x).loss is None  # no mask in evaluation: nothing to predict
    with pytest.raises(ValueError, match="mpp_pixel_std"):
        mim_config(mpp_pixel_std=[0.5, 0.0, 0.5])


def test_the_config_field_chooses_the_auto_classes_model(tmp_path):
    x, mask = torch.randn(2, 3, 32, 32), torch.rand(2, 16) < 0.5
    kinds = {"simmim": VisionTransformerForMaskedImageModeling, "mpp": VisionTransformerForMaskedPatchPrediction}
    for name, kind in kinds.items():
        config = mim_config(masked_image_modeling=name)
        model = AutoModelForMaskedImageModeling.from_config(config)
        assert type(model) is kind
        model.save_pretrained(tmp_path / name)
        loaded = AutoModelForMaskedImageModeling.from_pretrained(tmp_path / name)
        assert type(loaded) is kind
        assert model(x, bool_masked_pos=mask).loss.item() > 0  # SimMIM's collator's two inputs are enough
    with pytest.raises(ValueError, match="masked_image_modeling"):
        mim_config(masked_image_modeling="beit")
    with pytest.raises(ValueError, match="encoder_stride"):
        mim_config(encoder_stride=0)
    assert VisionTransformerConfig().reconstruction_stride == 16


def test_training_reduces_the_reconstruction_loss():
    torch.manual_seed(0)
    model = VisionTransformerForMaskedImageModeling(mim_config())
    x = torch.rand(4, 3, 32, 32).repeat_interleave(8, dim=-1)[..., :32]  # smooth rows: learnable from neighbours
    mask = torch.rand(4, 16, generator=torch.Generator().manual_seed(5)) < 0.5
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(x, bool_masked_pos=mask).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert model.vit.embeddings.mask_token.abs().sum() > 0  # the [mask] embedding learned


def without_hf_vit(script, tmp_path, **env):
    """Run `script` in a fresh process where `import hf_vit` fails (only a folder's own code can load it)."""
    import os
    import subprocess
    import sys
    import textwrap

    prologue = "import sys\nsys.modules['hf_vit'] = None\n"
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", **env}
    code = prologue + textwrap.dedent(script)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def code_closure(names):
    """The package's model files named (without .py) and every file they import relatively, read from their text."""
    import re
    from pathlib import Path

    import hf_vit.model

    here, found, todo = Path(hf_vit.model.__file__).parent, set(), list(names)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += re.findall(r"^\s*from\s+\.(\w+)\s+import", (here / f"{name}.py").read_text(), flags=re.M)
    return {f"{name}.py" for name in found}


def test_a_folder_saved_from_remote_code_holds_every_code_file_its_auto_map_names(tmp_path):
    import json

    torch.manual_seed(0)
    source = tmp_path / "source"
    AutoModelForMaskedImageModeling.from_config(mim_config()).save_pretrained(source)
    VisionTransformerImageProcessor(size={"height": 32, "width": 32}).save_pretrained(source)
    snapshot = tmp_path / "hub" / "models--someone--tiny-vit" / "snapshots" / ("0" * 40)  # the Hub cache's layout
    snapshot.parent.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    import shutil

    shutil.copytree(source, snapshot)
    # in one fresh process without hf_vit (each start imports torch and transformers anew): the model loaded as remote
    # code, by the class whose module imports the fewest of the files, then saved; then every Auto class of the saved
    # folder loads (its code is its own: the folders' modules are named after the folders)
    printed = without_hf_vit(
        f"""
        import json, transformers, torch
        from transformers import AutoImageProcessor, AutoModelForImageClassification
        for where, out in (({str(source)!r}, "from_folder"), ("someone/tiny-vit", "from_hub")):
            model = AutoModelForImageClassification.from_pretrained(where, trust_remote_code=True)
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            model.save_pretrained(out)
            AutoImageProcessor.from_pretrained(where, trust_remote_code=True).save_pretrained(out)
        folder = {str(tmp_path / "from_hub")!r}
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
        for auto_class in [*json.load(open(folder + "/config.json"))["auto_map"], "AutoImageProcessor"]:
            if auto_class == "AutoBackbone":  # its from_pretrained asks the Hub whether a local folder exists
                loaded = transformers.AutoBackbone.from_config(config, trust_remote_code=True)
            else:
                loaded = getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=True)
            assert type(loaded).__module__.startswith("transformers_modules.from_hub"), (auto_class, type(loaded))
            print(auto_class, type(loaded).__name__)
        model = transformers.AutoModelForMaskedImageModeling.from_pretrained(folder, trust_remote_code=True)
        out = model(torch.randn(1, 3, 32, 32), bool_masked_pos=torch.ones(1, 16, dtype=torch.bool))
        assert out.loss > 0 and out.reconstruction.shape == (1, 3, 32, 32)
        """,
        tmp_path,
        HF_HUB_CACHE=str(tmp_path / "hub"),
    )
    auto_map = json.loads((source / "config.json").read_text())["auto_map"]
    named = {reference.partition(".")[0] for reference in auto_map.values()}
    assert {"modeling_mim", "modeling_mpp", "modeling_vit"} <= named
    expected = code_closure(named | {"image_processing_vit"})
    for out in ("from_folder", "from_hub"):
        assert {path.name for path in (tmp_path / out).glob("*.py")} == expected, out  # all of them, nothing else
        assert json.loads((tmp_path / out / "config.json").read_text())["auto_map"] == auto_map
    assert {path.name for path in source.glob("*.py")} == expected
    assert "AutoModelForMaskedImageModeling VisionTransformerForMaskedImageModeling" in printed
    assert "AutoModelForPreTraining VisionTransformerForMaskedPatchPrediction" in printed
