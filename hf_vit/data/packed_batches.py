"""Packed training batches with a fixed number of tokens (NaViT's "Patch n' Pack", TRL's `packing=True`): every batch
is `rows` rows of `L` patch slots and holds as many whole images as fill them, so the number of images per batch
varies, not its shape.

`planned_patches` reads each training image's size cheaply (an encoded image's header, its pixels undecoded; a
decoded one's shape) and gives its number of patches: its native-aspect grid at `max_num_patches`
(`grid_for_max_patches`, the processor's choice) and, with token dropping, the number kept (`kept_patch_count`: fixed
by the grid, only which patches is drawn). `PackedBatchSampler` plans each epoch from those numbers:

1. the images in an order drawn from `(seed, epoch)`;
2. packed into rows of `L` slots by best-fit decreasing (largest first, ties in that order; each into the row it
   leaves the least room in): close to the fewest rows, and how many depends on the images' patch counts only, so it
   is the same every epoch (filling batches in the drawn order until the next image does not fit would make the
   number of batches depend on the order, and Trainer counts epochs, schedules and resumption in batches);
3. the rows in an order drawn from `(seed, epoch)`, dealt `rows` to a batch; the epoch's last batch may hold fewer
   rows (on `P` processes, the last `P` batches share what is left, each at least one row).

So every image is in exactly one batch per epoch, each full batch is `rows` rows, and the number of batches per epoch
(`len`) is known before training. Each key the sampler yields is `(index, budget, row)`: the training split
(`SeededAugmentation`) fetches image `index` at a patch budget of `budget` (its planned grid's patches: a random crop
of it is resized to at most that many at the crop's own aspect ratio, so no image takes more slots than planned) and
marks the example with its `row` in the batch, where the collator (`transforms.collate_fn` with `packed_rows`) packs
it, padding the batch with empty rows to `rows`. Batches are dealt out whole, as accelerate's `BatchSamplerShard`
deals a batch sampler without a batch size: process `r` trains the `r`-th of every `P` consecutive batches.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ..model.image_processing_vit import best_fit_decreasing, grid_for_max_patches, load_images
from .augment.train_transform import kept_patch_count
from .seeding import seeded_generator
from .transforms import BatchSizes, decode_image, header_size

# The padding share of padded native-aspect batches from which packed rows trained faster on CPU (measured with
# benchmarks/packing_speed.py: docs/training.md, "When packing pays").
CPU_PACKING_BREAK_EVEN = 0.05


def image_size(image: Any) -> tuple[int, int]:
    """`(height, width)` of a data set image: an encoded one's from its header (its EXIF orientation not applied: a
    PNG's may sit after its pixels, and turning swaps a grid's rows and columns, not its number of patches), decoded
    pixels as the processor converts them. A `CorruptImageError` names a file that cannot be opened."""
    if (size := header_size(image)) is not None:
        return size
    (pixels,) = load_images(decode_image(image), do_convert_rgb=False)  # decoded images, and remote files
    return int(pixels.shape[1]), int(pixels.shape[2])


def planned_patches(
    images: Iterable[Any], patch_size: int, max_num_patches: int, token_drop_rate: float = 0.0
) -> tuple[list[int], list[int]]:
    """For each image (`image_size`'s input): its patch budget (its native-aspect grid's patches at
    `max_num_patches`) and the slots it takes in a packed row (that many, or with `token_drop_rate` the number token
    dropping keeps of them)."""
    budgets, counts = [], []
    for image in images:
        rows, cols = grid_for_max_patches(*image_size(image), patch_size, max_num_patches)
        budgets.append(rows * cols)
        counts.append(kept_patch_count(rows * cols, token_drop_rate))
    return budgets, counts


def padding_shares(
    counts: Sequence[int],
    max_num_patches: int,
    batch_size: int,
    packed_sequence_length: int | None,
    seed: int = 0,
    rows: int | None = None,
) -> tuple[float, float | None]:
    """The share of patch slots that hold no patch, for images of `counts` patches: in padded native-aspect batches of
    `batch_size` images in an order drawn from `seed` (each batch padded to its largest image, as the collator pads),
    and, with `packed_sequence_length`, in rows of that many slots packed best-fit decreasing (as
    `PackedBatchSampler` packs them, or into `rows` rows where a plan has counted them already; None without)."""
    if not counts:
        return 0.0, None
    order = torch.randperm(len(counts), generator=torch.Generator().manual_seed(seed)).tolist()
    slots = sum(
        len(chunk) * max(counts[i] for i in chunk)
        for chunk in (order[start : start + batch_size] for start in range(0, len(order), batch_size))
    )
    padded = 1 - sum(counts) / slots
    if packed_sequence_length is None:
        return padded, None
    rows = rows or len(best_fit_decreasing(counts, packed_sequence_length))
    return padded, 1 - sum(counts) / (rows * packed_sequence_length)


class PackedBatchSampler:
    """The module docstring's plan. `counts`: the slots each image takes; `budgets`: the patch budget each is fetched
    at (default: `counts`); `dataset`: the training split, whose shared `epoch` chooses the epoch's plan;
    `drop_partial`: leave out the epoch's last batches when they are not full (their images wait for another epoch)."""

    batch_size = None  # the images per batch vary: accelerate deals such batches out whole, one per process
    drop_last = True  # the batches are a multiple of the processes: nothing for accelerate to cycle in

    def __init__(
        self,
        counts: Sequence[int],
        rows: int,
        packed_sequence_length: int,
        seed: int,
        num_processes: int = 1,
        *,
        budgets: Sequence[int] | None = None,
        dataset: Any = None,
        drop_partial: bool = False,
    ) -> None:
        if not counts:
            raise ValueError("Packed batches need at least one training image.")
        if rows < 1 or num_processes < 1:
            raise ValueError(f"Need at least one row per batch and one process, got {rows} and {num_processes}.")
        self.counts, self.budgets = list(counts), list(counts if budgets is None else budgets)
        if len(self.budgets) != len(self.counts) or any(c > b for c, b in zip(self.counts, self.budgets)):
            raise ValueError("`budgets` must give each image at least the slots it takes (`counts`).")
        self.rows, self.packed_sequence_length, self.seed = rows, packed_sequence_length, seed
        self.num_processes, self.dataset, self.drop_partial = num_processes, dataset, drop_partial
        # The rows' number depends on the counts only: one packing tells every epoch's.
        self.num_rows = len(best_fit_decreasing(self.counts, packed_sequence_length))
        self.rows_per_batch = self._rows_per_batch()
        # With full batches only, which images the rows left out hold varies per epoch, and so their number.
        whole = not drop_partial or sum(self.rows_per_batch) == self.num_rows
        self.num_images = len(self.counts) if whole else None

    def _rows_per_batch(self) -> list[int]:
        """How many rows each batch of an epoch holds (the last round's share what is left, evenly)."""
        processes, full = self.num_processes, self.rows
        if self.drop_partial:
            rounds = self.num_rows // (full * processes)
            if rounds == 0:
                raise ValueError(
                    f"--dataloader_drop_last: the training images fill {self.num_rows} rows of "
                    f"{self.packed_sequence_length} slots, not one batch of {full} rows per process ({processes})."
                )
            return [full] * (rounds * processes)
        batches = processes * math.ceil(self.num_rows / (full * processes))
        if batches > len(self.counts):  # a row of each image is the most rows there can be
            raise ValueError(
                f"The {len(self.counts)} training images cannot fill {batches} batches, one per process ({processes}) "
                "in each round: use fewer processes or more images."
            )
        sizes, excess = [full] * batches, batches * full - max(self.num_rows, batches)
        for start in range(batches - processes, -1, -processes):  # the last round first
            take = min(excess, processes * (full - 1))
            for offset in range(processes):
                sizes[start + offset] -= take // processes + (offset < take % processes)
            excess -= take
        return sizes

    def __len__(self) -> int:
        return len(self.rows_per_batch)

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """The batches of `epoch`, each a list of rows, each the list of its images' indices."""
        images = seeded_generator(self.seed, "packed images", epoch)
        order = torch.randperm(len(self.counts), generator=images).tolist()
        rows = best_fit_decreasing(self.counts, self.packed_sequence_length, order)
        shuffled = torch.randperm(len(rows), generator=seeded_generator(self.seed, "packed rows", epoch)).tolist()
        rows = [rows[number] for number in shuffled]
        # Fewer rows than batches (a handful of images on several processes): rows of several images give one away.
        while len(rows) < len(self.rows_per_batch):
            splittable = next(number for number in range(len(rows) - 1, -1, -1) if len(rows[number]) > 1)
            rows.append([rows[splittable].pop()])
        ends = itertools.accumulate(self.rows_per_batch)
        return [rows[end - size : end] for size, end in zip(self.rows_per_batch, ends)]

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        epoch = int(getattr(self.dataset, "epoch", 0))
        for batch in self.plan(epoch):
            yield [(index, self.budgets[index], row) for row, images in enumerate(batch) for index in images]

    def num_images_per_row(self) -> float:
        """The mean number of images per row (every image is planned into one)."""
        return len(self.counts) / self.num_rows

    def images_per_batch(self) -> float | None:
        """The mean number of images per batch, the same every epoch (None where it varies: `drop_partial` leaving out
        rows)."""
        return None if self.num_images is None else self.num_images / len(self)


