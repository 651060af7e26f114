"""The image classification data sets a run trains and evaluates on.

Data sets: `load_image_dataset(name)` returns a `DatasetDict` (an `IterableDatasetDict` with `streaming=True`) with
the splits `train`, `validation` and, when the source has one, `test`. Every split has exactly two columns: `image`
(a `datasets.Image`) and `label` (a `datasets.ClassLabel`, so `label_names(ds)` gives `id2label`). `name` is one of:

* `"digits"`: scikit-learn's 1797 bundled 8x8 handwritten digits (no download), see `load_digits_dataset`;
* a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (read with `datasets.load_from_disk`);
* any other local directory: an image folder, `root/<label>/<file>` or `root/<split>/<label>/<file>`, read with
  datasets' `imagefolder` builder (labels are the folder names);
* otherwise a data set on the Hugging Face Hub (`datasets.load_dataset(name)`, needs network or the local cache).

A missing validation split is carved out of train (`_carve_validation`); a streamed train split is shuffled through a
buffer (an image folder is otherwise read class after class).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import PIL.Image
from datasets import ClassLabel, Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from huggingface_hub.errors import HFValidationError

from ..hub_access import hub_unreachable_reason, lookup_error, offline_mode

logger = logging.getLogger(__name__)

# The draw of the validation split carved out of a train split (`_carve_validation`): fixed, so that a run, its
# evaluation and a resized variant's measurement hold out the same images.
HELD_OUT_SEED = 0
DIGITS_SPLIT_SIZES = {"train": 1257, "validation": 180, "test": 360}
"""Sizes of the fixed, stratified digits splits (70/10/20 % of 1797)."""

_DIGITS_SPLIT_SEED = 0


def load_digits_dataset(seed: int = 0) -> DatasetDict:
    """scikit-learn's digits (8x8 grey, 0..16 scaled to 0..255) in fixed stratified splits of `DIGITS_SPLIT_SIZES`;
    `seed` only shuffles the rows inside each split."""
    # scikit-learn is imported here, not with the module: it costs every process that trains on other data a second
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    rest, test = train_test_split(
        np.arange(len(labels)), test_size=DIGITS_SPLIT_SIZES["test"], stratify=labels, random_state=_DIGITS_SPLIT_SEED
    )
    train, validation = train_test_split(
        rest, test_size=DIGITS_SPLIT_SIZES["validation"], stratify=labels[rest], random_state=_DIGITS_SPLIT_SEED
    )
    features = datasets.Features({"image": datasets.Image(), "label": ClassLabel(names=[str(d) for d in range(10)])})
    rng = np.random.default_rng(seed)
    splits = {}
    for split, indices in (("train", train), ("validation", validation), ("test", test)):
        indices = rng.permutation(np.sort(indices))
        images = [PIL.Image.fromarray(pixels[i]) for i in indices]
        splits[split] = Dataset.from_dict({"image": images, "label": labels[indices]}, features=features)
    return DatasetDict(splits)


def load_image_dataset(
    name: str,
    *,
    image_column: str = "image",
    label_column: str = "label",
    streaming: bool = False,
    train_split: str = "train",
    validation_split: str = "validation",
    test_split: str = "test",
    validation_fraction: float = 0.1,
    seed: int = 0,
    cache_dir: str | None = None,
    shuffle_buffer_size: int = 1000,
) -> DatasetDict | IterableDatasetDict:
    """The data set `name` (see the module docstring), its source columns and splits renamed and the others dropped.
    String labels become `ClassLabel` ids in sorted name order, integer labels without names get the names "0".."max"
    (negative integers are refused)."""
    if shuffle_buffer_size < 0:
        raise ValueError(f"--shuffle_buffer_size must be 0 (no shuffling) or positive, got {shuffle_buffer_size}.")
    path = os.path.expanduser(name)
    if name == "digits":
        ds = load_digits_dataset(seed)
    elif os.path.isdir(path) and _is_saved_dataset(path):
        ds = datasets.load_from_disk(path)
        ds = DatasetDict({train_split: ds}) if isinstance(ds, Dataset) else ds
    elif os.path.isdir(path):
        folder = dict(data_dir=path, streaming=streaming, cache_dir=cache_dir)
        ds = datasets.load_dataset("imagefolder", **folder)
        if label_column == "label" and "label" not in (next(iter(ds.values())).column_names or ["label"]):
            # The builder drops the labels of a folder with one class folder: read them, so that the run refuses one
            # class as such rather than as a missing column.
            ds = datasets.load_dataset("imagefolder", **folder, drop_labels=False)
    else:
        ds = _load_from_hub(name, streaming=streaming, cache_dir=cache_dir)

    splits = {"train": train_split, "validation": validation_split, "test": test_split}
    if train_split not in ds:
        raise ValueError(f"Data set {name!r} has no split {train_split!r} (it has {list(ds)}); choose train_split.")
    for split, chosen in splits.items():
        if split != "train" and chosen != split and chosen not in ds:  # named: never carved out of train
            renamed = (
                " (the datasets library names an image folder's `val` folder `validation`)" if chosen == "val" else ""
            )
            raise ValueError(
                f"Data set {name!r} has no split {chosen!r} (it has {list(ds)}){renamed}: choose --{split}_split "
                "among them."
            )
    ds = type(ds)({new: ds[old] for new, old in splits.items() if old in ds})
    ds = _standardize_columns(ds, name, image_column, label_column)
    if "validation" not in ds:
        ds = _carve_validation(ds, validation_fraction)
    ds = type(ds)({split: ds[split] for split in splits if split in ds})
    if streaming and isinstance(ds, DatasetDict):
        ds = IterableDatasetDict({split: d.to_iterable_dataset() for split, d in ds.items()})
    if isinstance(ds, IterableDatasetDict) and shuffle_buffer_size:
        # its shards in a random order, then each example drawn from the buffer; the order drawn from `seed + epoch`
        # (datasets' `set_epoch`, which Trainer calls): another each epoch, the same for every run with `seed`
        ds["train"] = ds["train"].shuffle(seed=seed, buffer_size=shuffle_buffer_size)
    return ds


@dataclass(frozen=True)
class DataSource:
    """Where a run's images come from and how its splits are cut: the values of the data set flags
    (`--dataset_name`, `--image_column_name`, ..., `--max_train_samples`), under their names."""

    dataset_name: str = "digits"
    image_column_name: str = "image"
    label_column_name: str = "label"
    train_split: str = "train"
    validation_split: str = "validation"
    test_split: str = "test"
    validation_fraction: float = 0.1
    streaming: bool = False
    shuffle_buffer_size: int = 1000
    max_train_samples: int | None = None
    # The images of each split as a run recorded them (`recorded_images`): the splits are then those images, found by
    # their paths in the image folder (`recorded_splits`), however the folder moved or changed since.
    recorded_images: dict[str, Any] | None = None


# The fields of a `DataSource` that decide which images fall in which split (what a run records, `split_record`).
SPLIT_FIELDS = (
    "dataset_name", "image_column_name", "label_column_name", "train_split", "validation_split", "test_split",
    "validation_fraction", "streaming",
)  # fmt: skip


def split_record(source: DataSource, seed: int) -> dict:
    """How `source`'s splits are made, as a run records it beside its model: the `SPLIT_FIELDS`, the run's seed, and
    the rule by which a validation split missing from the data set is carved out of train. A local folder is named by
    its last part (no path of this machine); an image folder's images are added by the run (`recorded_images`)."""
    if source.streaming:
        every = f"1/{source.validation_fraction:g}"
        rule = f"each example of the streamed train split whose index crosses a multiple of {every}, in order"
    else:
        rule = f"{source.validation_fraction:g} of train, stratified by label, drawn with seed {HELD_OUT_SEED}"
    record = {field: getattr(source, field) for field in SPLIT_FIELDS}
    fingerprint = local_data_set_fingerprint(source.dataset_name)
    if fingerprint is not None:  # a local folder: named by its last part (no path of this machine)
        record["dataset_name"] = os.path.basename(os.path.realpath(os.path.expanduser(source.dataset_name)))
    if image_folder_root(source.dataset_name) is None:  # an image folder is known by its images, not its path
        record["dataset_path_sha256"] = fingerprint
    return {**record, "seed": seed, "held_out_seed": HELD_OUT_SEED, "carved_validation": rule}


