"""A variable-shape batch's layout as data: the processor packs once, the forward and backward of every head read no
value back (no synchronisation on a GPU), a whole compiled model takes batches of other images in one graph, and the
position embeddings are taps equal to the per-grid resize."""

import contextlib

import pytest
import torch
from conftest import tiny_config
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hf_vit import (
    VisionTransformerForImageClassification,
    VisionTransformerForMaskedPatchPrediction,
    VisionTransformerImageProcessor,
    VisionTransformerModel,
)
from hf_vit.model import layout
from hf_vit.model.image_processing_vit import best_fit_decreasing, native_patch_batch, pack_patches
from hf_vit.model.layout import patch_grid_maps
from hf_vit.model.modeling_mpp import PATCH_MASKED, PATCH_RANDOM
from hf_vit.model.resolution import position_embeddings_at, position_taps, resample_position_embeddings

# ops that copy a value from a tensor to the host: on a GPU each waits for the device
HOST_READ_OPS = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero")
HOST_READ_METHODS = ("cpu", "tolist", "item", "numpy")


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values by the host: the aten ops above (dispatched) and the Tensor methods."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in HOST_READ_OPS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_reads():
    counter = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READ_METHODS}

    def counted(name):
        def method(self, *args, **kwargs):
            counter.reads.append(name)
            return originals[name](self, *args, **kwargs)

        return method

    try:
        for name in HOST_READ_METHODS:
            setattr(torch.Tensor, name, counted(name))
        with counter:
            yield counter.reads
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def images(count, seed=0, patch=4, largest=24):
    """`count` random images of patch-divisible sizes of at most `largest` patches."""
    generator = torch.Generator().manual_seed(seed)
    shapes = []
    while len(shapes) < count:
        rows, cols = (int(value) for value in torch.randint(1, 9, (2,), generator=generator))
        if rows * cols <= largest:
            shapes.append((rows, cols))
    return [torch.randn(3, rows * patch, cols * patch, generator=generator) for rows, cols in shapes]


def padded_batch(count, seed=0):
    return dict(native_patch_batch(images(count, seed), 4, 24))


