"""No padding tax: attention restricted to runs of tokens (each image of a padded or packed batch), and the
processor's packing of several images into rows of a fixed number of patch slots."""

import json
import logging
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import tiny_config
from torch.nn import functional as F

import hf_vit.model.attention as attention
import hf_vit.model.layout as layout_module
from hf_vit import (
    VisionTransformerBackbone,
    VisionTransformerForImageClassification,
    VisionTransformerForMaskedPatchPrediction,
    VisionTransformerImageProcessor,
    VisionTransformerModel,
)
from hf_vit.model.attention import (
    ALL_ATTENTION_FUNCTIONS,
    eager_attention_forward,
    segment_attention_forward,
    segment_attention_path,
)
from hf_vit.model.image_processing_vit import best_fit_decreasing, pack_patches
from hf_vit.model.layout import AttentionSegments, BatchLayout
from hf_vit.model.modeling_mpp import PATCH_CLEAN

# rows of runs (an image's tokens each) in rows of ROW tokens, the rest of each row padding
RUNS = [[5, 3], [7], [2, 2, 2, 2], [9]]
ROW = 9


class Attention(torch.nn.Module):
    """What the attention functions read from the model's attention module."""

    is_causal = False


def qkv(rows=1, tokens=36, heads=2, head_dim=4, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    buffer = torch.randn(rows, tokens, 3, heads, head_dim, dtype=dtype, generator=generator).requires_grad_()
    return buffer, [part.transpose(1, 2) for part in buffer.unbind(2)]  # (B, heads, N, d_h) views, as the model's


def each_run_alone(query, key, value, runs=RUNS, row_length=ROW):
    """The reference: SDPA of every run by itself over the `(1, heads, rows * ROW, d_h)` tokens (a packed batch's
    slots without prefix tokens), `(1, N, heads, d_h)`, padding left at zero."""
    output = torch.zeros(1, query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)
    for row, lengths in enumerate(runs):
        start = row * row_length
        for length in lengths:
            part = slice(start, start + length)
            alone = F.scaled_dot_product_attention(query[:, :, part], key[:, :, part], value[:, :, part])
            output[0, part] = alone[0].transpose(0, 1)
            start += length
    return output


def attention_segments(runs=RUNS, row_length=ROW, prefix=0, on_host=False):
    """The segments of a packed batch of rows of `row_length` slots holding images of `runs[row]` patches (1 x n
    grids), in that order: as a GPU has them (the stream with its padding), or `on_host` as a CPU has them."""
    sizes = [size for row in runs for size in row]
    plan, first = [], 0
    for row in runs:
        plan.append(list(range(first, first + len(row))))
        first += len(row)
    batch = pack_patches(
        [torch.zeros(size, 3) for size in sizes], [(1, size) for size in sizes], row_length, rows=plan
    )
    return layout_of(batch, prefix, on_host).segments


def per_run(flat, lengths, scale):
    """Attention within runs of the flattened `(T, heads, d_h)` tokens, each run alone (the empty ones skipped)."""
    outputs = []
    for query, key, value in zip(*(tensor.split(lengths) for tensor in flat)):
        if len(query):
            alone = F.scaled_dot_product_attention(
                *(part.transpose(0, 1) for part in (query, key, value)), scale=scale
            )
            outputs.append(alone.transpose(0, 1))
    return torch.cat(outputs)


def valid(runs=RUNS, row_length=ROW):
    """`(1, rows * row_length)`: the slots that hold an image's patch."""
    return torch.tensor([[slot < sum(row) for row in runs for slot in range(row_length)]])


@pytest.mark.parametrize("implementation", ["sdpa", "sdpa, each image in a row", "eager", "flex_attention"])
def test_each_run_attends_only_to_itself_and_gradients_match(implementation):
    # CPU runs SDPA over each run alone, its stream without padding; the rest (and a GPU in fp32) image rows
    on_host = implementation == "sdpa"
    implementation = implementation.split(",")[0]
    buffer, (query, key, value) = qkv()
    keep = valid()
    inputs = [part[:, :, keep[0]] for part in (query, key, value)] if on_host else (query, key, value)
    function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    segments = attention_segments(RUNS, ROW, on_host=on_host)
    output, probs = function(Attention(), *inputs, segments, scaling=4**-0.5)
    if on_host:  # the outputs back in their slots
        output = output.new_zeros(keep.shape[1], *output.shape[2:]).index_put((keep[0],), output[0])[None]
    reference = each_run_alone(query, key, value)
    tolerance = 1e-6 if implementation == "eager" else 1e-12  # eager's softmax runs in fp32
    torch.testing.assert_close(output[keep], reference[keep], atol=tolerance, rtol=tolerance)
    grad = torch.randn_like(output) * keep[..., None, None]  # the padding's outputs feed nothing
    (ours,) = torch.autograd.grad(output, buffer, grad)
    (theirs,) = torch.autograd.grad(reference, buffer, grad)
    torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=tolerance)
    if implementation == "eager":  # the probabilities of each image's row: zero on the keys of none of its tokens
        images = attention_segments(RUNS, ROW).token_mask
        assert probs.shape == (len(images), 2, images.shape[1], images.shape[1])
        assert torch.all(probs.masked_select(~images[:, None, None, :]) == 0)
        torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))


def test_cpu_bf16_training_on_runs_matches_fp32():
    buffer, (query, key, value) = qkv(tokens=sum(map(sum, RUNS)), dtype=torch.float32)
    module = Attention().train()
    segments = attention_segments(RUNS, ROW, on_host=True)
    low = [part.to(torch.bfloat16) for part in (query, key, value)]
    output, _ = segment_attention_forward(
        "sdpa", attention.sdpa_or_matmul_attention_forward, module, *low, segments, 0.5
    )
    reference, _ = segment_attention_forward(
        "sdpa", attention.sdpa_or_matmul_attention_forward, module, query, key, value, segments, 0.5
    )
    torch.testing.assert_close(output.float(), reference, atol=3e-2, rtol=3e-2)