def local_data_set_fingerprint(dataset_name: str | None) -> str | None:
    """The SHA-256 of a local data set folder's resolved path (None for digits or a Hub id): how a record written
    beside a model knows a `save_to_disk` folder again (its rows have no file names) without naming a path."""
    local = os.path.expanduser(dataset_name or "")
    if dataset_name == "digits" or not os.path.isdir(local):
        return None
    return hashlib.sha256(os.path.realpath(local).encode()).hexdigest()


def image_folder_root(dataset_name: str | None) -> Path | None:
    """The resolved root of a local image folder data set; None for digits, a `save_to_disk` folder or a Hub id."""
    local = os.path.expanduser(dataset_name or "")
    if dataset_name == "digits" or not os.path.isdir(local) or _is_saved_dataset(local):
        return None
    return Path(os.path.realpath(local))


def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes: an image the run held out, known again wherever its folder went."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def image_names(data: Dataset | IterableDataset, root: Path) -> list[str]:
    """The paths of `data`'s image files relative to `root` (an image folder's, as its rows name them), in order;
    nothing is decoded, but by a stream's filter (the carved splits'), whose images then name their files."""
    files = data.select_columns(["image"]).cast_column("image", datasets.Image(decode=False))
    if isinstance(files, Dataset):  # read as one Arrow column: a row at a time costs seconds per 10,000 images
        paths = files.with_format("arrow")[:].column("image").combine_chunks().field("path").to_pylist()
    else:
        paths = [row["image"]["path"] if isinstance(row["image"], dict) else row["image"].filename for row in files]
    prefix = os.path.join(root, "")
    resolved = (path if path.startswith(prefix) else os.path.realpath(path) for path in paths)
    return [Path(os.path.relpath(path, root) if not path.startswith(prefix) else path[len(prefix) :]).as_posix()
            for path in resolved]  # fmt: skip


