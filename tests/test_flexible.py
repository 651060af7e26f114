"""Sizes drawn per batch: sequence lengths with a token budget (`--seq_lens`) and FlexiViT's patch sizes
(`--patch_sizes`). Exact resumption and two processes run in the combination matrix and the resume tests."""

import copy
from collections import Counter

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from conftest import tiny_config

from hf_vit import VisionTransformerForImageClassification
from hf_vit.flags import parse_sizes
from hf_vit.train.flexible import PatchSizeDraw, SeqLenBatchSampler, at_patch_size
from hf_vit.train.trainer import SeededAugmentation


def test_seq_len_batches_follow_the_budget_and_every_process_trains_a_step_at_one_length():
    data = SeededAugmentation(list(range(50)), seed=0)
    sampler = SeqLenBatchSampler(data, [4, 16, 36], max_tokens_per_batch=72, seed=3, num_processes=2)
    assert [sampler.batch_size_for(s) for s in (4, 16, 36)] == [18, 4, 2]  # budget // length
    # accelerate deals the batches out: process r gets the r-th of every 2
    shards = [list(BatchSamplerShard(sampler, 2, rank)) for rank in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == len(sampler) // 2 == len(sampler.schedule)
    lengths = sampler.seq_lens_of_epoch(0)
    for step, (first, second) in enumerate(zip(*shards)):
        assert {s for _, s in first} == {s for _, s in second} == {lengths[step]}
        assert len(first) == len(second) == 72 // lengths[step]
    seen = [index for shard in shards for batch in shard for index, _ in batch]
    assert set(seen) == set(range(50))  # every example in the epoch (the last step filled from its first ones)
    assert len(set(lengths)) > 1
    # every epoch: the same steps (Trainer counts on it), in another order; fixed by the seed alone
    data.set_epoch(1)
    assert sorted(sampler.seq_lens_of_epoch(1)) == sorted(lengths) and sampler.seq_lens_of_epoch(1) != lengths
    assert [{s for _, s in batch} for batch in list(sampler)[::2]] == [{s} for s in sampler.seq_lens_of_epoch(1)]
    again = SeqLenBatchSampler(data, [4, 16, 36], 72, seed=3, num_processes=2)
    assert list(again) == list(sampler)
    other = SeqLenBatchSampler(data, [4, 16, 36], 72, seed=4, num_processes=2)
    assert other.seq_lens_of_epoch(1) != sampler.seq_lens_of_epoch(1)
    with pytest.raises(ValueError, match="--seq_lens takes distinct positive"):
        parse_sizes("64,0", "--seq_lens")


def test_patch_sizes_are_drawn_per_step_reproducibly_with_their_weights():
    draw = PatchSizeDraw([4, 8, 16], None, seed=0)
    sizes = [draw(step) for step in range(300)]
    assert sizes == [PatchSizeDraw([4, 8, 16], None, seed=0)(step) for step in range(300)]  # every process, resumed
    assert sizes != [PatchSizeDraw([4, 8, 16], None, seed=1)(step) for step in range(300)]
    assert all(70 < count < 130 for count in Counter(sizes).values()) and set(sizes) == {4, 8, 16}
    weighted = Counter(PatchSizeDraw([4, 8, 16], [0.0, 1.0, 3.0], seed=0)(step) for step in range(400))
    assert weighted[4] == 0 and 3 * weighted[8] < weighted[16] * 1.5 and weighted[16] > 250


def test_a_step_at_another_patch_size_is_the_resampled_model_and_trains_the_stored_kernel():
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(tiny_config(zero_init_head=False)).train()
    model.config.hidden_dropout_prob = 0.0
    stored = model.vit.embeddings.patch_embedding
    x = torch.randn(2, 3, 32, 32)
    for patch in (4, 16):
        expected = copy.deepcopy(model).eval()
        expected.set_input_size(patch_size=patch)  # what from_pretrained(folder, patch_size=P) gives
        model.zero_grad()
        with at_patch_size(model, patch):
            assert model.config.patch_size == patch
            logits = model(x, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(logits, expected(x).logits, atol=1e-5, rtol=1e-5)
        logits.square().sum().backward()
        # the gradient reaches the stored kernel (through the pseudo-inverse resize) and the stored position grid
        assert stored.weight.grad.abs().sum() > 0 and model.vit.embeddings.position_embedding.grad.abs().sum() > 0
        assert model.vit.embeddings.patch_embedding is stored and model.config.patch_size == 8
        assert model.config.image_size == 32 and stored.weight.shape == (32, 3, 8, 8)
    with pytest.raises(ValueError, match="not divisible by the patch size 12"):
        from hf_vit.train.flexible import check_patch_sizes

        check_patch_sizes([8, 12], 32)


def test_fine_tuning_with_patch_sizes_saves_the_base_patch_and_loads_at_each(tmp_path):
    from test_training import QUIET, pretrained_folder

    from hf_vit.train.arguments import parse_args
    from hf_vit.train.training import train

    source = pretrained_folder(tmp_path / "pre")  # 8x8 images, patch 4
    flags = ["--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(source), "--learning_rate", "0.1"]
    flags += ["--max_steps", "4", "--eval_strategy", "no", "--save_strategy", "no", "--max_train_samples", "16"]
    flags += ["--per_device_train_batch_size", "4", "--patch_sizes", "2,4,8", "--patch_size_probs", "1,0,1", *QUIET]
    flags += ["--per_device_eval_batch_size", "120", "--check_eval_images", "False"]
    train("finetune", *parse_args("finetune", flags))
    trained = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out").eval()
    start = VisionTransformerForImageClassification.from_pretrained(source)
    assert trained.config.patch_size == 4 and trained.vit.embeddings.patch_embedding.weight.shape == (32, 3, 4, 4)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "a patch size drawn per step from 2,4,8 (weights 1,0,1)" in card
    # the steps ran at 2 and 8 only (weight 0 for 4), and trained the stored kernel through the resize
    assert not torch.equal(trained.vit.embeddings.patch_embedding.weight, start.vit.embeddings.patch_embedding.weight)
    x = torch.randn(3, 3, 8, 8)
    for patch in (2, 8):
        loaded = VisionTransformerForImageClassification.from_pretrained(tmp_path / "out", patch_size=patch).eval()
        with torch.no_grad(), at_patch_size(trained, patch):
            torch.testing.assert_close(
                trained(x, interpolate_pos_encoding=True).logits, loaded(x).logits, atol=1e-5, rtol=1e-5
            )
    # the compute dial at the end of the run: the accuracy at each trained patch size, on whole images, as an
    # evaluation here of the folder loaded at that patch size measures it; the plot linked in the card
    import json

    from conftest import measure_model

    from hf_vit import VisionTransformerImageProcessor
    from hf_vit.data.datasets import DataSource

    rows = json.loads((tmp_path / "out" / "compute_dial.json").read_text())
    assert [(row["series"], row["patch_size"], row["tokens_per_image"]) for row in rows] == [
        ("patch_size", 2, 16), ("patch_size", 4, 4), ("patch_size", 8, 1)
    ]  # fmt: skip
    processor = VisionTransformerImageProcessor.from_pretrained(tmp_path / "out")
    for row in rows:
        folder, patch = tmp_path / "out", row["patch_size"]
        loaded = VisionTransformerForImageClassification.from_pretrained(folder, patch_size=patch).eval()
        split, measured = measure_model(loaded, processor, DataSource(), None, 512)
        assert row["split"] == split and row["accuracy"] == pytest.approx(measured["accuracy"])
    assert (tmp_path / "out" / "compute_dial.png").exists() and "![compute dial](compute_dial.png)" in card
    for more, named in (
        (["--patch_size_probs", "1,1"], "--patch_size_probs '1,1' must give one non-negative weight per size"),
        (["--max_num_patches", "4"], "--patch_sizes with --max_num_patches"),
        (["--max_tokens_per_batch", "8"], "--max_tokens_per_batch sizes the batches of --seq_lens"),
    ):
        with pytest.raises(ValueError, match=named):
            parse_args("finetune", flags + more)
    with pytest.raises(ValueError, match="--max_tokens_per_batch 30 is below the longest of --seq_lens"):
        parse_args("finetune", flags[:6] + ["--seq_lens", "4,36", "--max_tokens_per_batch", "30"])
    with pytest.raises(ValueError, match="--seq_lens with --streaming"):
        parse_args("finetune", flags[:6] + ["--seq_lens", "4,16", "--streaming", "True", "--max_steps", "2"])
    for flag, value in (("--max_num_patches", "100000"), ("--seq_lens", "16,70000")):  # over the 65,536 positions
        with pytest.raises(ValueError, match=f"{flag} {value.split(',')[-1]} is over the 65536 patch positions"):
            parse_args("finetune", flags[:6] + [flag, value])
