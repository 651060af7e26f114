"""The paper's look inside the Vision Transformer (section 4.5, appendix D.7-D.8) as functions on any hf-vit model:
attention (`capture_attention`: chosen layers' probabilities recomputed in float32 by hooks, while every layer keeps
its SDPA/flash attention), rollout (Figures 6 and 14), mean attention distance (Figure 7, right), position-embedding
similarity (centre) and the patch-embedding filters' principal components (left). Any input size the model takes
(`interpolate_pos_encoding=True` for others), fp32 or bf16 models; results are float32."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .model.resolution import grid_for

IMAGES_PER_FIGURE = 8

HEAD_FUSIONS = ("mean", "max", "min")


def _encoder(model: nn.Module) -> nn.Module:
    """The ViT encoder (`VisionTransformerModel`) of a model or of one of its task heads."""
    encoder = getattr(model, "base_model", model)
    if not (hasattr(encoder, "layers") and hasattr(encoder, "embeddings")):
        raise TypeError(
            f"{type(model).__name__} is not an hf-vit model: expected a VisionTransformerModel or a model with one "
            "as its base model (`model.vit`)."
        )
    return encoder


def _layer_indices(num_layers: int, layers: int | Sequence[int] | None) -> list[int]:
    """Chosen layers as sorted, unique, non-negative indices (negative ones count from the last layer)."""
    if layers is None:
        return list(range(num_layers))
    chosen = [layers] if isinstance(layers, int) else list(layers)
    indices = set()
    for layer in chosen:
        if not isinstance(layer, int) or not -num_layers <= layer < num_layers:
            raise ValueError(f"`layers` must hold indices in [-{num_layers}, {num_layers}), got {layer!r}.")
        indices.add(layer % num_layers)
    return sorted(indices)


def _probabilities(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scaling) of one attention module, `(B, heads, N, N)`, scores in float32."""
    batch, tokens, _ = hidden_states.shape
    qkv = module.qkv(hidden_states).view(batch, tokens, 3, module.num_heads, module.head_dim)
    query, key = (qkv[:, :, i].transpose(1, 2).float() for i in (0, 1))
    scores = torch.matmul(query, key.transpose(-1, -2)) * module.scaling
    return scores.softmax(dim=-1)


@contextlib.contextmanager
def _attention_hooks(
    model: nn.Module, layers: int | Sequence[int] | None, callback: Callable[[int, torch.Tensor], None]
) -> Iterator[list[int]]:
    """Call `callback(layer, probabilities)` for each chosen layer during the forwards run inside the context."""
    encoder = _encoder(model)
    indices = _layer_indices(len(encoder.layers), layers)
    handles = []

    def make_hook(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden_states = args[0] if args else kwargs["hidden_states"]
            # Analysis only: no graph is kept, whatever the caller's grad mode.
            with torch.no_grad():
                callback(index, _probabilities(module, hidden_states.detach()))

        return hook

    try:
        for index in indices:
            attention = encoder.layers[index].attention
            handles.append(attention.register_forward_pre_hook(make_hook(index), with_kwargs=True))
        yield indices
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_attention(
    model: nn.Module, layers: int | Sequence[int] | None = None
) -> Iterator[dict[int, torch.Tensor]]:
    """Capture the attention probabilities of the chosen `layers` (default: all) during forwards in the context, as
    `{layer: (B, heads, N, N)}` float32 (keys non-negative), as `output_attentions=True` returns them; the model's
    own attention path is untouched. Each forward replaces the previous one's entries."""
    captured: dict[int, torch.Tensor] = {}
    with _attention_hooks(model, layers, captured.__setitem__):
        yield captured


def _forward(model: nn.Module, pixel_values: torch.Tensor, interpolate_pos_encoding: bool | None) -> None:
    encoder = _encoder(model)
    parameter = next(encoder.parameters())
    pixel_values = pixel_values.to(device=parameter.device, dtype=parameter.dtype)
    with torch.no_grad():
        encoder(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)


def attention_probabilities(
    model: nn.Module,
    pixel_values: torch.Tensor,
    layers: int | Sequence[int] | None = None,
    interpolate_pos_encoding: bool | None = None,
) -> dict[int, torch.Tensor]:
    """Run the encoder on `pixel_values` and return `{layer: (B, heads, N, N) float32 probabilities}`."""
    with capture_attention(model, layers) as probs:
        _forward(model, pixel_values, interpolate_pos_encoding)
    return dict(probs)


def _fuse_heads(probs: torch.Tensor, head_fusion: str) -> torch.Tensor:
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"`head_fusion` must be one of {HEAD_FUSIONS}, got {head_fusion!r}.")
    return {"mean": torch.mean, "max": torch.amax, "min": torch.amin}[head_fusion](probs, dim=1)