def packed_batch(count, seed=0, length=48, drop=False, rows=None):
    padded = padded_batch(count, seed)
    grids = [tuple(grid) for grid in padded["spatial_shapes"].tolist()]
    patches = [values[: rows * cols] for values, (rows, cols) in zip(padded["pixel_values"], grids)]
    positions = None
    if drop:  # NaViT's token dropping: each image keeps a random two thirds of its patches, in any order
        generator = torch.Generator().manual_seed(seed + 1)
        positions = [torch.randperm(len(p), generator=generator)[: max(1, 2 * len(p) // 3)] for p in patches]
        patches = [p[kept] for p, kept in zip(patches, positions)]
    planned = None
    if rows is not None:  # exactly `rows` rows, as the training collator's fixed-token batches (empty ones padding)
        planned = best_fit_decreasing([len(p) for p in patches], length)
        planned += [[] for _ in range(rows - len(planned))]
    return pack_patches(patches, grids, length, positions, planned)


def model_of(kind, **fields):
    torch.manual_seed(0)
    config = tiny_config(image_size=16, patch_size=4, num_labels=3, **fields)
    model = {
        "classifier": VisionTransformerForImageClassification,
        "mpp": VisionTransformerForMaskedPatchPrediction,
        "base": VisionTransformerModel,
    }[kind](config)
    return model.train()  # dropout is 0 in the tiny config: training mode is deterministic but takes its paths


def forward_backward(model, batch):
    kind = type(model).__name__
    inputs = dict(batch)
    device = inputs["pixel_values"].device
    if "MaskedPatch" in kind:  # some patches masked, some replaced by others', the labels per patch slot
        slots = inputs["pixel_values"].shape[:2]
        codes = torch.arange(slots[0] * slots[1], device=device).view(slots) % 4
        inputs["patch_corruption"] = torch.where(codes == 1, PATCH_MASKED, torch.where(codes == 2, PATCH_RANDOM, 0))
        inputs["labels"] = torch.arange(slots[0] * slots[1], device=device).view(slots) % 8
    elif "Classification" in kind:
        inputs["labels"] = torch.arange(len(inputs["spatial_shapes"]), device=device) % 3
    outputs = model(**inputs)
    loss = outputs.loss if getattr(outputs, "loss", None) is not None else outputs.pooler_output.square().mean()
    loss.backward()
    return outputs


@pytest.mark.parametrize("kind", ["classifier", "mpp", "base"])
@pytest.mark.parametrize("form", ["padded", "packed", "packed, dropping"])
@pytest.mark.parametrize("family", ["plain", "registers + map"])
def test_forward_and_backward_read_no_value_back(kind, form, family, monkeypatch):
    fields = {} if family == "plain" else dict(num_register_tokens=2, classifier="map", use_class_token=False)
    if kind == "mpp" and family != "plain":
        fields["classifier"] = "gap"
    model = model_of(kind, **fields)
    batch = padded_batch(5) if form == "padded" else packed_batch(5, drop="dropping" in form)
    batch = {name: value for name, value in batch.items()}
    forward_backward(model, batch)  # the first call: one-time work (logs) aside
    # on CPU a packed batch's stream leaves out its padding and its runs are attended one by one: their lengths
    # read once from host memory (no device)
    with counting_host_reads() as reads:
        forward_backward(model, batch)
    assert reads == ([] if form == "padded" else ["tolist"])
    # the paths a GPU takes read nothing: the padding in the stream, each image in a row of its own (or varlen_attn,
    # the runs as data)
    monkeypatch.setattr(layout, "values_on_host", lambda device: False)
    forward_backward(model, batch)
    with counting_host_reads() as reads:
        forward_backward(model, batch)
    assert reads == []
    # the counter sees a read: the backbone's maps read the largest grid, once
    with counting_host_reads() as reads:
        patch_grid_maps(torch.zeros(2, 6, 4), torch.tensor([[2, 3], [1, 5]]))
    assert reads == ["cpu", "tolist"]


def test_the_packer_writes_each_images_slots_from_its_plan():
    # rows of 6 slots, planned [image 2 (2x2), image 0 (1x2)], [image 1 (1x3), padding]
    patches = [torch.full((size, 3), float(index)) for index, size in enumerate((2, 3, 4))]
    grids = [(1, 2), (1, 3), (2, 2)]
    batch = pack_patches(patches, grids, 6, rows=[[2, 0], [1]])
    assert sorted(batch) == ["image_slot_index", "pixel_values", "spatial_shapes"]
    assert batch["image_slot_index"].tolist() == [[4, 5, -1, -1], [6, 7, 8, -1], [0, 1, 2, 3]]
    assert batch["pixel_values"][..., 0].tolist() == [[2, 2, 2, 2, 0, 0], [1, 1, 1, 0, 0, 0]]
    # token dropping: the kept places, in the order given, fill each image's run
    kept = [torch.tensor([1]), torch.tensor([2, 0]), torch.tensor([3, 0, 2])]
    dropped = pack_patches([p[: len(k)] for p, k in zip(patches, kept)], grids, 6, kept, rows=[[2, 0], [1]])
    assert dropped["image_slot_index"].tolist() == [[-1, 3, -1, -1], [7, -1, 6, -1], [1, -1, 2, 0]]


def test_a_batch_in_the_fields_of_earlier_versions_is_refused_naming_the_one_that_describes_it():
    model = model_of("classifier").eval()
    batch = packed_batch(4)
    for name in ("patch_image_index", "row_image_index", "patch_positions"):
        with pytest.raises(ValueError, match=f"`{name}` no longer describes a packed batch: `image_slot_index`"):
            model(**batch, **{name: torch.zeros(2, 2, dtype=torch.long)})


def test_wrong_packing_fields_are_refused_by_their_shapes():
    model = model_of("classifier").eval()
    batch = packed_batch(4)
    wrong = {
        "image_slot_index": torch.cat([batch["image_slot_index"]] * 2),  # more images than `spatial_shapes` has
        "pixel_attention_mask": torch.ones(len(batch["pixel_values"]), 3, dtype=torch.long),
    }
    for name, value in wrong.items():
        with pytest.raises(ValueError, match=name):
            model(**{**batch, name: value})
    with pytest.raises(ValueError, match="`image_slot_index` must be an \\(4, K\\) integer tensor"):
        model(**{**batch, "image_slot_index": batch["image_slot_index"].float()})


def test_a_padded_batchs_wrong_values_are_refused_on_the_device():
    model = model_of("classifier").eval()
    batch = padded_batch(3)
    mask = batch["pixel_attention_mask"].clone()
    mask[0, -1] = 1 - mask[0, -1]
    with pytest.raises(RuntimeError, match="pixel_attention_mask"):
        model(**{**batch, "pixel_attention_mask": mask})
    with pytest.raises(RuntimeError, match="spatial_shapes"):
        model(**{**batch, "spatial_shapes": batch["spatial_shapes"] * 5})


def compiled_graphs(model, batches):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for batch in batches:
        eager = model(**batch).logits
        torch.testing.assert_close(compiled(**batch).logits, eager, rtol=1e-5, atol=1e-5)
    return counter.frame_count


@pytest.mark.parametrize("form", ["padded", "packed"])
def test_the_whole_model_compiles_in_one_graph_for_batches_of_other_images(form):
    model = model_of("classifier", num_register_tokens=1).eval()
    if form == "padded":  # one K, other images and image counts
        batches = [padded_batch(count, seed=count) for count in (3, 5, 4, 6, 7, 2)]
    else:  # R rows of one L (the training collator's batches), other images and image counts
        batches = [packed_batch(count, seed=count, rows=3) for count in (4, 6, 5, 8, 7, 9)]
    with torch.no_grad():
        assert compiled_graphs(model, batches) <= 2


def resized_per_grid(table, old_grid, grid, mode, antialias, dtype):
    """The reference: the patch positions of `table` `(1, 1 + rows * cols, D)` resized to `grid` by F.interpolate."""
    patches = table[0, 1:].to(dtype).reshape(1, *old_grid, -1).permute(0, 3, 1, 2)
    resized = F.interpolate(patches, size=grid, mode=mode, antialias=antialias, align_corners=False)
    return resized.permute(0, 2, 3, 1).reshape(grid[0] * grid[1], -1)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
@pytest.mark.parametrize("antialias", [False, True])
def test_position_taps_equal_the_resize_per_grid_with_gradients(mode, antialias):
    torch.manual_seed(0)
    table = torch.randn(1, 1 + 7 * 6, 8, dtype=torch.float32, requires_grad=True)
    grids = torch.tensor([[1, 1], [2, 9], [7, 6], [12, 3], [4, 4], [1, 20], [14, 1], [3, 2]])  # up and down, each axis
    count = 42  # the largest grid's patches
    by_taps = position_embeddings_at(table, (7, 6), grids[:, None], torch.arange(count)[None], 1, mode, antialias)
    by_taps = torch.cat([table[:, :1].expand(len(grids), -1, -1), by_taps], dim=1)  # with the class token's
    assert by_taps.dtype == torch.float32
    weights = torch.randn_like(by_taps)
    (gradient,) = torch.autograd.grad((by_taps * weights).sum(), table)
    for dtype, tolerance in ((torch.float64, 1e-6), (torch.float32, 3e-6)):  # float32's resize rounds too
        reference = torch.zeros(len(grids), 1 + count, 8, dtype=dtype)
        reference[:, 0] = table[0, 0].to(dtype)
        for index, grid in enumerate(grids.tolist()):
            reference[index, 1 : 1 + grid[0] * grid[1]] = resized_per_grid(table, (7, 6), grid, mode, antialias, dtype)
        torch.testing.assert_close(by_taps.to(dtype), reference.detach(), rtol=0, atol=tolerance)
    (expected,) = torch.autograd.grad((reference * weights.to(dtype)).sum(), table)
    torch.testing.assert_close(gradient, expected, rtol=0, atol=1e-5)
    # the per-grid path of whole images is the same function
    for index, grid in enumerate(grids.tolist()):
        whole = resample_position_embeddings(table, (7, 6), tuple(grid), 1, mode, antialias)[0]
        torch.testing.assert_close(by_taps[index, : whole.shape[0]], whole, rtol=0, atol=3e-6)


def test_each_patch_has_a_few_taps_without_antialias():
    grids, places = torch.tensor([[[3, 5]], [[16, 16]]]), torch.arange(256)[None]
    assert position_taps(grids, places, (14, 14), "bicubic", False)[0].shape == (2, 256, 16)
    assert position_taps(grids, places, (14, 14), "bilinear", False)[0].shape == (2, 256, 4)
    index, weight = position_taps(grids, places, (14, 14), "bicubic", False)
    assert (weight[0, 15:] == 0).all()  # the padding after the first image's 15 patches
    torch.testing.assert_close(weight[1].sum(-1), torch.ones(256))


def test_one_image_from_a_packing_processor_is_a_batch_of_one_and_such_batches_concatenate():
    processor = VisionTransformerImageProcessor(max_num_patches=24, patch_size=4, packed_sequence_length=48)
    photos = [(torch.rand(3, 30, 50) * 255).to(torch.uint8) for _ in range(3)]
    one = processor(photos[0], return_tensors="pt")
    assert "image_slot_index" not in one and one["pixel_values"].shape == (1, 24, 48)
    model = model_of("classifier").eval()
    each = torch.cat([model(**processor(photo, return_tensors="pt")).logits for photo in photos])
    rows = [processor(photo, return_tensors="pt") for photo in photos]
    concatenated = {name: torch.cat([row[name] for row in rows]) for name in rows[0]}
    together = processor(photos, return_tensors="pt")
    assert "image_slot_index" in together
    torch.testing.assert_close(model(**concatenated).logits, each, rtol=0, atol=1e-5)
    torch.testing.assert_close(model(**together).logits, each, rtol=0, atol=1e-5)


def test_the_batch_pipeline_serves_a_packing_folder_as_one_image_at_a_time(tmp_path):
    from transformers import pipeline

    model = model_of("classifier").eval()
    model.save_pretrained(tmp_path)
    VisionTransformerImageProcessor(max_num_patches=24, patch_size=4, packed_sequence_length=48).save_pretrained(
        tmp_path
    )
    classify = pipeline("image-classification", model=str(tmp_path), device="cpu")
    from PIL import Image

    photos = [Image.fromarray((torch.rand(20 + 8 * i, 40, 3) * 255).to(torch.uint8).numpy()) for i in range(4)]
    one_at_a_time = [classify(photo, top_k=3) for photo in photos]
    batched = classify(photos, batch_size=3, top_k=3)
    for alone, together in zip(one_at_a_time, batched):
        assert [entry["label"] for entry in alone] == [entry["label"] for entry in together]
        for a, b in zip(alone, together):
            assert b["score"] == pytest.approx(a["score"], abs=1e-5)


def test_cross_entropy_of_a_packed_batch_is_that_of_the_images_alone():
    """A training step's loss on a packed batch with the processor's layout equals the loss of each image alone."""
    model = model_of("classifier", num_register_tokens=1).eval()
    batch = packed_batch(6, seed=5)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    packed = model(**batch, labels=labels).loss
    padded = padded_batch(6, seed=5)
    alone = []
    for index in range(6):
        rows, cols = padded["spatial_shapes"][index].tolist()
        one = {
            "pixel_values": padded["pixel_values"][index : index + 1, : rows * cols],
            "spatial_shapes": padded["spatial_shapes"][index : index + 1],
        }
        alone.append(model(**one).logits)
    expected = F.cross_entropy(torch.cat(alone), labels)
    torch.testing.assert_close(packed, expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a synchronisation exists only between a host and a GPU")
@pytest.mark.parametrize("form", ["padded", "packed"])
def test_on_a_gpu_forward_and_backward_never_synchronise(form):
    model = model_of("classifier", num_register_tokens=1).cuda()
    batch = padded_batch(5) if form == "padded" else packed_batch(5, rows=3)
    batch = {name: value.cuda() for name, value in batch.items()}
    forward_backward(model, batch)  # one-time work (the first kernels, the logs) aside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            forward_backward(model, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_processors_own_options_load_as_options_and_a_row_too_short_is_refused_at_once(tmp_path, caplog):
    from transformers import AutoImageProcessor
    from transformers.utils import logging as transformers_logging

    VisionTransformerImageProcessor(max_num_patches=16, patch_size=8, packed_sequence_length=32).save_pretrained(
        tmp_path
    )
    transformers_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            loaded = AutoImageProcessor.from_pretrained(tmp_path, max_num_patches=24, patch_size=8)
    finally:
        transformers_logging.disable_propagation()
    assert (loaded.max_num_patches, loaded.packed_sequence_length) == (24, 32)
    assert not [record for record in caplog.records if "backward compatibility" in record.getMessage()]
    with pytest.raises(ValueError, match=r"`packed_sequence_length` \(32\) must be at least `max_num_patches` \(64\)"):
        VisionTransformerImageProcessor.from_pretrained(tmp_path, max_num_patches=64)


def test_on_cpu_each_packed_image_attends_alone(monkeypatch):
    """SDPA on CPU attends to each of a packed batch's runs alone (no score between two images, none on padding):
    the outputs and gradients of the padded batch of the same images, whose rows are the images."""
    results = []
    for batch in (packed_batch(7, seed=2), padded_batch(7, seed=2)):
        model = model_of("classifier", num_register_tokens=1)
        shapes, sdpa = [], F.scaled_dot_product_attention

        def recorded(query, *args, shapes=shapes, sdpa=sdpa, **kwargs):
            shapes.append(query.shape)
            return sdpa(query, *args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
        outputs = forward_backward(model, batch)
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        results.append((outputs.logits, [p.grad for p in model.parameters()], shapes))
    (packed, packed_grads, packed_shapes), (padded, padded_grads, padded_shapes) = results
    assert {shape[0] for shape in padded_shapes} == {7} and {shape[0] for shape in packed_shapes} == {1}
    tokens = 2 + packed_batch(7, seed=2)["spatial_shapes"].prod(-1)  # a class token, a register, the patches
    assert set(tokens.tolist()) <= {shape[2] for shape in packed_shapes}  # each image's run
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    for ours, theirs in zip(packed_grads, padded_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def concatenated(first, second):
    """Two packed batches put one after the other along every field, as a user may mistake for one batch."""
    joined = {}
    for name in first:
        a, b = first[name], second[name]
        if name == "image_slot_index":
            a, b = (F.pad(value, (0, max(a.shape[1], b.shape[1]) - value.shape[1]), value=-1) for value in (a, b))
        joined[name] = torch.cat([a, b])
    return joined


def test_a_packed_batchs_fields_that_disagree_are_refused_naming_the_field():
    """Each would run silently, its logits wrong or another image's, where the fields were taken on trust."""
    model = model_of("classifier").eval()
    batch = packed_batch(3, seed=1)
    rows, length = batch["pixel_values"].shape[:2]
    slots = batch["image_slot_index"]
    gap = slots.clone()
    gap[0, int((gap[0] >= 0).sum()) - 1] = rows * length - 1  # the first image's last patch in the last slot
    mask = torch.zeros(rows * length, dtype=torch.long).index_fill(0, slots[slots >= 0], 1).view(rows, length)
    small = batch["spatial_shapes"].clone()
    small[0] = 1
    out_of_range = slots.clone()
    out_of_range[0, 0] = 10**4
    wrong = {
        "two patches in a slot": ("image_slot_index", concatenated(batch, packed_batch(3, seed=2))),
        "a grid too small": ("spatial_shapes", {**batch, "spatial_shapes": small}),
        "a slot out of range": ("image_slot_index", {**batch, "image_slot_index": out_of_range}),
        "a run with a gap": ("image_slot_index", {**batch, "image_slot_index": gap}),
        "a mask of no slot": ("pixel_attention_mask", {**batch, "pixel_attention_mask": torch.zeros_like(mask)}),
    }
    for name, inputs in wrong.values():
        with pytest.raises(RuntimeError, match=f"`{name}` must"):
            model(**inputs)
    model(**batch)  # the batch as the processor made it runs, with and without a mask of its slots
    model(**batch, pixel_attention_mask=mask)


def test_the_batch_fields_are_listed_once_and_every_forward_takes_them_as_given():
    """`BatchLayout.of` names the fields; the forwards hand them over in their kwargs, none lists them again."""
    import inspect

    from hf_vit import VisionTransformerBackbone
    from hf_vit.model.layout import BATCH_FIELDS, BatchLayout

    named = [name for name in inspect.signature(BatchLayout.of).parameters if name not in ("pixel_values", "prefix")]
    assert sorted(named) == sorted(BATCH_FIELDS)
    heads = (
        VisionTransformerModel,
        VisionTransformerForImageClassification,
        VisionTransformerForMaskedPatchPrediction,
    )
    for head in (*heads, VisionTransformerBackbone):
        assert not set(inspect.signature(head.forward).parameters) & set(BATCH_FIELDS), head.__name__
    assert len(inspect.signature(VisionTransformerModel.forward).parameters) == 8  # self, 5 inputs, layout, kwargs


def images_per_row(batch):
    """The most images in one row of a packed batch."""
    rows = batch["image_slot_index"].clamp(min=0).amin(1) // batch["pixel_values"].shape[1]
    return int(torch.bincount(rows).max())


def test_packed_batches_of_other_rows_and_images_per_row_compile_in_two_graphs_marked_dynamic():
    """The rows and the most images in a row change between these batches: their sizes marked dynamic from the first
    batch, the compiled model takes them all in at most two graphs (three without the marks)."""
    model = model_of("classifier", num_register_tokens=1).eval()
    batches = [packed_batch(count, seed=count, length=32) for count in (4, 6, 5, 8, 7, 9)]
    assert len({(len(batch["pixel_values"]), images_per_row(batch)) for batch in batches}) > 3
    first = {name: value.clone() for name, value in batches[0].items()}
    for name, value in first.items():  # rows (R), images (N), and the most patches of one image (K)
        torch._dynamo.mark_dynamic(value, [0, 1] if name == "image_slot_index" else 0)
    with torch.no_grad():
        assert compiled_graphs(model, [first, *batches[1:]]) <= 2