def test_the_path_follows_the_implementation_device_and_dtype(monkeypatch):
    monkeypatch.setattr(attention, "_flash_capable", lambda index: True)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    path = segment_attention_path
    if attention.varlen_attn is not None:  # torch >= 2.10
        assert path("sdpa", cuda, torch.bfloat16, 0.0, 64) == "varlen"
        assert path("sdpa", cuda, torch.float16, 0.0, 64) == "varlen"
        assert path("flex_attention", cuda, torch.bfloat16, 0.0, 64) == "varlen"
    # where varlen_attn does not apply, a GPU runs each image in a row of its own, as a CPU does
    assert path("sdpa", cuda, torch.float32, 0.0, 64) == "images"  # flash kernels are half precision only
    assert path("sdpa", cuda, torch.bfloat16, 0.1, 64) == "images"  # varlen_attn has no dropout
    assert path("sdpa", cuda, torch.bfloat16, 0.0, 6) == "images"  # a head size flash kernels refuse
    assert path("flex_attention", cuda, torch.float32, 0.0, 64) == "images"
    # CPU: a packed batch's runs one by one (their lengths read from host memory), a padded one's rows as they are
    assert path("sdpa", cpu, torch.bfloat16, 0.0, 64, runs=True) == "runs"
    assert path("flex_attention", cpu, torch.float32, 0.0, 64, runs=True) == "runs"
    assert path("eager", cpu, torch.float32, 0.0, 64, runs=True) == "images"  # it returns the probabilities
    assert path("sdpa", cpu, torch.bfloat16, 0.0, 64) == "images"
    assert layout_module.values_on_host(cpu) and not layout_module.values_on_host(cuda)  # a GPU's runs are data
    assert path("flash_attention_2", cuda, torch.bfloat16, 0.0, 64) == "flash"
    assert path("flash_attention_3", cuda, torch.bfloat16, 0.0, 64) == "flash"
    assert path("eager", cuda, torch.bfloat16, 0.0, 64) == "images"
    monkeypatch.setattr(attention, "_flash_capable", lambda index: False)  # pre-Ampere
    assert path("sdpa", cuda, torch.bfloat16, 0.0, 64) == "images"


def test_varlen_gets_the_flattened_tokens_cumulative_lengths_and_host_maxima(monkeypatch):
    seen = {}

    def fake_varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None):
        seen.update(shape=query.shape, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, scale=scale)
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        return per_run([query, key, value], lengths, scale)

    monkeypatch.setattr(attention, "varlen_attn", fake_varlen)
    monkeypatch.setattr(attention, "segment_attention_path", lambda *args: "varlen")
    _, (query, key, value) = qkv()
    segments = attention_segments(RUNS, ROW)
    output, _ = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)(
        Attention(), query, key, value, segments, scaling=0.5
    )
    assert seen["shape"] == (len(RUNS) * ROW, 2, 4)  # (total tokens, heads, head size)
    assert seen["cu_q"] is segments.cu_seqlens and seen["cu_k"] is segments.cu_seqlens
    assert (seen["max_q"], seen["max_k"]) == (9, 9) and type(seen["max_q"]) is int  # the rows' length: no read
    # each image's run, and each row's padding after its images (empty runs where boundaries meet)
    expected = [n for row in RUNS for n in [*row, ROW - sum(row)]]
    assert [n for n in torch.diff(segments.cu_seqlens).tolist() if n] == [n for n in expected if n]
    assert seen["scale"] == 0.5
    keep = valid()
    torch.testing.assert_close(output[keep], each_run_alone(query, key, value)[keep])


