"""The ViTs users pick today, loaded by Hub id and checked against transformers' own classes: DINOv2 (with and
without registers), DeiT with its distillation token, and the vision towers of CLIP and SigLIP. Tiny random models
are written by transformers' classes into an offline Hub cache under the real repository ids; hf-vit converts them on
load and must compute what they compute."""

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import PIL.Image
import pytest
import torch
from safetensors.torch import save_file
from sklearn.datasets import load_sample_images
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
    "openai/clip-vision-only": (lambda: clip(True), CLIPImageProcessor(size=36, crop_size=32)),
    "google/siglip-base-patch16-224": (siglip, SiglipImageProcessor(size={"height": 32, "width": 32})),
    "google/siglip-vision-only": (lambda: siglip(True), SiglipImageProcessor(size={"height": 32, "width": 32})),
}


# `"size": 36` means the shorter side for CLIP's processor, a 36x36 square for DeiT's
LEGACY_SIZES = {"openai/clip-vision-only": 36, "facebook/deit-tiny-distilled-patch16-224": 36}


def vision_encoder(model):
    """What of a source model computes the image features hf-vit's model computes."""
    return getattr(model, "vision_model", None) or getattr(model, "deit", None) or model


@contextlib.contextmanager
def offline_cache(folder):
    """An empty Hub cache in the Hub's layout at `folder`, offline (as tests/test_sources.py's)."""
    import huggingface_hub.constants

    folder.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(folder))
        patch.setenv("HF_HUB_CACHE", str(folder))
        assert huggingface_hub.constants.HF_HUB_OFFLINE  # conftest: the Hub is never reached
        yield folder


@pytest.fixture
def hub_cache(tmp_path):
    with offline_cache(tmp_path / "hub") as cache:
        yield cache


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Each source written into an offline Hub cache under its repository id, once; returns id -> source model."""
    with offline_cache(tmp_path_factory.mktemp("families") / "hub") as cache:
        written = {}
        for repo_id, (build, processor) in SOURCES.items():
            model = build()
            folder = hub_repo(cache, repo_id)
            model.save_pretrained(folder)
            processor.save_pretrained(folder)
            if repo_id in LEGACY_SIZES:  # one number, as the Hub's CLIP and DeiT files still say it
                settings = json.loads((folder / "preprocessor_config.json").read_text())
                settings.update(size=LEGACY_SIZES[repo_id], crop_size=32)
                (folder / "preprocessor_config.json").write_text(json.dumps(settings))
            written[repo_id] = model
        write_timm_reg4(cache)
        write_timm_gap(cache)
        yield written


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


def photos():
    """Non-square real photos: scikit-learn's two samples (427x640, wide), a tall crop and a small one (50x70)."""
    china, flower = load_sample_images().images
    return [china, flower[:400, 100:330].copy(), china[60:110, 200:270].copy()]


def levels(difference, processor):
    """A difference of normalised pixels in 8-bit levels (1 = one step of a uint8 channel)."""
    std = torch.as_tensor(processor.image_std, dtype=torch.float32).view(1, -1, 1, 1)
    return difference.abs() * std / processor.rescale_factor


