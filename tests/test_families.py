"""The ViTs users pick today, loaded by Hub id and checked against transformers' own classes: DINOv2 (with and
without registers), DeiT with its distillation token, and the vision towers of CLIP and SigLIP. Tiny random models
are written by transformers' classes into an offline Hub cache under the real repository ids; hf-vit converts them on
load and must compute what they compute."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_sources import hub_repo
from transformers import (
    AutoModel,
    BitImageProcessor,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    DeiTConfig,
    DeiTForImageClassificationWithTeacher,
    DeiTImageProcessor,
    Dinov2Config,
    Dinov2Model,
    Dinov2WithRegistersConfig,
    Dinov2WithRegistersModel,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
    SiglipVisionConfig,
    SiglipVisionModel,
)

import hf_vit  # noqa: F401 - registers the Auto classes and the converters
from hf_vit import (
    VisionTransformerConfig,
    VisionTransformerForImageClassification,
    VisionTransformerImageProcessor,
    VisionTransformerModel,
)

TOWER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=64)
DINO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=28, patch_size=14)


def randomise(model):
    """Random values for what transformers initialises to constants (LayerScale, norms, tokens, biases), so that a
    conversion that drops or swaps any of them shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def dinov2():
    torch.manual_seed(0)
    return randomise(Dinov2Model(Dinov2Config(**DINO, layerscale_value=0.5)))


def dinov2_registers():
    torch.manual_seed(0)
    return randomise(Dinov2WithRegistersModel(Dinov2WithRegistersConfig(**DINO, num_register_tokens=4)))


def deit():
    torch.manual_seed(0)
    config = DeiTConfig(**TOWER, image_size=32, patch_size=8, num_labels=3)
    return randomise(DeiTForImageClassificationWithTeacher(config))


def clip(vision_only=False):
    torch.manual_seed(0)
    vision = dict(**TOWER, image_size=32, patch_size=16)
    if vision_only:
        return randomise(CLIPVisionModel(CLIPVisionConfig(**vision)))
    return randomise(CLIPModel(CLIPConfig(vision_config=vision, text_config=TEXT, projection_dim=16)))


def siglip(vision_only=False):
    torch.manual_seed(0)
    vision = dict(**TOWER, image_size=32, patch_size=16)
    if vision_only:
        return randomise(SiglipVisionModel(SiglipVisionConfig(**vision)))
    return randomise(SiglipModel(SiglipConfig(vision_config=vision, text_config=TEXT)))


# repository id -> (the source model, its processor, what transformers' vision encoder of it is)
SOURCES = {
    "facebook/dinov2-small": (dinov2, BitImageProcessor(size={"shortest_edge": 32}, crop_size=28)),
    "facebook/dinov2-with-registers-small": (
        dinov2_registers,
        BitImageProcessor(size={"shortest_edge": 32}, crop_size=28),
    ),
    "facebook/deit-tiny-distilled-patch16-224": (deit, DeiTImageProcessor(size=36, crop_size=32)),
    "openai/clip-vit-base-patch32": (clip, CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32)),
    "openai/clip-vision-only": (lambda: clip(True), CLIPImageProcessor(size=32, crop_size=32)),
    "google/siglip-base-patch16-224": (siglip, SiglipImageProcessor(size={"height": 32, "width": 32})),
    "google/siglip-vision-only": (lambda: siglip(True), SiglipImageProcessor(size={"height": 32, "width": 32})),
}


def vision_encoder(model):
    """What of a source model computes the image features hf-vit's model computes."""
    return getattr(model, "vision_model", None) or getattr(model, "deit", None) or model


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache in the Hub's layout, offline (as tests/test_sources.py's)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert huggingface_hub.constants.HF_HUB_OFFLINE  # conftest: the Hub is never reached
    return cache


@pytest.fixture
def hub(hub_cache):
    """Write each source into the offline Hub cache as its repository id; returns id -> source model."""
    written = {}
    for repo_id, (build, processor) in SOURCES.items():
        model = build()
        folder = hub_repo(hub_cache, repo_id)
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        written[repo_id] = model
    return written


def pixels(height, width, batch=2):
    torch.manual_seed(2)
    return torch.randn(batch, 3, height, width)


@pytest.mark.parametrize(
    "repo_id, other_size",
    [
        ("facebook/dinov2-small", (28, 42)),  # DINOv2 at a non-square size
        ("facebook/dinov2-with-registers-small", (42, 28)),
        ("facebook/deit-tiny-distilled-patch16-224", (48, 40)),
        ("openai/clip-vit-base-patch32", (48, 64)),
        ("openai/clip-vision-only", None),
        ("google/siglip-base-patch16-224", (64, 48)),
        ("google/siglip-vision-only", None),
    ],
)
def test_each_source_computes_what_transformers_computes(hub, repo_id, other_size):
    source = vision_encoder(hub[repo_id])
    model = VisionTransformerModel.from_pretrained(repo_id)
    assert model.config.model_type == "hf_vit"
    native = source.config.image_size
    sizes = [((native, native), False)] + ([(other_size, True)] if other_size else [])
    for (height, width), interpolate in sizes:
        images = pixels(height, width)
        with torch.no_grad():
            ours = model(images, interpolate_pos_encoding=interpolate)
            kwargs = {"interpolate_pos_encoding": True} if interpolate and "dinov2" not in repo_id else {}
            theirs = source(images, **kwargs)
        torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
        if "deit" not in repo_id:  # DeiT's pooler is the pre-logits layer, checked through the classifier
            torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=1e-5, rtol=1e-5)