def test_flash_attention_gets_transformers_variable_length_arguments():
    seen = {}

    def fake_flash(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        seen.update(kwargs, mask=attention_mask)
        return query.transpose(1, 2), None

    _, (query, key, value) = qkv()
    segments = attention_segments(RUNS, ROW)
    segment_attention_forward("flash_attention_2", fake_flash, Attention(), query, key, value, segments, 0.5)
    assert seen["mask"] is None
    assert seen["cu_seq_lens_q"] is segments.cu_seqlens and seen["cu_seq_lens_k"] is segments.cu_seqlens
    assert seen["max_length_q"] == seen["max_length_k"] == 9


def test_segments_must_describe_the_batch_and_the_choice_is_logged_once(monkeypatch):
    _, (query, key, value) = qkv()
    with pytest.raises(ValueError, match="1 rows of 32 tokens, but the queries are 1 rows of 36"):
        segment_attention_forward("sdpa", None, Attention(), query, key, value, attention_segments([[3]] * 4, 8), 0.5)
    logged = {"warning": [], "info": []}
    for level in logged:
        monkeypatch.setattr(attention.logger, level, lambda message, level=level: logged[level].append(message))
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process caches (shared by all loggers)
    logging.Logger.info_once.cache_clear()
    function = ALL_ATTENTION_FUNCTIONS.get_interface("flex_attention", None)
    _, on_host = qkv(tokens=sum(map(sum, RUNS)))
    for _ in range(3):
        function(Attention(), *on_host, attention_segments(RUNS, ROW, on_host=True), scaling=0.5)
    assert len(logged["warning"]) == 1 and "flex_attention" in logged["warning"][0]
    assert logged["info"] == ["Attention restricted to each image: flex_attention runs it as 'runs'."]


def test_plain_masks_still_reach_the_implementation_unchanged():
    _, (query, key, value) = qkv()
    mask = torch.zeros(1, 1, len(RUNS) * ROW, len(RUNS) * ROW, dtype=query.dtype)
    mask[..., -2:] = torch.finfo(query.dtype).min
    function = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
    output, _ = function(Attention(), query, key, value, mask, scaling=4**-0.5)
    reference = F.scaled_dot_product_attention(query, key, value, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(output, reference)
    assert isinstance(attention_segments(RUNS, ROW), AttentionSegments)


# ---- packing in the processor ----

# (height, width) of images of several aspect ratios and sizes
SIZES = [(40, 40), (20, 80), (90, 30), (7, 200), (300, 5), (2, 5), (64, 48), (33, 33), (16, 120)]


def images(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for height, width in sizes]


def check_packing(packed, native, capacity):
    """The packing invariants, against the unpacked native-aspect batch of the same images."""
    slots, grids = packed["image_slot_index"], native["spatial_shapes"]
    assert torch.equal(packed["spatial_shapes"], grids)  # in the order given
    assert packed["pixel_values"].shape[1] == capacity
    sizes = grids.prod(1).tolist()
    assert slots.shape == (len(sizes), max(sizes))
    flat = packed["pixel_values"].flatten(0, 1)
    held = torch.zeros(len(flat), dtype=torch.bool)
    for image, size in enumerate(sizes):  # every image exactly once, whole, in one row, consecutive, in grid order
        first = int(slots[image, 0])
        assert slots[image].tolist() == list(range(first, first + size)) + [-1] * (max(sizes) - size), image
        assert first // capacity == (first + size - 1) // capacity, image
        # its patches are the unpacked native-aspect patches of the image
        assert torch.equal(flat[first : first + size], native["pixel_values"][image, :size]), image
        held[first : first + size] = True
    for row in held.view(-1, capacity):  # images first, the padding after them, zeros
        count = int(row.sum())
        assert row.tolist() == [True] * count + [False] * (capacity - count)
    assert torch.all(flat[~held] == 0)
    return sizes


def rows_of(packed):
    """Each row's images in their order in the row."""
    slots, length = packed["image_slot_index"], packed["pixel_values"].shape[1]
    first = slots[:, 0].tolist()
    rows = [[] for _ in range(packed["pixel_values"].shape[0])]
    for image in sorted(range(len(first)), key=first.__getitem__):
        rows[first[image] // length].append(image)
    return rows


@pytest.mark.parametrize("capacity", [16, 23, 40, 200])
def test_packed_rows_hold_each_image_whole_as_the_unpacked_batch_does(capacity):
    processor = VisionTransformerImageProcessor(max_num_patches=16, patch_size=8)
    native = processor(images(), return_tensors="pt")
    packed = processor(images(), packed_sequence_length=capacity, return_tensors="pt")
    assert set(packed) == {"pixel_values", "spatial_shapes", "image_slot_index"}
    sizes = check_packing(packed, native, capacity)
    assert packed["pixel_values"].shape[0] >= -(-sum(sizes) // capacity)
    if capacity >= sum(sizes):
        assert packed["pixel_values"].shape[0] == 1


def best_fit_decreasing_by_hand(sizes, capacity):
    """The rule written out: largest first (ties in the order given), each into the row it leaves the least room in
    (of those, the one that came to that room last), a new row when none has room."""
    rows, room, since = [], [], []
    for step, index in enumerate(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))):
        fitting = [row for row, left in enumerate(room) if left >= sizes[index]]
        if fitting:
            row = min(fitting, key=lambda row: (room[row], -since[row]))
            rows[row].append(index)
            room[row] -= sizes[index]
            since[row] = step
        else:
            rows.append([index])
            room.append(capacity - sizes[index])
            since.append(step)
    return rows


def test_rows_follow_best_fit_decreasing_deterministically():
    processor = VisionTransformerImageProcessor(max_num_patches=16, patch_size=8, packed_sequence_length=24)
    packed = processor(images(), return_tensors="pt")
    sizes = packed["spatial_shapes"].prod(1).tolist()
    assert rows_of(packed) == best_fit_decreasing_by_hand(sizes, 24)
    assert all(torch.equal(packed[name], value) for name, value in processor(images(), return_tensors="pt").items())
    # the rows do not depend on the images' order, only which image sits where does
    order = [3, 0, 8, 1, 7, 2, 6, 4, 5]
    shuffled = processor([images()[i] for i in order], return_tensors="pt")
    assert torch.equal(shuffled["spatial_shapes"], packed["spatial_shapes"][order])
    assert sorted(sorted(sizes[order[i]] for i in row) for row in rows_of(shuffled)) == sorted(
        sorted(sizes[i] for i in row) for row in rows_of(packed)
    )


def test_best_fit_decreasing_on_random_sizes():
    rng = np.random.default_rng(0)
    for _ in range(200):
        capacity = int(rng.integers(1, 50))
        sizes = rng.integers(1, capacity + 1, int(rng.integers(1, 30))).tolist()
        rows = best_fit_decreasing(sizes, capacity)
        assert rows == best_fit_decreasing_by_hand(sizes, capacity)
        assert sorted(i for row in rows for i in row) == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in row) <= capacity for row in rows)
        # no two rows could have been one: a row is opened only for an image no row had room for
        loads = sorted(sum(sizes[i] for i in row) for row in rows)
        assert len(loads) < 2 or loads[0] + loads[1] > capacity
    with pytest.raises(ValueError, match="Item 1 has size 9"):
        best_fit_decreasing([3, 9], 8)
    with pytest.raises(ValueError, match="capacity"):
        best_fit_decreasing([3], 0)


def test_packing_returns_numpy_and_lists_as_the_unpacked_batch_does():
    processor = VisionTransformerImageProcessor(max_num_patches=16, patch_size=8, packed_sequence_length=32)
    as_tensors = processor(images(), return_tensors="pt")
    as_numpy = processor(images(), return_tensors="np")
    as_lists = processor(images())
    for name, value in as_tensors.items():
        np.testing.assert_array_equal(as_numpy[name], value.numpy())
        assert len(as_lists[name]) == len(value)
        np.testing.assert_array_equal(np.stack(as_lists[name]), value.numpy())
    assert as_tensors["image_slot_index"].dtype == torch.long