def recorded_images(raw: DatasetDict | IterableDatasetDict, root: Path) -> dict[str, Any]:
    """The images of each split of `raw` (read from the image folder at `root`), as a run records them: the training
    images by their paths relative to `root`, each held-out image (validation, test) by its path with its file's
    SHA-256, so that a moved folder still finds them and a changed one is told."""
    images: dict[str, Any] = {}
    for split, data in raw.items():
        names = image_names(data, root)
        images[split] = names if split == "train" else {name: file_digest(root / name) for name in names}
    return images


def recorded_splits(source: DataSource) -> DatasetDict:
    """The splits of the run that recorded `source.recorded_images`, read from the image folder `source` names (moved
    or not): each split holds exactly the recorded images still there, a held-out one only with the bytes the run
    read. What was added to the folder, removed from it, or changed is said in one warning line."""
    root, recorded = image_folder_root(source.dataset_name), source.recorded_images or {}
    loaded = _load_source(source)
    every = datasets.concatenate_datasets(list(loaded.values()))  # whichever split the folder now holds them in
    names = image_names(every, root)
    rows: dict[str, list[int]] = {split: [] for split in recorded}
    position = {name: split for split, wanted in recorded.items() for name in wanted}
    changed = []
    for row, name in enumerate(names):
        split = position.get(name)
        if split is None:
            continue
        held_out = recorded[split]
        if isinstance(held_out, dict) and file_digest(root / name) != held_out[name]:
            changed.append(name)
        else:
            rows[split].append(row)
    removed = sorted(set(position) - set(names))
    added = sorted(set(names) - set(position))
    problems = [
        f"{what}: {', '.join(found[:10])}" + (f", ... ({len(found)} in all)" if len(found) > 10 else "")
        for what, found in (
            ("the run's images no longer there", removed),
            ("held-out images changed since the run read them (left out)", changed),
            ("images the run did not read (added since, or left out by it)", added),
        )
        if found
    ]
    if problems:
        counts = ", ".join(f"{split} {len(rows[split])} of {len(wanted)}" for split, wanted in recorded.items())
        logger.warning(
            "%s is not the folder the run read: %s. Its splits hold only the run's images still there (%s).",
            source.dataset_name, "; ".join(problems), counts,
        )  # fmt: skip
    return DatasetDict({split: every.select(chosen) for split, chosen in rows.items()})


def load_datasets(source: DataSource, seed: int):
    """The raw splits `source` names (columns `image` and `label`): those a run recorded, when `source` carries
    them (`recorded_splits`)."""
    if source.recorded_images is not None:
        return recorded_splits(source)
    options = {name: getattr(source, name) for name in ("streaming", "validation_fraction", "shuffle_buffer_size")}
    ds = _load_source(source, seed=seed, **options)
    if source.max_train_samples is not None and not source.streaming:
        ds["train"] = ds["train"].select(range(min(source.max_train_samples, len(ds["train"]))))
    return ds