def test_deits_two_heads_average_as_transformers_does(hub):
    repo_id = "facebook/deit-tiny-distilled-patch16-224"
    model = VisionTransformerForImageClassification.from_pretrained(repo_id)
    assert model.config.use_distillation_token and model.config.num_prefix_tokens == 2
    images = pixels(32, 32)
    with torch.no_grad():
        theirs = hub[repo_id](images)
        torch.testing.assert_close(model(images).logits, theirs.logits, atol=1e-5, rtol=1e-5)
        # the loss trains both heads against the labels: the average of the two heads' cross-entropies
        labels = torch.tensor([0, 2])
        loss = model(images, labels=labels).loss
    expected = (
        torch.nn.functional.cross_entropy(theirs.cls_logits, labels)
        + torch.nn.functional.cross_entropy(theirs.distillation_logits, labels)
    ) / 2
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_each_source_brings_its_preprocessing(hub):
    for repo_id, (_, theirs) in SOURCES.items():
        ours = VisionTransformerImageProcessor.from_pretrained(repo_id)
        assert ours.image_mean == pytest.approx(list(theirs.image_mean)), repo_id
        assert ours.image_std == pytest.approx(list(theirs.image_std)), repo_id
        assert int(ours.resample) == int(theirs.resample), repo_id
        assert ours.do_center_crop == bool(theirs.do_center_crop), repo_id
        if theirs.do_center_crop:
            assert ours.crop_size == dict(theirs.crop_size), repo_id
        # a square image comes out as transformers' processor makes it (a shorter-side resize is a square resize)
        image = (torch.rand(3, 40, 40) * 255).to(torch.uint8).permute(1, 2, 0).numpy()
        expected = torch.as_tensor(theirs(image, return_tensors="np")["pixel_values"])
        got = ours(image, return_tensors="pt").pixel_values
        assert got.shape == expected.shape, repo_id
        assert (got - expected).abs().mean() < 0.05, repo_id  # resize filters' implementations differ slightly


def test_blocks_hf_vit_lacks_are_refused_by_name(hub_cache):
    torch.manual_seed(0)
    swiglu = Dinov2Model(Dinov2Config(**DINO, use_swiglu_ffn=True))
    swiglu.save_pretrained(hub_repo(hub_cache, "facebook/dinov2-giant"))
    with pytest.raises(ValueError, match="use_swiglu_ffn=True"):
        VisionTransformerModel.from_pretrained("facebook/dinov2-giant")
    text_only = hub_repo(hub_cache, "openai/clip-text-only")
    clip().text_model.save_pretrained(text_only)
    with pytest.raises(ValueError, match="CLIP's text tower alone"):
        VisionTransformerModel.from_pretrained("openai/clip-text-only")


def test_the_converted_config_round_trips_and_names_the_blocks(hub, tmp_path):
    config = VisionTransformerConfig.from_pretrained("facebook/dinov2-with-registers-small")
    assert (config.num_register_tokens, config.layer_scale_init_value, config.interpolation_antialias) == (
        4,
        1.0,
        True,
    )
    clip_config = VisionTransformerConfig.from_pretrained("openai/clip-vit-base-patch32")
    assert (clip_config.pre_norm, clip_config.fc_norm, clip_config.hidden_act) == (True, True, "quick_gelu")
    assert not clip_config.patch_embedding_bias and clip_config.layer_norm_eps == 1e-5
    siglip_config = VisionTransformerConfig.from_pretrained("google/siglip-base-patch16-224")
    assert (siglip_config.classifier, siglip_config.use_class_token) == ("map", False)
    for each in (config, clip_config, siglip_config):
        each.save_pretrained(tmp_path / each.classifier / str(each.num_register_tokens))
        again = VisionTransformerConfig.from_pretrained(tmp_path / each.classifier / str(each.num_register_tokens))
        assert again.to_dict() == each.to_dict()


def test_converted_models_save_hf_vit_folders_that_load_as_remote_code(hub, tmp_path):
    """`save_pretrained` of converted DINOv2-with-registers and SigLIP writes hf-vit folders with their code
    (LayerScale, attention pooling); a fresh process where hf_vit cannot be imported loads them and computes the
    source's features."""
    images = pixels(32, 32)
    expected = {}
    for name, repo_id in (
        ("dinov2", "facebook/dinov2-with-registers-small"),
        ("siglip", "google/siglip-base-patch16-224"),
    ):
        # AutoModel picks transformers' class for the repository's model type; given hf-vit's config, hf-vit's
        model = AutoModel.from_pretrained(repo_id, config=VisionTransformerConfig.from_pretrained(repo_id))
        assert isinstance(model, VisionTransformerModel)
        model.save_pretrained(tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["model_type"] == "hf_vit"
        assert {"pooling.py", "layer_scale.py"} <= {path.name for path in (tmp_path / name).iterdir()}
        size = model.config.image_hw
        with torch.no_grad():
            theirs = vision_encoder(hub[repo_id])(images[..., : size[0], : size[1]])
        expected[name] = (theirs.last_hidden_state, theirs.pooler_output)
    torch.save(images, tmp_path / "images.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_vit"] = None  # hf_vit cannot be imported in this process
        import torch
        from transformers import AutoModel
        images, out = torch.load({str(tmp_path / "images.pt")!r}), {{}}
        for name in ("dinov2", "siglip"):
            model = AutoModel.from_pretrained({str(tmp_path)!r} + "/" + name, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            height, width = model.config.image_hw
            with torch.no_grad():
                result = model(images[..., :height, :width])
            out[name] = (result.last_hidden_state, result.pooler_output)
        torch.save(out, {str(tmp_path / "out.pt")!r})
        """
    )
    home = tmp_path / "hf_home"
    home.mkdir()
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=home, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name, (hidden, pooled) in torch.load(tmp_path / "out.pt").items():
        torch.testing.assert_close(hidden, expected[name][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pooled, expected[name][1], atol=1e-5, rtol=1e-5)