def test_packing_is_saved_reloaded_and_overridden_per_call(tmp_path):
    processor = VisionTransformerImageProcessor(max_num_patches=16, patch_size=8, packed_sequence_length=40)
    processor.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "preprocessor_config.json").read_text())["packed_sequence_length"] == 40
    reloaded = VisionTransformerImageProcessor.from_pretrained(tmp_path)
    assert (reloaded.max_num_patches, reloaded.packed_sequence_length) == (16, 40)
    first, again = processor(images(), return_tensors="pt"), reloaded(images(), return_tensors="pt")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert reloaded(images(), packed_sequence_length=20, return_tensors="pt")["pixel_values"].shape[1] == 20
    unpacked = VisionTransformerImageProcessor(max_num_patches=16, patch_size=8)
    unpacked.save_pretrained(tmp_path / "unpacked")
    assert VisionTransformerImageProcessor.from_pretrained(tmp_path / "unpacked").packed_sequence_length is None
    assert set(unpacked(images(), return_tensors="pt")) == {"pixel_values", "pixel_attention_mask", "spatial_shapes"}


def test_packing_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match=r"`packed_sequence_length` \(12\) must be at least `max_num_patches` \(16\)"):
        VisionTransformerImageProcessor(max_num_patches=16, packed_sequence_length=12)
    processor = VisionTransformerImageProcessor(max_num_patches=16, patch_size=8)
    with pytest.raises(ValueError, match=r"`packed_sequence_length` \(8\) must be at least `max_num_patches` \(16\)"):
        processor(images(), packed_sequence_length=8)
    with pytest.raises(ValueError, match="give `max_num_patches`"):
        VisionTransformerImageProcessor(packed_sequence_length=64)
    with pytest.raises(ValueError, match="`packed_sequence_length` must be a positive int"):
        processor(images(), packed_sequence_length=20.5)


def test_compiled_attention_takes_batches_of_other_runs_in_two_graphs():
    from torch._dynamo.utils import counters

    function = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)

    def attend(query, segments):
        return function(Attention(), query, query, query, segments, scaling=0.5)[0]

    counters.clear()
    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    for runs in (RUNS, [[4, 4], [6, 3], [1], [9]], [[9], [8], [2, 7], [3]]):
        query = torch.randn(1, 2, len(runs) * ROW, 4)
        segments = attention_segments(runs, ROW)
        keep = valid(runs)
        torch.testing.assert_close(compiled(query, segments)[keep], attend(query, segments)[keep])
    assert counters["stats"]["unique_graphs"] <= 2  # the first, then one whose number of images is dynamic


@torch.library.custom_op("hf_vit_tests::varlen_reference", mutates_args=())
def _varlen_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor, max_q: int, scale: float
) -> torch.Tensor:
    """A CPU stand-in for torch's `varlen_attn` custom op: attention per run, the runs given as data."""
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    assert max(lengths) <= max_q  # the kernels take a bound on the longest run
    VARLEN_MAXIMA.append(max_q)
    return per_run([query, key, value], lengths, scale)


@_varlen_reference.register_fake
def _(query, key, value, cu_q, max_q, scale):
    return torch.empty_like(query)


VARLEN_MAXIMA: list[int] = []


def test_compiled_varlen_takes_the_runs_as_data_and_the_rows_length_as_its_bound(monkeypatch):
    # On a GPU in half precision a model keeps varlen_attn (a custom op) compiled too: the runs travel as data, the
    # longest bounded by the row's length (a shape), so batches of other runs need no new graph once the number of
    # images is dynamic, and no call reads the longest run back.
    from torch._dynamo.utils import counters

    def varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None):
        return torch.ops.hf_vit_tests.varlen_reference(query, key, value, cu_q, max_q, scale)

    monkeypatch.setattr(attention, "varlen_attn", varlen)
    monkeypatch.setattr(attention, "segment_attention_path", lambda *args: "varlen")
    function = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)

    def attend(query, segments):
        return function(Attention(), query, query, query, segments, scaling=0.5)[0]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    batches = (RUNS, [[4, 4], [6, 3], [1], [9]], [[9], [8], [2, 7], [3]], [[2, 2, 2], [1, 1], [3], [4, 5]])
    for runs in batches:
        query = torch.randn(1, 2, len(runs) * ROW, 4, dtype=torch.float64)
        segments = attention_segments(runs, ROW)
        keep = valid(runs)
        VARLEN_MAXIMA.clear()
        expected = each_run_alone(query, query, query, runs)[keep]
        torch.testing.assert_close(compiled(query, segments)[keep], expected)
        assert VARLEN_MAXIMA == [ROW]
        torch.testing.assert_close(attend(query, segments)[keep], expected)
        assert VARLEN_MAXIMA == [ROW, ROW]
    # the first batch's graph, then one whose number of runs is dynamic: no graph per batch
    assert counters["stats"]["unique_graphs"] <= 2


def test_a_compiled_block_asks_the_gpus_capability_without_tracing_it(monkeypatch):
    # segment_attention_path runs inside each compiled block (fullgraph on the GPU): the capability is a constant there
    def capability(index=None):
        torch._dynamo.graph_break()  # what tracing torch.cuda's query would meet
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    attention._device_capability.cache_clear()
    try:
        doubled = torch.compile(lambda x: x * 2 if attention._flash_capable(0) else x, backend="eager", fullgraph=True)
        assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        attention._device_capability.cache_clear()


# ---- the packed layout in the model ----