def _rollout_layer(probs: torch.Tensor, head_fusion: str, discard_ratio: float) -> torch.Tensor:
    """One layer's attention with its residual connection: 0.5 A + 0.5 I, rows renormalised to sum to 1."""
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"`discard_ratio` must be in [0, 1), got {discard_ratio}.")
    fused = _fuse_heads(probs.float(), head_fusion)  # (B, N, N)
    if discard_ratio > 0:
        # Zero the weakest entries of each image's fused matrix (noise removal of the common rollout code); the
        # identity added next keeps every row non-zero.
        flat = fused.flatten(1)
        count = int(flat.shape[1] * discard_ratio)
        if count:
            weakest = flat.topk(count, dim=1, largest=False).indices
            fused = flat.scatter(1, weakest, 0.0).view_as(fused)
    identity = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    joint = 0.5 * fused + 0.5 * identity
    return joint / joint.sum(dim=-1, keepdim=True)


def rollout_map(
    rollout: torch.Tensor, grid_size: tuple[int, int], num_prefix_tokens: int, class_token: bool | None = None
) -> torch.Tensor:
    """The output's attention to the input patches as `(B, rows, cols)` maps: the class token's row of the rollout
    (`class_token`; None: when there are prefix tokens), else the mean of the patch tokens' rows; the prefix tokens'
    columns are dropped."""
    rows, cols = grid_size
    patches = rollout[:, :, num_prefix_tokens:]
    if patches.shape[-1] != rows * cols:
        raise ValueError(
            f"The rollout has {patches.shape[-1]} patch tokens but the grid {rows}x{cols} has {rows * cols}."
        )
    class_token = bool(num_prefix_tokens) if class_token is None else class_token
    flow = patches[:, 0] if class_token else patches[:, num_prefix_tokens:].mean(dim=1)
    return flow.reshape(-1, rows, cols)


def rollout_maps(
    model: nn.Module,
    pixel_values: torch.Tensor,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    interpolate_pos_encoding: bool | None = None,
) -> torch.Tensor:
    """Attention rollout of `model` on `pixel_values` as `(B, rows, cols)` maps on the CPU (Figure 6)."""
    return attention_summary(model, pixel_values, head_fusion, discard_ratio, interpolate_pos_encoding).rollout


def patch_distances(grid_size: tuple[int, int], patch_size: int) -> torch.Tensor:
    """Euclidean distances in pixels between the centres of the patches of a row-major grid, `(N, N)` float32."""
    rows, cols = grid_size
    y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    centres = torch.stack([y.flatten(), x.flatten()], dim=1).float() * patch_size
    return torch.cdist(centres, centres)


def mean_attention_distance(
    probs: torch.Tensor, grid_size: tuple[int, int], patch_size: int, num_prefix_tokens: int
) -> torch.Tensor:
    """Mean attention distance in pixels of one layer's probabilities `(B, heads, N, N)`, as `(B, heads)`: per query
    patch, the attention-weighted distance to the key patches, averaged. As in Figure 7, prefix tokens are left out
    and each patch's weights over the patches renormalised."""
    patches = probs[..., num_prefix_tokens:, num_prefix_tokens:].float()
    weights = patches / patches.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    distances = patch_distances(grid_size, patch_size).to(weights.device)
    if distances.shape[-1] != weights.shape[-1]:
        raise ValueError(f"{weights.shape[-1]} patch tokens do not fill the grid {grid_size[0]}x{grid_size[1]}.")
    per_query = torch.einsum("bhqk,qk->bhq", weights, distances)
    return per_query.mean(dim=-1)


