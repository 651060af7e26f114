"""Masked patch prediction (section 4.6): the corruption's proportions and effect, the mean-colour targets against a
loop over the pixels, the loss over corrupted patches only, the data pipeline's pixels equal to the supervised one's,
a short Trainer run, and checkpoints loading into the classifier for fine-tuning."""

import json

import numpy as np
import pytest
import torch
from conftest import tiny_config
from torch.nn import functional as F
from transformers import Trainer, TrainingArguments

from hf_vit import VisionTransformerForImageClassification, VisionTransformerImageProcessor
from hf_vit.data.datasets import load_digits_dataset
from hf_vit.data.transforms import Augmentation, make_eval_transform
from hf_vit.model.modeling_mpp import (
    PATCH_CLEAN,
    PATCH_KEPT,
    PATCH_MASKED,
    PATCH_RANDOM,
    PatchCorruption,
    VisionTransformerForMaskedPatchPrediction,
    draw_patch_corruption,
    draw_patch_sources,
)
from hf_vit.tasks.mpp import (
    MaskedPatchPredictionTransform,
    mean_color_classes,
    mpp_collate_fn,
    mpp_compute_metrics,
    mpp_preprocess_logits,
)
from hf_vit.tasks.training_transforms import with_mpp_transforms


def mpp_config(**overrides):
    return tiny_config(image_size=16, patch_size=4, **overrides)


def test_corruption_draws_the_papers_proportions_or_a_runs_own():
    codes = draw_patch_corruption(4000, 16, generator=torch.Generator().manual_seed(0))
    assert ((codes != PATCH_CLEAN).sum(1) == 8).all()  # 50% of every image's patches
    corrupted = codes[codes != PATCH_CLEAN]
    shares = [(corrupted == code).float().mean().item() for code in (PATCH_MASKED, PATCH_RANDOM, PATCH_KEPT)]
    np.testing.assert_allclose(shares, [0.8, 0.1, 0.1], atol=0.01)
    assert (draw_patch_corruption(3, 49) != PATCH_CLEAN).sum(1).tolist() == [25] * 3  # rounded half up
    own = PatchCorruption(corrupt_ratio=0.25, mask_ratio=0.5, random_ratio=0.5)
    codes = draw_patch_corruption(4000, 16, own, generator=torch.Generator().manual_seed(0))
    assert ((codes != PATCH_CLEAN).sum(1) == 4).all() and not (codes == PATCH_KEPT).any()
    np.testing.assert_allclose((codes[codes != PATCH_CLEAN] == PATCH_MASKED).float().mean().item(), 0.5, atol=0.02)


@pytest.mark.parametrize(
    "fields, named",
    [({"corrupt_ratio": 1.5}, "corrupt_ratio"), ({"mask_ratio": "0.8"}, "mask_ratio"),
     ({"mask_ratio": 0.8, "random_ratio": 0.3}, "`mask_ratio` \\+ `random_ratio`")],
)  # fmt: skip
def test_corruption_shares_are_checked_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        PatchCorruption(**fields)


def test_corrupted_embeddings():
    torch.manual_seed(0)
    model = VisionTransformerForMaskedPatchPrediction(tiny_config(image_size=12, patch_size=4))
    embeddings = model.vit.embeddings.eval()
    tokens = torch.arange(2 * 9 * 32, dtype=torch.float32).reshape(2, 9, 32)
    codes = torch.tensor([[0, 1, 2, 3, 2, 0, 0, 0, 1], [2, 2, 2, 1, 0, 3, 0, 0, 0]])
    sources = draw_patch_sources(codes)
    assert (sources[codes != PATCH_RANDOM] == -1).all()
    out = embeddings.corrupt(tokens, codes == PATCH_MASKED, sources)
    keep = (codes == PATCH_CLEAN) | (codes == PATCH_KEPT)
    assert torch.equal(out[keep], tokens[keep])
    assert torch.equal(out[codes == PATCH_MASKED], embeddings.mask_token[0].expand(3, -1))
    flat = tokens.reshape(-1, 32)
    for b, n in zip(*torch.nonzero(codes == PATCH_RANDOM, as_tuple=True)):
        source = [i for i in range(18) if torch.equal(flat[i], out[b, n])]
        assert source == [sources[b, n]] and source[0] != b * 9 + n  # another patch of the batch, never itself
    # in equation (1): a masked patch is the [mask] embedding at that patch's position
    pixels = torch.randn(2, 3, 12, 12)
    masked = codes == PATCH_MASKED
    z0 = embeddings(pixels, bool_masked_pos=masked)
    positions = embeddings.position_embedding[0, 1:].expand(2, -1, -1)
    torch.testing.assert_close(z0[:, 1:][masked], (embeddings.mask_token[0] + positions)[masked])
    assert torch.equal(z0[:, 1:][~masked], embeddings(pixels)[:, 1:][~masked])
    with pytest.raises(ValueError, match=r"`bool_masked_pos` has shape \(2, 4\) but the images have 9 patches"):
        embeddings(pixels, bool_masked_pos=masked[:, :4])