def test_packed_layout_moves_tokens_between_one_image_per_row_and_the_stream_of_slots():
    processor = VisionTransformerImageProcessor(max_num_patches=16, patch_size=8)
    native = processor(images(), return_tensors="pt")
    packed = processor(images(), packed_sequence_length=24, return_tensors="pt")
    layout = layout_of(packed, 2)
    sizes = native["spatial_shapes"].prod(1)
    most = int(sizes.max())
    assert torch.equal(layout.unpack_patches(packed["pixel_values"]), native["pixel_values"][:, :most])
    assert torch.equal(layout.patch_mask, native["pixel_attention_mask"][:, :most].bool())
    rows = rows_of(packed)
    stream = len(rows) * 24 + 2 * len(SIZES)  # every slot, and each image's 2 prefix tokens
    assert layout.segments.blocks_shape == (1, stream)
    # the stream: row after row, each image's prefix tokens then its patches, the row's padding after its images
    prefix = torch.randn(1, 2, 5)
    slots = torch.randn(len(rows), 24, 5)
    blocks = layout.blocks_input(prefix, slots)[0]
    expected, runs = [], []
    for row, images_of_row in enumerate(rows):
        used = 0
        for image in images_of_row:
            expected += [prefix[0], slots[row, used : used + int(sizes[image])]]
            runs.append(2 + int(sizes[image]))
            used += int(sizes[image])
        expected.append(slots[row, used:])
        runs.append(24 - used)
    assert torch.equal(blocks, torch.cat(expected))
    assert [n for n in torch.diff(layout.segments.cu_seqlens).tolist() if n] == [n for n in runs if n]
    # the stream -> one image per row (2 prefix tokens + patches, zero beyond) -> the stream's tokens of images
    per_image = layout.unpack(blocks[None])
    for image in range(len(SIZES)):
        count = int(sizes[image])
        row, first = divmod(int(packed["image_slot_index"][image, 0]), 24)
        assert torch.equal(per_image[image, :2], prefix[0]) and torch.all(per_image[image, 2 + count :] == 0)
        assert torch.equal(per_image[image, 2 : 2 + count], slots[row, first : first + count])
    back = layout.segments.to_blocks(per_image, (1, stream))[0]
    held = layout.segments.token_images() < len(SIZES)  # the stream's tokens of images
    assert torch.equal(back[held], blocks[held]) and torch.all(back[~held] == 0)


def test_a_packed_layouts_slots_must_match_the_pixels():
    batch = pack_patches([torch.zeros(2, 3), torch.zeros(1, 3)], [(1, 2), (1, 1)], 4)
    layout = layout_of(batch, 1)
    with pytest.raises(ValueError, match=r"are \(1, 4, ...\) per patch slot; got \(1, 5, 3\)"):
        layout.unpack_patches(torch.zeros(1, 5, 3))
    with pytest.raises(ValueError, match=r"one per image patch \(2, 2\), as the outputs; got \(1, 4\)"):
        layout.to_slots(torch.zeros(1, 4, dtype=torch.bool), False)


def layout_of(batch, prefix, on_host=False):
    """The model's layout of a processor's packed batch, as a GPU has it (the stream with its padding) or `on_host`
    as a CPU in eager mode has it (without)."""
    with mock.patch.object(layout_module, "values_on_host", lambda device: on_host):
        return BatchLayout.of(batch["pixel_values"], batch["spatial_shapes"], prefix,
                              batch.get("pixel_attention_mask"), batch.get("image_slot_index"))  # fmt: skip


# ---- the model on packed batches ----

PACKED_SIZES = [(40, 40), (20, 80), (90, 30), (7, 200), (64, 48), (33, 33)]


def packed_and_alone(model, sizes=PACKED_SIZES, **call):
    """A packed batch of `sizes` (grids of at most 12 patches in rows of 24), the model on it, and on each image
    alone at its own size through the ordinary path."""
    patch = model.config.patch_size
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=patch)
    batch = images(sizes)
    inputs = processor(batch, packed_sequence_length=24, return_tensors="pt")
    assert max(len(row) for row in rows_of(inputs)) > 1  # images share rows
    with torch.no_grad():
        packed = model(**inputs, **call)
        alone = []
        for image, (rows, cols) in zip(batch, inputs["spatial_shapes"].tolist()):
            pixels = VisionTransformerImageProcessor(size=(rows * patch, cols * patch))(image, return_tensors="pt")
            alone.append(model(pixels["pixel_values"], interpolate_pos_encoding=True, **call))
    return inputs, packed, alone