def test_each_source_brings_its_preprocessing_and_the_whole_chain_computes_the_sources(hub):
    """hf-vit's processor, as the converter builds it from each source's `preprocessor_config.json`, makes the
    pixel_values transformers' own processor (read from the same file) makes of non-square photos: DINOv2's and
    CLIP's shorter-side resize then centre crop (CLIP's and DeiT's also from a file saying the size as one number),
    DeiT's square resize then crop, SigLIP's square resize. Both resize with PIL's antialiased filters, PIL in C and
    hf-vit with torch's port of them; they round the intermediate 8-bit pass apart (PIL filters either axis first,
    torch the horizontal one), which moves a pixel by at most one 8-bit level here (measured: 1; larger squeezed
    images reach 7, the bound test_image_processing.py sets for bicubic). The whole chain, processor then model,
    gives the source's features up to what that difference makes (measured under 7e-3, features of size ~1)."""
    for repo_id, (_, saved) in SOURCES.items():
        theirs = type(saved).from_pretrained(repo_id)  # transformers' own, from the same file
        ours = VisionTransformerImageProcessor.from_pretrained(repo_id)
        if repo_id in LEGACY_SIZES:
            assert json.loads(ours.to_json_string())["size"] == dict(theirs.size), repo_id
        assert (ours.size, ours.do_center_crop, int(ours.resample)) == (
            dict(theirs.size),
            bool(theirs.do_center_crop),
            int(theirs.resample),
        ), repo_id
        assert ours.image_mean == pytest.approx(list(theirs.image_mean)), repo_id
        assert ours.image_std == pytest.approx(list(theirs.image_std)), repo_id
        model = VisionTransformerModel.from_pretrained(repo_id)
        source = vision_encoder(hub[repo_id])
        for photo in photos():
            expected = theirs(photo, return_tensors="pt").pixel_values
            got = ours(photo, return_tensors="pt").pixel_values
            assert got.shape == expected.shape == (1, 3, *model.config.image_hw), repo_id
            difference = levels(got - expected, theirs)
            assert difference.max() <= 1.01 and difference.mean() < 0.02, (repo_id, photo.shape)
            with torch.no_grad():
                chain = model(got).last_hidden_state
                their_chain = source(expected).last_hidden_state
                # the model alone: on the same pixels, the source's features
                torch.testing.assert_close(chain, source(got).last_hidden_state, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(chain, their_chain, atol=1e-2, rtol=0), repo_id


@pytest.mark.parametrize(
    "repo_id, resize, crop",
    [
        # DINOv2: shorter side 32, crop 28 -> at 56: shorter side 64, crop 56 (the ratio 32/28 kept)
        ("facebook/dinov2-small", {"shortest_edge": 64}, 56),
        # DeiT: 36x36 then a 32 crop -> at 56: 63x63 then 56
        ("facebook/deit-tiny-distilled-patch16-224", {"height": 63, "width": 63}, 56),
        # SigLIP: a square resize, no crop -> 64x64 (its patches are 16 pixels)
        ("google/siglip-base-patch16-224", {"height": 64, "width": 64}, None),
    ],
)
def test_a_run_at_another_image_size_keeps_the_sources_geometry(hub, repo_id, resize, crop):
    """`--image_size 56` from a source: the run's processor makes 56x56 images with the source's geometry (the crop
    is the model's size and the resize keeps its ratio to the crop; a square resize becomes the size). The evaluation
    transform is that processor, equal to transformers' own processor with those settings (within the 8-bit levels
    the resize filters differ by, see above); the training transform resizes its random crops to 56x56, and without
    them it is the evaluation transform exactly."""
    from hf_vit.data.augment.train_transform import make_train_transform
    from hf_vit.data.transforms import make_eval_transform
    from hf_vit.tasks.model_setup import processor_for

    side = crop or resize["height"]
    config = VisionTransformerConfig.from_pretrained(repo_id, image_size=side)
    processor = processor_for(repo_id, config)
    assert (processor.size, processor.do_center_crop) == (resize, crop is not None)
    if crop:
        assert processor.crop_size == {"height": crop, "width": crop}
    _, saved = SOURCES[repo_id]
    settings = dict(size=resize, **({"crop_size": {"height": crop, "width": crop}} if crop else {}))
    theirs = type(saved).from_pretrained(repo_id, **settings)
    batch = {"image": [PIL.Image.fromarray(photo) for photo in photos()], "label": [0, 1, 2]}
    evaluated = make_eval_transform(processor)(batch)
    assert evaluated["pixel_values"].shape == (3, 3, side, side) and evaluated["labels"].tolist() == [0, 1, 2]
    for image, got in zip(batch["image"], evaluated["pixel_values"]):
        expected = theirs(image, return_tensors="pt").pixel_values
        difference = levels(got[None] - expected, theirs)
        # a squeezing resize filters the axes in another order than PIL may: measured up to 3 levels, 0.14 on
        # average (DeiT's 63x63); 8 and a quarter are the bounds
        assert difference.max() <= 8.01 and difference.mean() < 0.25, (repo_id, difference.max(), difference.mean())
    trained = make_train_transform(processor, seed=0)(batch)["pixel_values"]
    assert trained.shape == (3, 3, side, side)
    plain = make_train_transform(processor, random_resized_crop=False, hflip=False)(batch)["pixel_values"]
    assert torch.equal(plain, evaluated["pixel_values"])


def test_the_readmes_calls_give_the_classes_it_says(hub, tmp_path):
    """The README's sources table: by Hub id, transformers' `AutoModel` and `AutoImageProcessor` give transformers'
    own classes (transformers owns these model types); hf-vit's classes, or `AutoModel` given hf-vit's config, give
    hf-vit's; after `save_pretrained`, the Auto classes give hf-vit's from the folder (with `trust_remote_code` where
    hf_vit is not installed: the test above)."""
    from transformers import AutoImageProcessor

    for repo_id in ("facebook/dinov2-small", "facebook/deit-tiny-distilled-patch16-224", "openai/clip-vision-only"):
        source = vision_encoder(hub[repo_id])
        assert type(AutoModel.from_pretrained(repo_id)) is type(source), repo_id
        assert type(AutoImageProcessor.from_pretrained(repo_id)).__module__.startswith("transformers.models")
        ours = VisionTransformerModel.from_pretrained(repo_id)
        given = AutoModel.from_pretrained(repo_id, config=VisionTransformerConfig.from_pretrained(repo_id))
        assert isinstance(ours, VisionTransformerModel) and isinstance(given, VisionTransformerModel), repo_id
        folder = tmp_path / repo_id.split("/")[1]
        ours.save_pretrained(folder)
        VisionTransformerImageProcessor.from_pretrained(repo_id).save_pretrained(folder)
        again = AutoModel.from_pretrained(folder)
        processor = AutoImageProcessor.from_pretrained(folder)
        assert isinstance(again, VisionTransformerModel), repo_id
        assert isinstance(processor, VisionTransformerImageProcessor), repo_id
        images = processor(photos()[1], return_tensors="pt").pixel_values
        with torch.no_grad():
            torch.testing.assert_close(
                again(images).last_hidden_state, source(images).last_hidden_state, atol=1e-5, rtol=1e-5
            )


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
    (LayerScale, attention pooling, the processor and its geometry); a fresh process where hf_vit cannot be imported
    loads them and computes the source's features, and the processor (DINOv2's shorter-side resize and crop) the
    pixel_values hf-vit's does."""
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
        VisionTransformerImageProcessor.from_pretrained(repo_id).save_pretrained(tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["model_type"] == "hf_vit"
        code = {path.name for path in (tmp_path / name).iterdir()}
        assert {"pooling.py", "layer_scale.py", "image_processing_vit.py", "image_geometry.py"} <= code
        size = model.config.image_hw
        with torch.no_grad():
            theirs = vision_encoder(hub[repo_id])(images[..., : size[0], : size[1]])
        expected[name] = (theirs.last_hidden_state, theirs.pooler_output)
    photo = photos()[1]  # 400x230: DINOv2's processor resizes its shorter side, then crops
    processed = {
        name: VisionTransformerImageProcessor.from_pretrained(tmp_path / name)(photo, return_tensors="pt")
        for name in expected
    }
    torch.save((images, photo), tmp_path / "images.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_vit"] = None  # hf_vit cannot be imported in this process
        import torch
        from transformers import AutoImageProcessor, AutoModel
        (images, photo), out = torch.load({str(tmp_path / "images.pt")!r}, weights_only=False), {{}}
        for name in ("dinov2", "siglip"):
            model = AutoModel.from_pretrained({str(tmp_path)!r} + "/" + name, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            processor = AutoImageProcessor.from_pretrained({str(tmp_path)!r} + "/" + name, trust_remote_code=True)
            assert type(processor).__module__.startswith("transformers_modules"), type(processor).__module__
            height, width = model.config.image_hw
            with torch.no_grad():
                result = model(images[..., :height, :width])
            out[name] = (result.last_hidden_state, result.pooler_output, processor(photo, return_tensors="pt"))
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
    for name, (hidden, pooled, pixel_values) in torch.load(tmp_path / "out.pt", weights_only=False).items():
        torch.testing.assert_close(hidden, expected[name][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pooled, expected[name][1], atol=1e-5, rtol=1e-5)
        assert torch.equal(pixel_values["pixel_values"], processed[name]["pixel_values"]), name


def timm_folder(folder, state_dict, heads, global_pool, **model_args):
    """A timm repository as on the Hub: weights under timm's names and timm's config.json."""
    save_file({key: value.contiguous() for key, value in state_dict.items()}, folder / "model.safetensors")
    config = {
        "architecture": "vit_small_patch14_reg4_dinov2",
        "num_classes": 0,
        "global_pool": global_pool,
        "model_args": {"num_heads": heads, **model_args},
        "pretrained_cfg": {"interpolation": "bicubic", "mean": [0.5] * 3, "std": [0.5] * 3},
    }
    (folder / "config.json").write_text(json.dumps(config))


def timm_blocks(layers, names) -> dict:
    """timm's block arrays from transformers' layers; `names` says where each part lives in them."""
    out = {}
    for i, layer in enumerate(layers):
        get = {part: layer.get_submodule(path) for part, path in names.items() if part != "qkv"}
        attn = get["attention"]
        for p in ("weight", "bias"):
            out[f"blocks.{i}.attn.qkv.{p}"] = torch.cat([getattr(getattr(attn, x), p) for x in names["qkv"]])
            for ours, theirs in (("norm1", "norm1"), ("norm2", "norm2"), ("attn.proj", "proj")):
                out[f"blocks.{i}.{ours}.{p}"] = getattr(get[theirs], p)
            out[f"blocks.{i}.mlp.fc1.{p}"] = getattr(get["fc1"], p)
            out[f"blocks.{i}.mlp.fc2.{p}"] = getattr(get["fc2"], p)
    return {key: value.detach().clone() for key, value in out.items()}


# where timm's block parts are in transformers' DINOv2 layer (its in-memory names)
DINOV2_PARTS = dict(attention="attention", norm1="norm1", norm2="norm2", proj="attention.o_proj", fc1="mlp.fc1",
                    fc2="mlp.fc2", qkv=("q_proj", "k_proj", "v_proj"))  # fmt: skip


TIMM_REG4 = "timm/vit_small_patch14_reg4_dinov2.lvd142m"
TIMM_GAP = "timm/vit_base_patch16_reg4_gap_256.test"


def write_timm_reg4(cache):
    """timm's `vit_*_reg4_dinov2` under `TIMM_REG4`, written from transformers' DINOv2 with registers whose class
    position is zero; returns that source."""
    source = dinov2_registers()
    with torch.no_grad():
        source.embeddings.position_embeddings[:, 0] = 0
    layers = source.encoder.layer
    state_dict = timm_blocks(layers, DINOV2_PARTS)
    for i, layer in enumerate(layers):
        state_dict[f"blocks.{i}.ls1.gamma"] = layer.layer_scale1.lambda1.detach().clone()
        state_dict[f"blocks.{i}.ls2.gamma"] = layer.layer_scale2.lambda1.detach().clone()
    embeddings = source.embeddings
    state_dict.update({
        "patch_embed.proj.weight": embeddings.patch_embeddings.projection.weight,
        "patch_embed.proj.bias": embeddings.patch_embeddings.projection.bias,
        "cls_token": embeddings.cls_token, "reg_token": embeddings.register_tokens,
        "pos_embed": embeddings.position_embeddings[:, 1:],  # patches only: no_embed_class=True
        "norm.weight": source.layernorm.weight, "norm.bias": source.layernorm.bias,
    })  # fmt: skip
    options = dict(reg_tokens=4, no_embed_class=True, init_values=1e-5)
    timm_folder(hub_repo(cache, TIMM_REG4), state_dict, 4, "token", **options)
    return source


def write_timm_gap(cache):
    """timm's `vit_*_reg4_gap_*` with `fc_norm` under `TIMM_GAP`: no class token, four registers, average pooling,
    fc_norm; the blocks are transformers' DINOv2 with registers' (its LayerScale left out). Returns that source and
    the fc_norm's weight and bias."""
    source = dinov2_registers()
    state_dict = timm_blocks(source.encoder.layer, DINOV2_PARTS)
    embeddings = source.embeddings
    torch.manual_seed(3)
    state_dict.update({
        "patch_embed.proj.weight": embeddings.patch_embeddings.projection.weight.detach(),
        "patch_embed.proj.bias": embeddings.patch_embeddings.projection.bias.detach(),
        "reg_token": embeddings.register_tokens.detach(),
        "pos_embed": embeddings.position_embeddings[:, 1:].detach(),
        "fc_norm.weight": 1 + torch.randn(32) * 0.1, "fc_norm.bias": torch.randn(32) * 0.1,
    })  # fmt: skip
    timm_folder(hub_repo(cache, TIMM_GAP), state_dict, 4, "avg", class_token=False, reg_tokens=4, fc_norm=True)
    return source, state_dict["fc_norm.weight"], state_dict["fc_norm.bias"]


def test_timm_reg4_with_layer_scale_and_no_embed_class_computes_what_dinov2_with_registers_computes(hub_cache):
    """timm's `vit_*_reg4_dinov2`: register tokens, LayerScale, and no position for the class token
    (`no_embed_class=True`), written from transformers' DINOv2 with registers whose class position is zero."""
    source = write_timm_reg4(hub_cache)
    model = VisionTransformerModel.from_pretrained(TIMM_REG4)
    assert (model.config.num_register_tokens, model.config.layer_scale_init_value) == (4, 1e-5)
    images = pixels(28, 28)
    with torch.no_grad():
        ours, theirs = model(images), source(images)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=1e-5, rtol=1e-5)


def test_timm_attention_pooling_computes_what_siglip_computes(hub_cache):
    """timm's `global_pool="map"` (`attn_pool`: latent, q, kv, proj, norm, mlp), written from SigLIP's vision tower."""
    source = siglip(vision_only=True)
    names = dict(attention="self_attn", norm1="layer_norm1", norm2="layer_norm2", proj="self_attn.out_proj",
                 fc1="mlp.fc1", fc2="mlp.fc2", qkv=("q_proj", "k_proj", "v_proj"))  # fmt: skip
    state_dict = timm_blocks(source.encoder.layers, names)
    head, width = source.head, source.config.hidden_size
    state_dict.update({
        "patch_embed.proj.weight": source.embeddings.patch_embedding.weight,
        "patch_embed.proj.bias": source.embeddings.patch_embedding.bias,
        "pos_embed": source.embeddings.position_embedding.weight[None],
        "norm.weight": source.post_layernorm.weight, "norm.bias": source.post_layernorm.bias,
        "attn_pool.latent": head.probe,
        "attn_pool.q.weight": head.attention.in_proj_weight[:width],
        "attn_pool.q.bias": head.attention.in_proj_bias[:width],
        "attn_pool.kv.weight": head.attention.in_proj_weight[width:],
        "attn_pool.kv.bias": head.attention.in_proj_bias[width:],
        "attn_pool.proj.weight": head.attention.out_proj.weight, "attn_pool.proj.bias": head.attention.out_proj.bias,
        "attn_pool.norm.weight": head.layernorm.weight, "attn_pool.norm.bias": head.layernorm.bias,
        "attn_pool.mlp.fc1.weight": head.mlp.fc1.weight, "attn_pool.mlp.fc1.bias": head.mlp.fc1.bias,
        "attn_pool.mlp.fc2.weight": head.mlp.fc2.weight, "attn_pool.mlp.fc2.bias": head.mlp.fc2.bias,
    })  # fmt: skip
    state_dict = {key: value.detach().clone() for key, value in state_dict.items()}
    timm_folder(hub_repo(hub_cache, "timm/vit_base_patch16_siglip_224.test"), state_dict, 4, "map", class_token=False)
    model = VisionTransformerModel.from_pretrained(
        "timm/vit_base_patch16_siglip_224.test", hidden_act="gelu_pytorch_tanh"
    )
    assert (model.config.classifier, model.config.use_class_token) == ("map", False)
    images = pixels(32, 32)
    with torch.no_grad():
        ours, theirs = model(images), source(images)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=1e-5, rtol=1e-5)


def test_timm_fc_norm_normalises_the_average_of_the_patch_tokens_after_registers(hub_cache):
    """timm's `vit_*_reg4_gap_*` with `fc_norm`: no class token, four registers, average pooling of the patch
    tokens only, then fc_norm; `norm` is an identity, so the tokens are returned as the last block left them."""
    source, fc_weight, fc_bias = write_timm_gap(hub_cache)
    layers, embeddings = source.encoder.layer, source.embeddings
    model = VisionTransformerModel.from_pretrained(TIMM_GAP)
    assert (model.config.fc_norm, model.config.classifier, model.config.num_prefix_tokens) == (True, "gap", 4)
    images = pixels(28, 28)
    with torch.no_grad():
        out = model(images)
        # the same blocks without LayerScale: written with transformers' DINOv2, LayerScale set to one
        for layer in layers:
            layer.layer_scale1.lambda1.fill_(1.0)
            layer.layer_scale2.lambda1.fill_(1.0)
        hidden = source.encoder(
            torch.cat(
                [
                    embeddings.register_tokens.expand(2, -1, -1),
                    embeddings.patch_embeddings(images) + embeddings.position_embeddings[:, 1:],
                ],
                dim=1,
            )
        ).last_hidden_state
    torch.testing.assert_close(out.last_hidden_state, hidden, atol=1e-5, rtol=1e-5)
    expected = torch.nn.functional.layer_norm(hidden[:, 4:].mean(dim=1), (32,), fc_weight, fc_bias, eps=1e-6)
    torch.testing.assert_close(out.pooler_output, expected, atol=1e-5, rtol=1e-5)


# family -> its source by Hub id, and a second (non-square) size for the exported graph
FAMILIES = {
    "dinov2": ("facebook/dinov2-small", (28, 42)),
    "dinov2-registers": ("facebook/dinov2-with-registers-small", (42, 28)),
    "deit-distilled": ("facebook/deit-tiny-distilled-patch16-224", (48, 40)),
    "clip": ("openai/clip-vit-base-patch32", (48, 64)),
    "siglip": ("google/siglip-base-patch16-224", (64, 48)),
    "timm-reg4": (TIMM_REG4, (42, 28)),
    "timm-fc-norm": (TIMM_GAP, (28, 42)),
}


def test_each_family_fine_tunes_from_the_command_line_and_exports_to_onnx(hub, tmp_path):
    """Every family, by Hub id: one step of `finetune` with the command line's flags (a new 10-class head, the
    source's processor at its size), then the saved model exports to ONNX and onnxruntime computes what PyTorch does
    at the native size and at a non-square one (positions resampled inside the graph) within 1e-4. One loop in one
    process: the sources and the data set are written once."""
    from datasets import DatasetDict

    from hf_vit.data.datasets import load_digits_dataset
    from hf_vit.export import check_onnx, export
    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    digits = load_digits_dataset()
    splits = {split: digits[split].select(range(n)) for split, n in (("train", 4), ("validation", 2), ("test", 4))}
    DatasetDict(splits).save_to_disk(str(tmp_path / "digits"))
    for family, (repo_id, other_size) in FAMILIES.items():
        out = tmp_path / family
        flags = ["--model_name_or_path", repo_id, "--dataset_name", str(tmp_path / "digits"), "--output_dir", str(out)]
        flags += ["--max_steps", "1", "--warmup_steps", "0", "--learning_rate", "0.1"]
        flags += ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4"]
        flags += ["--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True"]
        train("finetune", *parse_args("finetune", flags))
        results = json.loads((out / "all_results.json").read_text())
        assert results["eval_split"] == "test" and results["epoch"] == 1.0, (family, results)  # 4 images, 1 step
        model = VisionTransformerForImageClassification.from_pretrained(out).eval()
        source = VisionTransformerConfig.from_pretrained(repo_id)
        blocks = ("num_register_tokens", "layer_scale_init_value", "use_distillation_token", "classifier", "fc_norm")
        assert [getattr(model.config, name) for name in blocks] == [getattr(source, name) for name in blocks]
        assert model.config.num_labels == 10, family
        with torch.no_grad():  # the trained head tells images apart, so the comparison below is not of constants
            logits = model(pixels(*model.config.image_hw)).logits
            assert (logits[0] - logits[1]).abs().max() > 1e-2, (family, logits)
        path = export(model, tmp_path / f"{family}.onnx")
        differences = check_onnx(path, model, [model.config.image_hw, other_size], batch=2)
        assert len(differences) == 2 and max(differences.values()) < 1e-4, (family, differences)


def test_deits_one_head_classifier_and_its_encoder_with_pooler_load_as_transformers_computes_them(hub_cache):
    """transformers' `DeiTForImageClassification` classifies the class token alone (its distillation token is in the
    sequence, without a head); `DeiTModel`'s pooler (dense + tanh) becomes the pre-logits layer."""
    from transformers import DeiTForImageClassification, DeiTModel

    torch.manual_seed(0)
    config = DeiTConfig(**TOWER, image_size=32, patch_size=8, num_labels=3)
    one_head = randomise(DeiTForImageClassification(config))
    one_head.save_pretrained(hub_repo(hub_cache, "someone/deit-finetuned"))
    encoder = randomise(DeiTModel(config))
    encoder.save_pretrained(hub_repo(hub_cache, "someone/deit-encoder"))
    images = pixels(32, 32)
    model = VisionTransformerForImageClassification.from_pretrained("someone/deit-finetuned")
    assert model.config.use_distillation_token and model.distillation_classifier is None
    pooled = VisionTransformerForImageClassification.from_pretrained("someone/deit-encoder")
    assert pooled.config.representation_size == 32 and pooled.config.num_labels == 0
    with torch.no_grad():
        torch.testing.assert_close(model(images).logits, one_head(images).logits, atol=1e-5, rtol=1e-5)
        # with no classes the classifier is the identity: the logits are the pre-logits features, DeiT's pooler output
        torch.testing.assert_close(pooled(images).logits, encoder(images).pooler_output, atol=1e-5, rtol=1e-5)


def test_dinov2s_classification_head_is_refused_by_name(hub_cache):
    from transformers import Dinov2ForImageClassification

    torch.manual_seed(0)
    Dinov2ForImageClassification(Dinov2Config(**DINO, num_labels=3)).save_pretrained(
        hub_repo(hub_cache, "facebook/dinov2-small-imagenet1k-1-layer")
    )
    with pytest.raises(ValueError, match="concatenated with the mean of the patch tokens"):
        VisionTransformerForImageClassification.from_pretrained("facebook/dinov2-small-imagenet1k-1-layer")