def test_mean_colour_classes_against_a_loop():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (2, 3, 8, 12)).astype(np.float64) / 255
    pixels[0, :, :4, :4] = 0.5  # a mean exactly on a bin edge goes up: 0.5 * 8 = 4
    classes = mean_color_classes(torch.from_numpy(pixels), 4, bits=3)
    assert classes.shape == (2, 6)
    for b in range(2):
        for n in range(6):
            row, col = divmod(n, 3)
            means = pixels[b, :, row * 4 : row * 4 + 4, col * 4 : col * 4 + 4].mean(axis=(1, 2))
            bins = np.minimum(np.floor(means * 8 + 1e-9), 7).astype(int)
            assert classes[b, n] == bins[0] * 64 + bins[1] * 8 + bins[2]
    assert classes[0, 0] == 4 * 64 + 4 * 8 + 4
    assert mean_color_classes(torch.ones(1, 3, 4, 4), 4).item() == 511


def test_loss_is_over_corrupted_patches_and_eval_corrupts_only_when_asked():
    torch.manual_seed(0)
    model = VisionTransformerForMaskedPatchPrediction(mpp_config()).eval()
    assert model.config.mpp_num_classes == 512 and model.mpp_head.out_features == 512
    x = torch.randn(3, 3, 16, 16)
    labels = torch.randint(0, 512, (3, 16))
    clean = model(x, labels=labels)
    assert clean.patch_corruption is None
    torch.testing.assert_close(model(x).logits, clean.logits)  # nothing random without a corruption in eval
    codes = draw_patch_corruption(3, 16, generator=torch.Generator().manual_seed(1))
    out = model(x, labels=labels, patch_corruption=codes)
    chosen = codes != PATCH_CLEAN
    expected = torch.nn.functional.cross_entropy(out.logits[chosen], labels[chosen])
    torch.testing.assert_close(out.loss, expected)
    assert not torch.allclose(out.logits, clean.logits)
    model.train()
    drawn = model(x, labels=labels)  # training without codes: the model draws them
    assert ((drawn.patch_corruption != PATCH_CLEAN).sum(1) == 8).all()
    drawn.loss.backward()
    assert model.vit.embeddings.mask_token.grad.abs().sum() > 0


def test_bool_masked_pos_as_transformers_takes_it():
    # transformers' ViTForMaskedImageModeling's argument: the [mask] patches, the only ones predicted
    torch.manual_seed(0)
    model = VisionTransformerForMaskedPatchPrediction(mpp_config()).eval()
    x, labels = torch.randn(2, 3, 16, 16), torch.randint(0, 512, (2, 16))
    bool_masked_pos = torch.rand(2, 16) < 0.5
    codes = torch.where(bool_masked_pos, PATCH_MASKED, PATCH_CLEAN)
    out = model(x, labels=labels, bool_masked_pos=bool_masked_pos)
    same = model(x, labels=labels, patch_corruption=codes)
    assert torch.equal(out.logits, same.logits) and torch.equal(out.loss, same.loss)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[bool_masked_pos], labels[bool_masked_pos]))
    with pytest.raises(ValueError, match="`bool_masked_pos` has shape"):
        model(x, bool_masked_pos=bool_masked_pos[:, :9])
    with pytest.raises(ValueError, match="not both"):
        model(x, bool_masked_pos=bool_masked_pos, patch_corruption=codes)
    with pytest.raises(ValueError, match=r"no \[mask\] embedding"):  # a plain encoder has none
        VisionTransformerForImageClassification(mpp_config()).vit(x, bool_masked_pos=bool_masked_pos)