def assert_each_image_alone(model, **call):
    inputs, packed, alone = packed_and_alone(model, **call)
    prefix = model.config.num_prefix_tokens
    sizes = inputs["spatial_shapes"].prod(1).tolist()
    assert packed.last_hidden_state.shape[:2] == (len(sizes), prefix + max(sizes))
    for image, (one, size) in enumerate(zip(alone, sizes)):
        tokens = packed.last_hidden_state[image, : prefix + size]
        torch.testing.assert_close(tokens, one.last_hidden_state[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(packed.pooler_output[image], one.pooler_output[0], atol=1e-4, rtol=0)
    return inputs, packed


@pytest.mark.parametrize("classifier", ["token", "gap", "map"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flex_attention"])
def test_each_packed_image_equals_the_image_alone(classifier, implementation):
    torch.manual_seed(0)
    config = tiny_config(classifier=classifier, attn_implementation=implementation)
    model = VisionTransformerForImageClassification(config).eval()
    with torch.no_grad():  # a non-zero head, so the logits say something
        model.classifier.weight.normal_()
    assert_each_image_alone(model.vit)
    inputs, packed, alone = packed_and_alone(model)
    assert packed.logits.shape == (len(PACKED_SIZES), config.num_labels) and packed.logits.std() > 0.1
    torch.testing.assert_close(packed.logits, torch.cat([one.logits for one in alone]), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "family",
    [
        dict(use_distillation_token=True, num_register_tokens=2, layer_scale_init_value=0.1, pre_norm=True),
        dict(classifier="gap", num_register_tokens=3, fc_norm=True, interpolation_mode="bilinear"),
        dict(classifier="map", use_class_token=False, num_register_tokens=1),
    ],
)
def test_the_family_blocks_on_packed_batches(family):
    # class, distillation and register tokens per image, LayerScale, pre-norm, fc_norm, pooling per image
    torch.manual_seed(0)
    assert_each_image_alone(VisionTransformerModel(tiny_config(attn_implementation="sdpa", **family)).eval())


def test_packed_gradients_equal_the_images_alone():
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(zero_init_head=False, attn_implementation="sdpa"))
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)
    batch, labels = images(PACKED_SIZES), torch.tensor([0, 1, 2, 3, 4, 0])
    inputs = processor(batch, packed_sequence_length=24, return_tensors="pt")
    model.train()
    model(**inputs, labels=labels).loss.backward()
    packed = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    for image, label, (rows, cols) in zip(batch, labels, inputs["spatial_shapes"].tolist()):
        pixels = VisionTransformerImageProcessor(size=(rows * 8, cols * 8))(image, return_tensors="pt")
        loss = model(pixels["pixel_values"], labels=label[None], interpolate_pos_encoding=True).loss
        (loss / len(batch)).backward()  # the packed loss is the mean over the images
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(packed[name], parameter.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert packed["vit.embeddings.position_embedding"].abs().sum() > 0


def with_empty_rows(inputs, where):
    """`inputs` (a packed batch) with an empty row (all padding) before each row of `where`, and one after the
    last: the rows a training batch of fixed rows is padded with."""
    rows, length = inputs["pixel_values"].shape[:2]
    order = [row for place in range(rows) for row in ([-1] if place in where else []) + [place]] + [-1]
    moved = torch.tensor([order.index(row) for row in range(rows)])  # each row's new place
    slots = inputs["image_slot_index"]
    new_slots = torch.where(slots >= 0, moved[slots.clamp(min=0) // length] * length + slots % length, -1)
    empty = torch.zeros_like(inputs["pixel_values"][:1])
    pixels = torch.cat([empty if row < 0 else inputs["pixel_values"][row : row + 1] for row in order])
    return {**inputs, "pixel_values": pixels, "image_slot_index": new_slots}


@pytest.mark.parametrize("drop", [False, True])  # with token dropping's places too
def test_empty_rows_change_no_output_and_no_gradient(drop):
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(zero_init_head=False, attn_implementation="sdpa"))
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)
    inputs = dict(processor(images(PACKED_SIZES), packed_sequence_length=24, return_tensors="pt"))
    if drop:  # each image keeps its patches but its first, in their places, packed again
        grids = [tuple(grid) for grid in inputs["spatial_shapes"].tolist()]
        slots, flat = inputs["image_slot_index"], inputs["pixel_values"].flatten(0, 1)
        kept = [torch.arange(1, rows * cols) for rows, cols in grids]
        inputs = pack_patches([flat[slots[image, places]] for image, places in enumerate(kept)], grids, 24, kept)
    padded = with_empty_rows(inputs, where={0, 2})
    assert padded["pixel_values"].shape[0] == inputs["pixel_values"].shape[0] + 3
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    results = []
    for batch in (inputs, padded):
        model.zero_grad()
        output = model(**batch, labels=labels, output_hidden_states=True)
        output.loss.backward()
        grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
        results.append((output, grads))
    (plain, plain_grads), (empty, empty_grads) = results
    torch.testing.assert_close(empty.logits, plain.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(empty.loss, plain.loss, atol=1e-6, rtol=0)
    for name, grad in plain_grads.items():
        assert torch.isfinite(empty_grads[name]).all(), name
        torch.testing.assert_close(empty_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_changing_one_packed_image_changes_no_other_and_order_does_not_matter():
    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config(attn_implementation="sdpa")).eval()
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8, packed_sequence_length=24)
    batch = images(PACKED_SIZES)
    with torch.no_grad():
        before = model(**processor(batch, return_tensors="pt")).pooler_output
        changed = list(batch)
        changed[2] = 255 - changed[2]
        after = model(**processor(changed, return_tensors="pt")).pooler_output
        order = [5, 2, 0, 4, 1, 3]
        shuffled = model(**processor([batch[i] for i in order], return_tensors="pt")).pooler_output
    others = [image for image in range(len(batch)) if image != 2]
    torch.testing.assert_close(after[others], before[others], atol=1e-6, rtol=0)
    assert (after[2] - before[2]).abs().max() > 1e-2
    torch.testing.assert_close(shuffled, before[order], atol=1e-5, rtol=0)


def test_attentions_of_a_packed_batch_stay_within_each_image():
    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config(attn_implementation="sdpa")).eval()
    inputs, packed, _ = packed_and_alone(model, output_attentions=True)  # each image alone: checked by the eager case
    tokens = layout_of(inputs, 1).token_mask
    assert len(packed.attentions) == model.config.num_hidden_layers
    for probs in packed.attentions:  # each image's, in a row of its own: none on another's tokens or the padding
        assert probs.shape == (len(tokens), 4, tokens.shape[1], tokens.shape[1])
        assert torch.all(probs.masked_select(~tokens[:, None, None, :]) == 0)


def test_backbone_maps_each_packed_image_as_the_native_batch_does():
    torch.manual_seed(0)
    backbone = VisionTransformerBackbone(tiny_config(out_indices=[1, 2])).eval()
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)
    batch = images(PACKED_SIZES)
    with torch.no_grad():
        native = backbone(**processor(batch, return_tensors="pt"), output_hidden_states=True)
        packed = backbone(
            **processor(batch, packed_sequence_length=24, return_tensors="pt"), output_hidden_states=True
        )
    for ours, theirs in zip(packed.feature_maps, native.feature_maps):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert packed.hidden_states[-1].shape[0] == len(batch)  # one image per row


def test_masked_patch_prediction_on_a_packed_batch():
    torch.manual_seed(0)
    config = tiny_config()
    model = VisionTransformerForMaskedPatchPrediction(config).eval()
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8)
    batch = images(PACKED_SIZES)
    native = processor(batch, return_tensors="pt")
    packed = processor(batch, packed_sequence_length=24, return_tensors="pt")
    generator = torch.Generator().manual_seed(0)
    # a [mask] and labels per patch slot of the packed rows, and the same per image for the native batch
    held = torch.zeros(packed["pixel_values"].shape[:2], dtype=torch.bool).view(-1)
    held[packed["image_slot_index"][packed["image_slot_index"] >= 0]] = True
    masked = (torch.rand(held.shape, generator=generator) < 0.4).view(-1, 24) & held.view(-1, 24)
    labels = torch.randint(0, config.mpp_num_classes, masked.shape, generator=generator)
    layout = layout_of(packed, config.num_prefix_tokens)
    with torch.no_grad():
        ours = model(**packed, bool_masked_pos=masked, labels=labels)
        patches = layout.patch_mask.shape[1]  # the most patches of an image: the native batch's padding beyond it
        theirs = model(
            native["pixel_values"][:, :patches], pixel_attention_mask=native["pixel_attention_mask"][:, :patches],
            spatial_shapes=native["spatial_shapes"], bool_masked_pos=layout.unpack_patches(masked),
            labels=layout.unpack_patches(labels),
        )  # fmt: skip
    assert ours.logits.shape == (len(batch), layout.patch_mask.shape[1], config.mpp_num_classes)
    keep = layout.patch_mask
    torch.testing.assert_close(ours.logits[keep], theirs.logits[keep], atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    # training draws the corruption per image, never on the padding
    model.train()
    out = model(**packed, labels=labels)
    out.loss.backward()
    assert out.patch_corruption.shape == keep.shape and torch.all(out.patch_corruption[~keep] == PATCH_CLEAN)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_packed_batches_train_with_activation_checkpointing_and_bf16_autocast(use_reentrant):
    torch.manual_seed(0)
    config = tiny_config(zero_init_head=False, attn_implementation="sdpa")
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8, packed_sequence_length=24)
    inputs, labels = processor(images(PACKED_SIZES), return_tensors="pt"), torch.tensor([0, 1, 2, 3, 4, 0])
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = VisionTransformerForImageClassification(config).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model(**inputs, labels=labels).loss.backward()
        grads.append([parameter.grad for parameter in model.parameters()])
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the runs through the matmul attention of CPU training
            low = model(**inputs, labels=labels)
        assert low.logits.shape == (len(PACKED_SIZES), config.num_labels) and torch.isfinite(low.loss)
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=1e-5)


