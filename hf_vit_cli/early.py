"""What a command line gets wrong that can be told without torch: read from the command line, the files it names and
the texts saved beside `hf_vit/commands/` (the training commands' flags with the kind of value each takes, the
presets), with the standard library only, so that the error comes in a fraction of a second rather than after the
seconds torch and transformers take to load. The command itself checks everything again, and more."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
from pathlib import Path

TRUE_WORDS = ("yes", "true", "t", "y", "1")  # what transformers' string_to_bool takes
BOOL_WORDS = (*TRUE_WORDS, "no", "false", "f", "n", "0")
# A preset's name: [stem-]vit-<size>-patch<P>-<resolution> (configuration_vit.from_preset parses it).
PRESET_NAME = re.compile(r"(?:(?P<stem>r\d+)-)?vit-(?P<size>[a-z]+)-patch(?P<patch>\d+)-(?P<resolution>\d+)")
# Names of the project's own bookkeeping in a run's folder: whether a folder holding only them is taken over is the
# run's decision, not told here.
BOOKKEEPING = re.compile(r"\..*|hf_vit_run\.json.*")


def given_values(argv: list[str]) -> dict[str, list[str]]:
    """Each flag of `argv` (with underscores) and the words after it up to the next flag (`--flag=value`: value)."""
    given: dict[str, list[str]] = {}
    values: list[str] = []
    for word in argv:
        if word == "--":
            break
        if word.startswith("--"):
            flag, equals, value = word[2:].partition("=")
            values = given.setdefault(flag.replace("-", "_"), [])
            values.clear()
            if equals:
                values.append(value)
        else:
            values.append(word)
    return given


def value_problem(flag: str, values: list[str], kind: str) -> str | None:
    """What is wrong with the values given to `--flag`, which takes `kind` values (see `help.value_kind`)."""
    several = kind.endswith("+")
    kind = kind.rstrip("+")
    for value in values if several else values[:1]:
        try:  # what argparse's type=int and type=float take
            int(value) if kind == "int" else float(value) if kind == "float" else None
        except ValueError:
            return f"--{flag} {value}: " + (
                "not a whole number." if kind == "int" else "not a number (e.g. 0.001, 1e-3)."
            )
        if kind == "bool" and value.lower() not in BOOL_WORDS:
            return f"--{flag} {value}: not True or False."
        if kind.startswith("choice:") and value not in (choices := kind[len("choice:") :].split("|")):
            close = [choice for choice in choices if choice.startswith(value)][:1] or difflib.get_close_matches(
                value, choices, n=1
            )
            hint = f"did you mean {close[0]}? " if close else ""
            return f"--{flag} {value}: {hint}It takes one of {', '.join(choices)}."
    return None


def preset_problem(name: str, presets: str) -> str | None:
    """Why `--preset name` names no architecture: the architectures are those `--list_presets` prints (`presets`),
    at any resolution, and the hybrids' stems with any size."""
    listed = [match for name in re.findall(r"^  (\S+)", presets, re.M) if (match := PRESET_NAME.fullmatch(name))]
    plain = {(m["size"], m["patch"]) for m in listed if not m["stem"]}
    stems = {(m["stem"], m["patch"]) for m in listed if m["stem"]}
    sizes = {size for size, _ in plain}
    match = PRESET_NAME.fullmatch(name)
    if match and not match["stem"] and (match["size"], match["patch"]) in plain:
        return None
    if match and match["stem"] and match["size"] in sizes and (match["stem"], match["patch"]) in stems:
        return None
    close = difflib.get_close_matches(name, [m.string for m in listed], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"--preset {name}: no such preset; {hint}--list_presets lists them (at any resolution, e.g. -384)."


def patch_of(given: dict[str, list[str]], presets: str) -> tuple[int, str] | None:
    """The patch size the run's `--image_size` must be a multiple of, and where it comes from: `--patch_size`, a local
    checkpoint's config.json, or the preset's name. None when it cannot be told here."""
    if given.get("patch_size"):
        return int(given["patch_size"][0]), "--patch_size"
    checkpoint = (given.get("model_name_or_path") or [None])[0]
    if checkpoint:
        config = Path(checkpoint).expanduser() / "config.json"
        try:
            patch = json.loads(config.read_text(encoding="utf-8")).get("patch_size")
        except (OSError, ValueError):
            return None
        return (patch, f"--model_name_or_path {checkpoint}") if isinstance(patch, int) else None
    default = re.search(r"default (\S+)\)", presets)
    name = (given.get("preset") or [default[1] if default else ""])[0]
    match = PRESET_NAME.fullmatch(name)
    return (int(match["patch"]), f"--preset {name}") if match else None


def image_size_problem(given: dict[str, list[str]], presets: str) -> str | None:
    """`--image_size` that is not a whole number of patches."""
    sizes = [int(size) for size in given.get("image_size") or []]
    named = PRESET_NAME.fullmatch((given.get("preset") or [""])[0])
    if not sizes and named and not given.get("model_name_or_path"):  # the preset's own resolution
        sizes = [int(named["resolution"])]
    patch = patch_of(given, presets) if sizes else None
    if patch is None or patch[0] < 1 or all(size % patch[0] == 0 for size in sizes):
        return None
    if not given.get("image_size"):
        typed = named["resolution"]
        meant = next((size for size in ("224", "384", "512") if size.startswith(typed)), "224")
        return (
            f"--preset {named.string}: its resolution {typed} is not a multiple of its patch size {patch[0]}; did "
            f"you mean {named.string[: -len(typed)]}{meant}? (--image_size sets another resolution)"
        )
    fit = [max(patch[0], round(size / patch[0]) * patch[0]) for size in sizes]
    return (
        f"--image_size {' '.join(map(str, sizes))} is not a multiple of the patch size {patch[0]} ({patch[1]}) in "
        f"both height and width: use e.g. --image_size {' '.join(map(str, fit))}."
    )


def output_dir_problem(given: dict[str, list[str]]) -> str | None:
    """A non-empty `--output_dir` given without `--overwrite_output_dir` or `--resume_from_checkpoint`."""
    overwrite, train = given.get("overwrite_output_dir"), given.get("do_train")
    if not given.get("output_dir") or "resume_from_checkpoint" in given:
        return None
    if train and train[0].lower() not in TRUE_WORDS:  # --do_train False writes its results only, each refused if there
        return None
    if overwrite is not None and (not overwrite or overwrite[0].lower() in TRUE_WORDS):
        return None
    folder = Path(given["output_dir"][0]).expanduser()
    try:
        entries = sorted(entry.name for entry in folder.iterdir()) if folder.is_dir() else []
        ways = run_folder_ways(folder) if [name for name in entries if not BOOKKEEPING.fullmatch(name)] else None
    except OSError:  # unreadable: the run says what
        return None
    if ways is None:  # empty but for bookkeeping, or entries the run would write through or delete: it names them
        return None
    shown = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
    advice = "; or ".join([*ways, "choose another folder"]) + "."
    return f"--output_dir {folder} is not empty (it holds {shown}). {advice[0].upper()}{advice[1:]}"


def run_folder_ways(folder: Path) -> list[str] | None:
    """What lets a run use the non-empty `folder`, as the run itself decides it (`hf_vit.outputs.output_folders`),
    by the project's list of the files it writes (`hf_vit/outputs/files.py`, standard library only, read by its
    path): resuming where the newest checkpoint that finished saving (its weights there, its trainer_state.json,
    written last, readable) holds its optimizer's state, overwriting where an earlier run's record claims the files
    under hf-vit's names (or there are none). None where an entry blocks the run (a link under a name it writes, a
    checkpoint-N that is not one)."""
    files = _files_module()
    if files is None:
        return []
    named, checkpoints = [], []
    for entry in folder.iterdir():
        checkpoint = files.CHECKPOINT_FOLDER.fullmatch(entry.name)
        if entry.is_symlink() and (checkpoint or files.is_run_file(entry.name)):
            return None
        if checkpoint and (not entry.is_dir() or files.checkpoint_foreign_entries(entry)):
            return None
        checkpoints += [entry] if checkpoint else []
        named += [entry.name] if entry.is_file() and files.is_run_file(entry.name) else []
    try:
        record = json.loads((folder / files.RUN_RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    recorded = isinstance(record, dict) and isinstance(record.get("files"), list)
    complete = _complete_checkpoints(checkpoints, files)
    # the newest is resumed, where it has its optimizer's state (not saved with --save_only_model)
    resumable = complete and any(any(complete[-1].glob(name)) for name in ("optimizer.pt", "optimizer_0"))
    ways = ["pass --resume_from_checkpoint True to continue the run whose checkpoints it holds"] * bool(resumable)
    unclaimed = sorted(set(named) - {files.RUN_RECORD_FILE})
    if recorded or not unclaimed:
        ways.append("pass --overwrite_output_dir True to train a new model there (it removes only what an earlier "
                    "hf-vit run recorded writing)")  # fmt: skip
    else:
        ways.append(f"move {', '.join(unclaimed)} away (no {files.RUN_RECORD_FILE} says an hf-vit run wrote them, so "
                    "--overwrite_output_dir keeps them and refuses)")  # fmt: skip
    return ways


def _files_module():
    """The project's list of the files it writes (`hf_vit/outputs/files.py`, standard library only), read by its path
    without importing the package; None where it is missing."""
    spec = importlib.util.find_spec("hf_vit")
    path = Path(spec.origin).parent / "outputs" / "files.py" if spec and spec.origin else None
    if path is None or not path.is_file():
        return None
    loader = importlib.util.spec_from_file_location("hf_vit_cli._files", path)
    files = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(files)
    return files


def _complete_checkpoints(checkpoints: list[Path], files) -> list[Path]:
    """The checkpoint folders that finished saving (weights there, their trainer_state.json, written last, readable),
    oldest first."""
    weights = ("model.safetensors", "adapter_model.safetensors", "model-*-of-*.safetensors", "pytorch_model_fsdp_*")
    return [
        checkpoint
        for checkpoint in sorted(checkpoints, key=lambda path: int(path.name.split("-")[1]))
        if _reads(checkpoint / files.TRAINER_STATE_FILE) and any(any(checkpoint.glob(name)) for name in weights)
    ]


def _reads(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def one_class_problem(given: dict[str, list[str]]) -> str | None:
    """A local image folder of one class folder, for a classification run with the usual columns and splits."""
    objective = (given.get("objective") or ["classification"])[0]
    if objective != "classification" or {"label_column_name", "train_split"} & set(given):
        return None
    name = (given.get("dataset_name") or ["digits"])[0]
    root = Path(name).expanduser()
    saved = ("dataset_dict.json", "state.json")  # a save_to_disk folder
    if name == "digits" or not root.is_dir() or any((root / file).is_file() for file in saved):
        return None
    train = root / "train" if (root / "train").is_dir() else root
    entries = [entry for entry in _listed(train) if not entry.name.startswith(".")]
    if len(entries) != 1 or not entries[0].is_dir():
        return None
    inside = _listed(entries[0])
    if not inside or any(entry.is_dir() for entry in inside):
        return None
    # A metadata file (metadata.csv, .jsonl, .parquet) gives the labels, not the folders: one folder may hold many.
    if any(entry.name.startswith("metadata.") for folder in (root, train, entries[0]) for entry in _listed(folder)):
        return None
    return (
        f"--dataset_name {root}: {train} holds one class folder ({entries[0].name}): classification needs at least "
        "two (root/<class>/*.jpg, a folder per class); --objective mpp pretrains without classes."
    )


def _listed(folder: Path) -> list[Path]:
    """What `folder` holds; nothing where it cannot be read (the command says what then)."""
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def hub_cache_problem(flag: str, value: str, repo_type: str) -> str | None:
    """A name that is no local path, given with `HF_HUB_OFFLINE=1`, that the Hub cache does not hold (nor, for a data
    set, the datasets library's own cache, which `load_dataset` reads offline: `<owner>___<name>`, snake-cased)."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() not in ("1", "ON", "YES", "TRUE") or os.path.exists(value):
        return None  # (huggingface_hub's reading of the variable)
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    cache = Path(os.environ.get("HF_HUB_CACHE", os.environ.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))))
    if (cache / f"{repo_type}s--{value.replace('/', '--')}").is_dir():
        return None
    prepared = Path(os.environ.get("HF_DATASETS_CACHE", os.path.join(home, "datasets")))
    folded = value.replace("/", "___").replace("_", "").lower()
    if repo_type == "dataset" and prepared.is_dir():
        if any(entry.name.replace("_", "").lower() == folded for entry in prepared.iterdir() if entry.is_dir()):
            return None
    return (
        f"{flag} {value}: no such folder, and with HF_HUB_OFFLINE=1 a Hub {repo_type} must be in the cache ({cache}), "
        "which does not hold it."
    )


# The least value of each flag a run can take (the command checks them again).
LEAST = {"learning_rate": 0, "weight_decay": 0, "warmup_steps": 0, "label_smoothing_factor": 0}
LEAST |= dict.fromkeys(("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                        "image_size", "patch_size", "max_num_patches", "packed_sequence_length"), 1)  # fmt: skip


def range_problem(given: dict[str, list[str]]) -> str | None:
    """A value below what its flag takes, or a run left with nothing to train (no epoch and no step)."""
    for flag, least in LEAST.items():
        low = [value for value in given.get(flag, []) if float(value) < least]
        if low:
            return f"--{flag} {low[0]}: must be at least {least}."
    train, epochs = (given.get("do_train") or ["true"])[0].lower() in TRUE_WORDS, given.get("num_train_epochs")
    if train and epochs and float(epochs[0]) <= 0 and int((given.get("max_steps") or ["-1"])[0]) <= 0:
        return f"--num_train_epochs {epochs[0]} trains nothing: give a positive number of epochs (or --max_steps N)."
    return None


def training_problem(argv: list[str], listed: str, presets: str) -> str | None:
    """The first thing wrong with a training command line (`listed`: its saved flag list; `presets`: the presets'
    text) that can be told here, or None."""
    given = given_values(argv)
    # `listed`'s `--flag kind` lines as {flag name with underscores: kind}
    kinds = {
        flag[2:].replace("-", "_"): kind for flag, _, kind in (line.partition(" ") for line in listed.splitlines())
    }
    for flag, values in given.items():
        if problem := value_problem(flag, values, kinds.get(flag, "")):
            return problem
    if given.get("preset") and (problem := preset_problem(given["preset"][0], presets)):
        return problem
    if "packed_sequence_length" in given and not {"max_num_patches", "seq_lens", "patch_sizes"} & set(given):
        return (
            "--packed_sequence_length packs native-aspect images: give --max_num_patches (the most patches of one "
            "image, at most --packed_sequence_length)."
        )
    if problem := range_problem(given) or image_size_problem(given, presets) or output_dir_problem(given):
        return problem
    if problem := one_class_problem(given):
        return problem
    for flag, kind in (("model_name_or_path", "model"), ("dataset_name", "dataset")):
        value = (given.get(flag) or [""])[0]
        if value and value != "digits" and (problem := hub_cache_problem(f"--{flag}", value, kind)):
            return problem
    return None


def predict_problem(argv: list[str]) -> str | None:
    """hf-vit-predict's image files or folders that do not exist, or an `--output` file that does (every one of its
    flags takes one value)."""
    output = (given_values(argv).get("output") or [None])[0]
    if output and os.path.lexists(os.path.expanduser(output)):
        return f"--output {output} exists: name a new file (it is never overwritten)."
    images, value_next = [], False
    for word in argv:
        if value_next or word.startswith("--"):
            value_next = not value_next and "=" not in word
            continue
        images.append(word)
    missing = [image for image in images if not os.path.exists(os.path.expanduser(image))]
    if not missing:
        return None
    return f"no such image file or folder: {', '.join(missing)}."


def resume_hint(argv: list[str]) -> str:
    """After a training run was interrupted: its newest checkpoint and how to go on from it."""
    folder = Path((given_values(argv).get("output_dir") or ["trainer_output"])[0]).expanduser()  # Trainer's default
    files = _files_module()
    listed = [entry for entry in _listed(folder) if files and files.CHECKPOINT_FOLDER.fullmatch(entry.name)]
    complete = _complete_checkpoints(listed, files) if files else []
    if not complete:  # none, or the one being saved when the run stopped
        return "No complete checkpoint was saved (--save_strategy and --save_steps say when one is)."
    return (
        f"The newest checkpoint is {complete[-1]}: the same command with --resume_from_checkpoint True goes on "
        "from it."
    )