def test_configs_saved_with_the_corruption_shares_still_load(tmp_path):
    # before the shares became the run's, config.json held them
    torch.manual_seed(0)
    model = VisionTransformerForMaskedPatchPrediction(mpp_config())
    model.save_pretrained(tmp_path / "old")
    path = tmp_path / "old" / "config.json"
    saved = json.loads(path.read_text())
    saved.update(mpp_corrupt_ratio=0.4, mpp_mask_ratio=0.9, mpp_random_ratio=0.05)
    path.write_text(json.dumps(saved))
    loaded = VisionTransformerForMaskedPatchPrediction.from_pretrained(tmp_path / "old")
    assert not hasattr(loaded.config, "mpp_mask_ratio") and loaded.config.mpp_num_classes == 512
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    loaded.save_pretrained(tmp_path / "new")
    assert "mpp_mask_ratio" not in (tmp_path / "new" / "config.json").read_text()


def test_pipeline_pixels_are_the_supervised_ones_and_labels_follow_the_corruption():
    digits = load_digits_dataset()["test"].select(range(6))
    processor = VisionTransformerImageProcessor(size={"height": 16, "width": 16})
    config = mpp_config()
    batch = {"image": list(digits["image"]), "label": list(digits["label"])}
    supervised = make_eval_transform(processor)(batch)
    unnormalized = make_eval_transform(processor.with_options(do_rescale=False, do_normalize=False))
    mpp = MaskedPatchPredictionTransform(unnormalized, processor, config)(batch)
    assert torch.equal(mpp["pixel_values"], supervised["pixel_values"])
    raw = unnormalized(batch)["pixel_values"] / 255
    targets = mean_color_classes(raw, 4)
    corrupted = mpp["patch_corruption"] != PATCH_CLEAN
    assert torch.equal(mpp["labels"][corrupted], targets[corrupted]) and (mpp["labels"][~corrupted] == -100).all()
    # Grey digits: all three channels fall in the same bin.
    assert all(int(c) // 64 == (int(c) // 8) % 8 == int(c) % 8 for c in targets.flatten())


def test_trainer_run_and_fine_tuning_from_its_checkpoint(tmp_path):
    torch.manual_seed(0)
    config = mpp_config(num_hidden_layers=1)
    model = VisionTransformerForMaskedPatchPrediction(config)
    processor = VisionTransformerImageProcessor(size={"height": 16, "width": 16})
    raw = load_digits_dataset()
    raw["train"], raw["validation"] = raw["train"].select(range(64)), raw["validation"].select(range(32))
    ds = with_mpp_transforms(raw, Augmentation(crop_scale_min=0.7, hflip=False), processor, config)
    args = TrainingArguments(
        output_dir=str(tmp_path / "mpp"), max_steps=6, per_device_train_batch_size=16, learning_rate=1e-3,
        remove_unused_columns=False, report_to="none", use_cpu=True, logging_steps=2, save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=ds["train"], eval_dataset=ds["validation"],
        data_collator=mpp_collate_fn, compute_metrics=mpp_compute_metrics,
        preprocess_logits_for_metrics=mpp_preprocess_logits,
    )  # fmt: skip
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] < before and 0 <= metrics["eval_mpp_accuracy"] <= 1
    assert any("loss" in entry for entry in trainer.state.log_history)
    trainer.save_model(tmp_path / "mpp")
    classifier = VisionTransformerForImageClassification.from_pretrained(tmp_path / "mpp", num_labels=10)
    for key, value in model.vit.state_dict().items():
        if key != "embeddings.mask_token":
            assert torch.equal(classifier.vit.state_dict()[key], value.cpu())
    assert "mask_token" not in dict(classifier.named_parameters())
    # and back: a classification checkpoint starts masked patch prediction with a new head and [mask] embedding
    classifier.save_pretrained(tmp_path / "cls")
    again = VisionTransformerForMaskedPatchPrediction.from_pretrained(tmp_path / "cls")
    assert again.vit.embeddings.mask_token is not None