# The training images whose sizes estimate a padded run's padding share (reading every header of a large data set
# would add a minute to the start of a run for one log line).
PADDING_SAMPLE_IMAGES = 4096


def training_patches(
    train,
    processor,
    sizes: BatchSizes,
    token_drop_rate: float,
    sample: int | None = None,
    seed: int = 0,
) -> tuple[list[int], list[int]]:
    """Each training image's patch budget and the patch slots it takes (`planned_patches`, from its size), for a
    training split whose examples' `image` column `train.data` holds; of `sample` images drawn from `seed` where the
    split has more."""
    images = train.data.select_columns(["image"])
    if sample is not None and len(images) > sample:
        images = images.select(
            torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:sample].tolist()
        )
    chunks = (images[start : start + 1024]["image"] for start in range(0, len(images), 1024))
    return planned_patches(
        (image for chunk in chunks for image in chunk), processor.patch_size, sizes.max_num_patches, token_drop_rate
    )


def padding_line(counts: list[int], sizes: BatchSizes, batch_size: int, seed: int, rows: int | None = None) -> str:
    """The log line that says how much of a native-aspect run's patch slots are padding, padded and packed, and
    whether packing pays at that share by the measured break-even (on CPU; docs/training.md)."""
    packed_length = sizes.packed_sequence_length or 4 * sizes.max_num_patches  # what packing would give, unpacked
    padded, packed = padding_shares(counts, sizes.max_num_patches, batch_size, packed_length, seed, rows)
    shares = (
        f"Padding: padded native-aspect batches of {batch_size} images would leave {padded:.0%} of their patch slots "
        f"empty, rows of {packed_length} packed slots {packed:.0%}"
    )
    pays = padded >= CPU_PACKING_BREAK_EVEN
    if sizes.packed_sequence_length is None:
        advice = "--packed_sequence_length would pay" if pays else "packing would not pay"
    else:
        advice = "packing pays" if pays else "packing does not pay: leave out --packed_sequence_length"
    return (
        f"{shares}; on CPU {advice} here (it trained faster from about {CPU_PACKING_BREAK_EVEN:.0%} padding; on a GPU "
        "through variable-length attention: docs/training.md, 'When packing pays')."
    )