_LISTS = (datasets.List, datasets.Sequence, datasets.LargeList)  # a list of classes per image (multi-label)


def _label_feature(ds: Dataset | IterableDataset | DatasetDict | IterableDatasetDict) -> Any:
    """The `label` column's feature (of the train split, or else the first)."""
    if isinstance(ds, (DatasetDict, IterableDatasetDict)):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return (ds.features or {}).get("label")


def _load_source(source: DataSource, **options: Any) -> DatasetDict | IterableDatasetDict:
    """`load_image_dataset` of `source`'s data set, columns and splits, with `options`."""
    columns = dict(image_column=source.image_column_name, label_column=source.label_column_name)
    splits = dict(train_split=source.train_split, validation_split=source.validation_split)
    return load_image_dataset(source.dataset_name, **columns, **splits, test_split=source.test_split, **options)


def label_names(ds: Dataset | IterableDataset | DatasetDict | IterableDatasetDict) -> list[str]:
    """Class names of the `label` column (index = label id), e.g. for `id2label = dict(enumerate(names))`."""
    feature = _label_feature(ds)
    if isinstance(feature, _LISTS):
        feature = feature.feature  # multi-label: the classes of the lists' elements
    if not isinstance(feature, ClassLabel):
        raise ValueError(f"The 'label' column must be a ClassLabel to have names, got {feature!r}.")
    return list(feature.names)


def _is_saved_dataset(path: str) -> bool:
    return any(
        os.path.isfile(os.path.join(path, filename))
        for filename in (datasets.config.DATASETDICT_JSON_FILENAME, datasets.config.DATASET_STATE_JSON_FILENAME)
    )


def _load_from_hub(name: str, *, streaming: bool, cache_dir: str | None) -> DatasetDict | IterableDatasetDict:
    reason = hub_unreachable_reason()  # asked once: an unreachable Hub puts the process offline, with no retries
    try:
        return datasets.load_dataset(name, streaming=streaming, cache_dir=cache_dir)
    except (OSError, HFValidationError) as err:  # OSError: ConnectionError, DatasetNotFoundError, HTTP errors...
        if reason is not None or offline_mode():
            raise lookup_error("data set", name, reason) from err
        raise FileNotFoundError(
            f"Cannot load data set {name!r}: it is not 'digits', not an existing local directory (an image folder "
            "or a save_to_disk output), and could not be loaded from the Hugging Face Hub "
            f"({type(err).__name__}: {err}). Pass 'digits', a local path, or a Hub data set id while online (or one "
            "already in the local cache; HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 forbid network access)."
        ) from err


def _standardize_columns(ds, name: str, image_column: str, label_column: str):
    """Keep only the image and label columns, renamed to `image`/`label`; make `label` a ClassLabel."""
    columns = ds["train"].column_names
    if columns is not None:  # None for some streamed data sets whose features are unknown until read
        missing = [column for column in (image_column, label_column) if column not in columns]
        if missing:
            raise ValueError(
                f"Data set {name!r} has no column {' or '.join(map(repr, missing))}; its columns are {columns}. "
                "Choose the image and label columns with --image_column_name and --label_column_name."
            )
    ds = ds.select_columns([image_column, label_column])
    renames = {old: new for old, new in ((image_column, "image"), (label_column, "label")) if old != new}
    ds = ds.rename_columns(renames) if renames else ds

    features = ds["train"].features
    if features is None:
        return ds
    if not isinstance(features["image"], datasets.Image):
        ds = ds.cast_column("image", datasets.Image())
    label = features["label"]
    # a list of classes per image (multi-label classification): the same rules for its elements
    is_list = isinstance(label, _LISTS)
    element = label.feature if is_list else label
    if isinstance(element, ClassLabel):
        return ds
    is_string = isinstance(element, datasets.Value) and element.dtype in ("string", "large_string")
    is_integer = isinstance(element, datasets.Value) and "int" in element.dtype
    if isinstance(ds, IterableDatasetDict) or not (is_string or is_integer):
        raise ValueError(
            f"Cannot use labels of type {label!r} from {name!r}: expected a ClassLabel, or string or integer labels, "
            "or lists of them (those are mapped to a ClassLabel without streaming only)."
        )
    if is_list:
        values = {value for d in ds.values() for row in d["label"] for value in row}
    else:
        values = set().union(*(d.unique("label") for d in ds.values()))
    if not values:
        raise ValueError(f"The label column of {name!r} holds no labels.")
    if is_integer and min(values) < 0:
        raise ValueError(
            f"The label column of {name!r} holds the negative class id {min(values)}: class ids start at 0. Remove "
            "the images without a label (or, for multi-label data, give them an empty list of classes)."
        )
    names = sorted(values) if is_string else [str(i) for i in range(max(values) + 1)]
    return ds.cast_column("label", datasets.List(ClassLabel(names=names)) if is_list else ClassLabel(names=names))