def mean_attention_distances(
    model: nn.Module,
    pixel_values: torch.Tensor,
    layers: int | Sequence[int] | None = None,
    interpolate_pos_encoding: bool | None = None,
) -> torch.Tensor:
    """Mean attention distance in pixels per chosen layer and head: `(layers, heads)`, over the images."""
    indices = _layer_indices(len(_encoder(model).layers), layers)
    summary = attention_summary(model, pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
    return summary.mean_distances.mean(dim=0)[indices]


class AttentionSummary(NamedTuple):
    """What one forward gives for the figures: rollout maps and per-image mean attention distances."""

    rollout: torch.Tensor  # (B, rows, cols)
    mean_distances: torch.Tensor  # (B, layers, heads), pixels


def attention_summary(
    model: nn.Module,
    pixel_values: torch.Tensor,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    interpolate_pos_encoding: bool | None = None,
) -> AttentionSummary:
    """`rollout_maps` and the per-image `mean_attention_distance` of every layer from a single forward."""
    _fuse_heads(torch.zeros(1, 1, 1, 1), head_fusion)  # reject a bad fusion name before running the model
    config = _encoder(model).config
    grid = grid_for(tuple(pixel_values.shape[-2:]), config.patch_size)
    state: dict[str, torch.Tensor] = {}
    distances: list[torch.Tensor] = []

    def accumulate(index: int, probs: torch.Tensor) -> None:
        distances.append(mean_attention_distance(probs, grid, config.patch_size, config.num_prefix_tokens).cpu())
        layer = _rollout_layer(probs, head_fusion, discard_ratio)
        state["rollout"] = layer if "rollout" not in state else torch.bmm(layer, state["rollout"])

    with _attention_hooks(model, None, accumulate):
        _forward(model, pixel_values, interpolate_pos_encoding)
    maps = rollout_map(state["rollout"], grid, config.num_prefix_tokens, config.classifier == "token")
    return AttentionSummary(maps.cpu(), torch.stack(distances, dim=1))


def position_embedding_similarity(
    model_or_embeddings: nn.Module | torch.Tensor, grid_size: tuple[int, int] | None = None
) -> torch.Tensor:
    """Cosine similarity of the patches' position embeddings, `(rows, cols, rows, cols)`."""
    if isinstance(model_or_embeddings, nn.Module):
        encoder = _encoder(model_or_embeddings)
        prefix = encoder.config.num_position_prefix_tokens  # register tokens have no position
        embeddings = encoder.embeddings.position_embedding[0, prefix:]
        grid_size = grid_size or encoder.config.grid_size
    else:
        embeddings = model_or_embeddings.reshape(-1, model_or_embeddings.shape[-1])
        if grid_size is None:
            raise ValueError("`grid_size` is needed with an embedding tensor.")
    rows, cols = grid_size
    if embeddings.shape[0] != rows * cols:
        raise ValueError(f"{embeddings.shape[0]} position embeddings do not fill the grid {rows}x{cols}.")
    unit = torch.nn.functional.normalize(embeddings.detach().float(), dim=-1)
    return (unit @ unit.T).reshape(rows, cols, rows, cols)


class PrincipalComponents(NamedTuple):
    """Principal components of the patch-embedding filters."""

    components: torch.Tensor  # (K, C, P, P), unit norm, first the direction of largest variance
    explained_variance_ratio: torch.Tensor  # (K,)


def patch_embedding_components(
    model_or_weight: nn.Module | torch.Tensor, num_components: int = 28
) -> PrincipalComponents:
    """The top principal components of the patch-embedding filters, signed."""
    if isinstance(model_or_weight, nn.Module):
        weight = _encoder(model_or_weight).embeddings.patch_embedding.weight
    else:
        weight = model_or_weight
    filters = weight.detach().float().cpu()
    flat = filters.flatten(1)
    centred = flat - flat.mean(dim=0, keepdim=True)
    _, singular_values, vh = torch.linalg.svd(centred, full_matrices=False)
    count = min(num_components, vh.shape[0])
    components = vh[:count]
    signs = torch.sign(components.gather(1, components.abs().argmax(dim=1, keepdim=True)))
    components = components * signs
    variance = singular_values**2
    ratio = variance[:count] / variance.sum().clamp_min(torch.finfo(torch.float32).tiny)
    return PrincipalComponents(components.reshape(count, *filters.shape[1:]), ratio)


def components_as_images(components: torch.Tensor) -> torch.Tensor:
    """Components `(K, C, P, P)` as images `(K, P, P, 3)` in [0, 1], each on its own range (RGB or grey)."""
    images = components.float()
    if images.shape[1] != 3:
        images = images[:, :1].expand(-1, 3, -1, -1) if images.shape[1] < 3 else images[:, :3]
    low = images.flatten(1).amin(dim=1).view(-1, 1, 1, 1)
    high = images.flatten(1).amax(dim=1).view(-1, 1, 1, 1)
    scaled = (images - low) / (high - low).clamp_min(1e-12)
    return scaled.permute(0, 2, 3, 1)


def _displayable(pixel_values: torch.Tensor, processor: Any) -> torch.Tensor:
    """Processed pixels back to `(B, H, W, 3)` in [0, 1]: the image exactly as the model saw it."""
    values = pixel_values.float()
    if processor.do_normalize:
        mean = torch.tensor(processor.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(processor.image_std, dtype=torch.float32).view(1, -1, 1, 1)
        values = values * std + mean
    if values.shape[1] != 3:
        values = values[:, :1].expand(-1, 3, -1, -1)
    return values.clamp(0, 1).permute(0, 2, 3, 1)


def write_analysis_figures(
    model: nn.Module,
    processor: Any,
    images: Sequence[Any],
    output_dir: str | os.PathLike,
    captions: Sequence[str] | None = None,
    image_size: tuple[int, int] | None = None,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_components: int = 28,
    batch_size: int = 32,
    name: str | None = None,
) -> list[Path]:
    """Write the paper's Figure 7 (`embedding_and_attention_distance.png`) and Figure 6 (`rollout.png`, or
    `rollout_1.png`, ... with 8 images each) for `model` and `images` (anything `processor` takes) to `output_dir`;
    `image_size=(height, width)` runs them at another size."""
    from tqdm.auto import tqdm

    from .outputs.plotting import plot_attention_rollout, plot_embedding_analysis

    if not images:
        raise ValueError("`images` is empty: pass at least one image.")
    _fuse_heads(torch.zeros(1, 1, 1, 1), head_fusion)
    config = _encoder(model).config
    interpolate = image_size is not None and tuple(image_size) != config.image_hw
    options = {} if image_size is None else {"size": {"height": image_size[0], "width": image_size[1]}}
    if image_size is not None:
        options["do_center_crop"] = False
    output = Path(output_dir)
    shown, maps, distances = [], [], []
    for start in tqdm(range(0, len(images), batch_size), desc="analysing images", unit="batch"):
        pixel_values = processor(list(images[start : start + batch_size]), return_tensors="pt", **options)
        pixel_values = pixel_values["pixel_values"]
        summary = attention_summary(model, pixel_values, head_fusion, discard_ratio, interpolate)
        # the patch grid's maps resized bilinearly to the image, for the overlays
        upsampled = nn.functional.interpolate(summary.rollout[:, None], pixel_values.shape[-2:], mode="bilinear")
        maps.append(upsampled[:, 0])
        shown.append(_displayable(pixel_values, processor))
        distances.append(summary.mean_distances)
    shown, maps = torch.cat(shown), torch.cat(maps)
    height, width = shown.shape[1:3]
    components = patch_embedding_components(model, num_components).components
    written = [
        plot_embedding_analysis(
            components_as_images(components),
            position_embedding_similarity(model),
            torch.cat(distances).mean(dim=0),  # (layers, heads), over all images
            output / "embedding_and_attention_distance.png",
            patch_size=config.patch_size,
            title=f"{name + ': ' if name else ''}{len(images)} images at {height}x{width}",
        )
    ]
    pages = range(0, len(images), IMAGES_PER_FIGURE)
    for page, start in enumerate(pages, start=1):
        end = start + IMAGES_PER_FIGURE
        written.append(
            plot_attention_rollout(
                shown[start:end],
                maps[start:end],
                output / ("rollout.png" if len(pages) == 1 else f"rollout_{page}.png"),
                captions=None if captions is None else list(captions[start:end]),
                title=f"attention rollout ({head_fusion} over heads)",
            )
        )
    return written