def test_blocks_compiled_alone_take_cpu_packed_batches_of_any_image_count_in_the_same_graphs():
    # the layout made in eager mode on CPU (the stream without its padding, the runs' lengths read), the blocks
    # compiled alone (as the benchmarks' --compile_blocks): a graph must not depend on the number of images
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config(attn_implementation="sdpa")).eval()
    processor = VisionTransformerImageProcessor(max_num_patches=12, patch_size=8, packed_sequence_length=24)
    batches = [processor(images(PACKED_SIZES[:count]), return_tensors="pt") for count in (6, 2, 3, 4, 5)]
    with torch.no_grad():
        eager = [model(**batch).pooler_output for batch in batches]
        counters.clear()
        for block in model.layers:
            block.compile(backend="eager")
        graphs = []
        for batch, expected in zip(batches, eager):
            torch.testing.assert_close(model(**batch).pooler_output, expected, atol=1e-5, rtol=1e-5)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[-1], graphs  # none after the first sizes: the runs' count is no guard


def test_the_model_through_the_varlen_branch_equals_the_images_alone(monkeypatch):
    # The CUDA branch's data flow on CPU: the model's qkv views flattened to (tokens, heads, d_h), the runs' cumulative
    # lengths and host maxima handed to varlen_attn (here a reference computing attention per run), the output viewed
    # back: each packed image still equals the image alone.
    calls = []

    def fake_varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None):
        assert cu_q.dtype == torch.int32 and type(max_q) is int and query.shape == key.shape == value.shape
        calls.append(cu_q)
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        return per_run([query, key, value], lengths, scale)

    monkeypatch.setattr(attention, "varlen_attn", fake_varlen)
    monkeypatch.setattr(attention, "segment_attention_path", lambda *args: "varlen")
    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config(attn_implementation="sdpa", num_register_tokens=1)).eval()
    assert_each_image_alone(model)
    assert len(calls) >= model.config.num_hidden_layers