def is_multi_label(ds: Dataset | IterableDataset | DatasetDict | IterableDatasetDict) -> bool:
    """Whether the `label` column holds a list of classes per image (multi-label classification)."""
    return isinstance(_label_feature(ds), _LISTS)


def reorder_classes(ds, names: list[str]):
    """`ds` with its classes numbered as `names` orders them (the same classes in another order, e.g. a model's
    `id2label`): each `label` (or each element of a multi-label list) is mapped by its class name."""
    current = label_names(ds)
    if sorted(current) != sorted(names):
        raise ValueError(f"The classes {current} are not {names} in another order.")
    position = {name: index for index, name in enumerate(names)}
    new_id = [position[name] for name in current]

    def remap(batch):
        return {"label": [[new_id[c] for c in x] if isinstance(x, list) else new_id[x] for x in batch["label"]]}

    reordered = {}
    for split, data in ds.items():
        features = data.features.copy()
        multi = isinstance(features["label"], _LISTS)
        features["label"] = datasets.List(ClassLabel(names=names)) if multi else ClassLabel(names=names)
        reordered[split] = data.map(remap, batched=True, features=features)
    return type(ds)(reordered)


def to_multi_hot(ds: DatasetDict, num_classes: int) -> DatasetDict:
    """`ds` with each image's list of class ids as a multi-hot float vector of `num_classes` (the model's targets for
    multi-label classification)."""

    def encode(batch):
        vectors = np.zeros((len(batch["label"]), num_classes), dtype=np.float32)
        for row, classes in enumerate(batch["label"]):
            wrong = [c for c in classes if not 0 <= c < num_classes]
            if wrong:  # numpy would read -1 as the last class
                raise ValueError(
                    f"A label list holds the class id(s) {wrong}, outside 0..{num_classes - 1}: every element of a "
                    "multi-label list must be one of the data set's classes (an image without classes has an empty "
                    "list)."
                )
            vectors[row, list(classes)] = 1.0
        return {"label": vectors.tolist()}

    features = ds["train"].features.copy()
    features["label"] = datasets.List(datasets.Value("float32"), length=num_classes)
    return DatasetDict({split: data.map(encode, batched=True, features=features) for split, data in ds.items()})


def _carve_validation(ds, fraction: float):
    """Split `fraction` of train off as validation (stratified by label where possible), drawn from `HELD_OUT_SEED`,
    never a run's `--seed`: every later command (evaluate, resize) measures the images the run held out."""
    if not 0 < fraction < 1:
        raise ValueError(
            f"There is no validation split to use; validation_fraction must be in (0, 1), not {fraction}."
        )
    train = ds["train"]
    if isinstance(train, IterableDataset):  # no length: take each example whose index crosses a multiple of 1/fraction

        def in_validation(_, index: int) -> bool:
            return math.floor((index + 1) * fraction) > math.floor(index * fraction)

        ds["validation"] = train.filter(in_validation, with_indices=True, input_columns="label")
        ds["train"] = train.filter(lambda *args: not in_validation(*args), with_indices=True, input_columns="label")
        return ds
    try:
        parts = train.train_test_split(test_size=fraction, seed=HELD_OUT_SEED, stratify_by_column="label")
    except ValueError:  # a class with fewer than 2 examples, or fewer validation examples than classes
        parts = train.train_test_split(test_size=fraction, seed=HELD_OUT_SEED)
    ds["train"], ds["validation"] = parts["train"], parts["test"]
    return ds