def test_pretrain_script_with_the_mpp_objective_then_finetune(tmp_path):
    from test_training import QUIET, TINY

    from hf_vit import VisionTransformerForImageClassification, VisionTransformerForMaskedPatchPrediction
    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    pre = ["--output_dir", str(tmp_path / "mpp"), "--objective", "mpp", "--image_size", "8", "--patch_size", "4"]
    pre += ["--config_overrides", TINY, "--max_steps", "3", "--per_device_train_batch_size", "16"]
    pre += ["--eval_strategy", "no", "--save_strategy", "no", "--max_train_samples", "48", *QUIET]
    metrics = train("pretrain", *parse_args("pretrain", pre))
    assert "eval_mpp_accuracy" in metrics and 0.0 <= metrics["eval_mpp_accuracy"] <= 1.0
    assert isinstance(
        VisionTransformerForMaskedPatchPrediction.from_pretrained(tmp_path / "mpp"),
        VisionTransformerForMaskedPatchPrediction,
    )
    fine = ["--output_dir", str(tmp_path / "fine"), "--model_name_or_path", str(tmp_path / "mpp"), "--image_size", "8"]
    fine += ["--max_steps", "2", "--eval_strategy", "no", "--save_strategy", "no", "--max_train_samples", "32", *QUIET]
    train("finetune", *parse_args("finetune", fine))
    assert VisionTransformerForImageClassification.from_pretrained(tmp_path / "fine").config.num_labels == 10
    with pytest.raises(ValueError, match="pretraining objective"):
        train("finetune", *parse_args("finetune", fine + ["--objective", "mpp", "--overwrite_output_dir", "True"]))


def test_a_masked_patch_prediction_checkpoint_loads_as_remote_code_without_hf_vit(tmp_path):
    import os
    import subprocess
    import sys
    import textwrap

    torch.manual_seed(0)
    model = VisionTransformerForMaskedPatchPrediction(mpp_config()).eval()
    model.save_pretrained(tmp_path / "mpp")
    assert {"modeling_mpp.py", "modeling_vit.py", "configuration_vit.py"} <= {
        p.name for p in (tmp_path / "mpp").iterdir()
    }
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.save(x, tmp_path / "x.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_vit"] = None  # hf_vit cannot be imported in this process
        import torch
        from transformers import AutoModelForPreTraining
        model = AutoModelForPreTraining.from_pretrained({str(tmp_path / "mpp")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        torch.save(model(torch.load({str(tmp_path / "x.pt")!r})).logits, {str(tmp_path / "logits.pt")!r})
        """
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), model(x).logits)


def test_a_model_built_with_a_mask_token_loads_a_checkpoint_without_one(tmp_path):
    """transformers' test_eager_matches_sdpa_inference pattern: save a model, load it with use_mask_token=True."""
    from hf_vit import VisionTransformerModel

    torch.manual_seed(0)
    model = VisionTransformerModel(mpp_config()).eval()
    model.save_pretrained(tmp_path)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    outputs = []
    for implementation in ("eager", "sdpa"):
        loaded = VisionTransformerModel.from_pretrained(
            tmp_path, use_mask_token=True, attn_implementation=implementation
        ).eval()
        assert loaded.embeddings.mask_token is not None and loaded.embeddings.mask_token.abs().sum() > 0  # new
        with torch.no_grad():
            outputs.append(loaded(x).last_hidden_state)
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], model(x).last_hidden_state)
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


def test_pixels_are_checked_once_per_forward(monkeypatch):
    import hf_vit.model.modeling_vit as modeling

    calls = []
    check = modeling.check_pixel_values
    monkeypatch.setattr(modeling, "check_pixel_values", lambda *args: calls.append(1) or check(*args))
    model = VisionTransformerForMaskedPatchPrediction(mpp_config()).train()
    model(torch.randn(2, 3, 16, 16))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        model(torch.randn(2, 3, 18, 16))