def test_flex_attention_without_a_varlen_kernel_is_handed_to_sdpa(monkeypatch):
    # the GPU's fp32 path and the compiled one: each image's row goes to SDPA, not to flex attention's kernels
    monkeypatch.setattr(attention, "segment_attention_path", lambda *args: "images")
    buffer, (query, key, value) = qkv()
    function = ALL_ATTENTION_FUNCTIONS.get_interface("flex_attention", None)
    output, _ = function(Attention(), query, key, value, attention_segments(RUNS, ROW), scaling=4**-0.5)
    keep = valid()
    torch.testing.assert_close(output[keep], each_run_alone(query, key, value)[keep], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("classifier", ["token", "gap", "map"])
def test_dropped_tokens_take_no_part_and_the_kept_ones_keep_their_places(classifier):
    # NaViT's token dropping: each image keeps some places of its grid; its pooled output is that of its kept tokens
    # alone (embedded on the whole grid, then the others removed), whatever the rows and the other images hold

    torch.manual_seed(0)
    config = tiny_config(image_size=8, patch_size=4, classifier=classifier, num_register_tokens=1)
    model = VisionTransformerModel(config).eval()
    grids = [(2, 3), (3, 3), (1, 2), (2, 2)]
    width, prefix = 4 * 4 * 3, config.num_prefix_tokens
    images = [torch.randn(rows * cols, width) for rows, cols in grids]
    generator = torch.Generator().manual_seed(1)
    kept = [torch.randperm(len(image), generator=generator)[: max(1, len(image) // 2)] for image in images]
    batch = pack_patches([image[places] for image, places in zip(images, kept)], grids, 8, positions=kept)
    assert batch["pixel_values"].shape[0] < len(images)  # the kept patches of several images share a row
    with torch.no_grad():
        pooled = model(**batch).pooler_output
        for index, (image, grid, places) in enumerate(zip(images, grids, kept)):
            layout = model.batch_layout(image[None], spatial_shapes=torch.tensor([grid]))
            tokens = model.embeddings(image[None], None, layout, None)
            tokens = model.pre_norm(tokens[:, torch.cat([torch.arange(prefix), prefix + places])])
            for block in model.layers:
                tokens, _ = block(tokens, False, None)
            alone = model.pool(model.norm(tokens), torch.ones(tokens.shape[:2], dtype=torch.bool))
            torch.testing.assert_close(pooled[index], alone[0], atol=1e-5, rtol=1e-4)
        # keeping every place (in any order) is the packed batch of the whole images
        every = [torch.randperm(len(image), generator=generator) for image in images]
        shuffled = pack_patches([image[places] for image, places in zip(images, every)], grids, 9, positions=every)
        whole = pack_patches(images, grids, 9)
        torch.testing.assert_close(model(**shuffled).pooler_output, model(**whole).pooler_output, atol=1e-5, rtol=1e-4)


def reference_layout(slots: torch.Tensor, length: int, grids: list, prefix: int, on_host: bool) -> dict:
    """The packed layout's stream computed image by image (the reference for `BatchLayout`'s tensor bookkeeping);
    `on_host`: the stream without its padding."""
    rows = -(-int(slots.max()) // length) if len(slots) else 0
    first = {image: int(row[row >= 0].min()) for image, row in enumerate(slots)}
    order = sorted(first, key=first.__getitem__)
    stream, image_tokens, runs, position = [], {}, [], 0
    for row in range(max(rows, max(value // length for value in first.values()) + 1)):
        slot = row * length
        for image in [image for image in order if first[image] // length == row]:
            kept = int((slots[image] >= 0).sum())
            stream += [("prefix", image, j) for j in range(prefix)] + [("slot", s) for s in range(slot, slot + kept)]
            runs.append(prefix + kept)
            image_tokens[image] = list(range(position, position + prefix)) + [
                position + prefix + int(s) - slot if s >= 0 else -1 for s in slots[image].tolist()
            ]
            position += prefix + kept
            slot += kept
        if not on_host:
            stream += [("slot", s) for s in range(slot, (row + 1) * length)]
            runs.append((row + 1) * length - slot)
            position += (row + 1) * length - slot
    return dict(stream=stream, image_tokens=[image_tokens[image] for image in range(len(slots))], runs=runs)


@pytest.mark.parametrize("prefix", [0, 1, 3])
@pytest.mark.parametrize("dropping", [False, True])
@pytest.mark.parametrize("on_host", [False, True])
def test_packed_layouts_equal_the_image_by_image_reference(prefix, dropping, on_host):
    # random batches: images of random grids best-fit-decreasing into rows; with token dropping each image keeps a
    # random subset of its places in a random order

    generator = torch.Generator().manual_seed(prefix + 10 * dropping)
    for trial in range(6):
        count = int(torch.randint(1, 30, (), generator=generator))
        grids = [tuple(int(v) for v in torch.randint(1, 5, (2,), generator=generator)) for _ in range(count)]
        images = [torch.zeros(rows * cols, 3) for rows, cols in grids]
        positions = None
        if dropping:
            positions = [torch.randperm(len(image), generator=generator) for image in images]
            positions = [places[: max(1, int(len(places) * 0.6))] for places in positions]
            images = [image[: len(places)] for image, places in zip(images, positions)]
        batch = pack_patches(images, grids, 20, positions)
        layout = layout_of(batch, prefix, on_host)
        expected = reference_layout(batch["image_slot_index"], 20, grids, prefix, on_host)
        every = [("prefix", image, j) for image in range(count) for j in range(prefix)]
        every += [("slot", s) for s in range(batch["pixel_values"].shape[0] * 20)]
        assert [every[i] for i in layout.block_source.tolist()] == expected["stream"], trial
        image_tokens = layout.segments.image_tokens.view(count, -1)
        assert image_tokens.tolist() == expected["image_tokens"], trial
        assert torch.equal(layout.token_mask, image_tokens >= 0)  # the tokens each image keeps
        # the runs: each row's images in order, then its padding (the empty runs aside)
        runs = torch.diff(layout.segments.cu_seqlens).tolist()
        assert [n for n in runs if n] == [n for n in expected["runs"] if n], trial
        assert layout.segments.run_lengths == (tuple(expected["runs"]) if on_host else None)


def test_stochastic_depth_drops_each_packed_image_whole_and_never_a_row_of_images_together():
    from hf_vit.model.modeling_vit import DropPath

    segments = attention_segments([[2, 3, 1], [4, 4], [1] * 9, [9]], prefix=1)
    images = segments.token_images()
    drop = DropPath(0.5).train()
    torch.manual_seed(0)
    kept = drop(torch.ones(1, len(images), 2), segments)[0, :, 0]
    per_image = [set(kept[images == image].tolist()) for image in range(int(images.max()))]
    assert all(len(values) == 1 for values in per_image)  # each image's tokens kept or dropped together
    assert {value for values in per_image for value in values} == {0.0, 2.0}  # some kept (scaled), some dropped
    assert not drop.eval()(torch.ones(1, len(images), 2), segments).eq(1).logical_not().any()
