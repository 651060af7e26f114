import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# The tests never reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Under pytest-xdist each worker process takes one core's share, and so do the processes a test starts (scripts,
# launchers): a child at the machine's thread count beside the other worker oversubscribes the cores, and torch's
# spinning threads then run several times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))

# The files that take longest, longest first. `make test` hands whole files to its workers (--dist loadfile) in
# collection order, the next file to whichever worker is almost done: with the long files first and the short ones
# last, the workers finish together. (pytest-xdist's own order, by number of tests, left a few slow files of few tests
# for the end, run by one worker while the other had nothing left.)
SLOWEST_FILES = (
    "test_benchmark.py", "test_families.py", "test_distributed.py", "test_training.py", "test_matrix.py",
    "test_wheel.py", "test_export.py", "test_training_edges.py", "test_recipes.py", "test_packed_rows.py",
    "test_packed_training.py", "test_device.py", "test_variants.py", "test_summary.py", "test_inference.py",
    "test_hub_training.py", "test_layout.py", "test_output_folders.py", "test_hub_access.py", "test_native_aspect.py",
    "test_examples.py", "test_image_processing.py", "test_auto.py", "test_convert_transformers.py",
    "test_architecture.py", "test_mim.py", "test_data.py",
)  # fmt: skip


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="where tests/test_device.py runs its checks: cpu or cuda[:N]")
    parser.addoption("--trainer_on_cpu", action="store_true", help="tests/test_device.py's Trainer checks on CPU too")


def pytest_configure(config):
    device = config.getoption("--device")
    try:
        cuda = torch.device(device).type == "cuda"
    except RuntimeError as error:
        raise pytest.UsageError(f"--device {device}: {error}; use --device cpu or --device cuda") from None
    if cuda and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}, but CUDA is not available here; use --device cpu")
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # keep the order below


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, datasets, hf_vit, the test modules: half a million objects)
    lives as long as the process: frozen out of the garbage collector's sight, so that each full collection (Trainer
    has accelerate run one at the end of every training run) scans only what the tests made since."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def digits_built_once():
    """`load_digits_dataset` builds the digits' splits anew on each call (1,797 images encoded), which a run on
    digits paid every time: in a test process each seed's splits are built once, and each call gets its own copy (the
    formats and transforms a run sets stay its own)."""
    import copy
    import functools

    from datasets import DatasetDict

    from hf_vit.data import datasets as module

    build = functools.cache(module.load_digits_dataset)

    def load_digits_dataset(seed: int = 0) -> DatasetDict:
        return DatasetDict({split: copy.deepcopy(rows) for split, rows in build(seed).items()})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "load_digits_dataset", load_digits_dataset)
        yield


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous: fixed ports collide when test files run side
    by side (pytest-xdist) or beside another run on the machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_command(processes: int = 2) -> list[str]:
    """`torchrun --nproc_per_node N` on a free rendezvous port, as this interpreter runs it."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return launcher + ["--master_port", str(free_port())]


def keep_weights():
    """A callback that keeps the weights at the end of training, as the training worker's ranks dump them."""
    from transformers import TrainerCallback

    class KeepWeights(TrainerCallback):
        weights = None

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    return KeepWeights()


def tiny_config(**overrides):
    from hf_vit import VisionTransformerConfig

    fields = dict(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
    )
    fields.update(overrides)
    return VisionTransformerConfig(**fields)


@pytest.fixture
def config():
    return tiny_config()


class HubRecord(dict):
    """What HfApi would have created and sent: the last call's `repo` and `files` as keys, and every repository,
    commit (its files' bytes and message) and token used as attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.repos, self.commits, self.tokens = [], [], set()


@pytest.fixture
def hub(monkeypatch):
    """Records HfApi's write calls (never the network); any other way of uploading fails the test."""
    from huggingface_hub import HfApi

    sent = HubRecord()

    def create_repo(self, repo_id, **kwargs):
        sent["repo"] = repo_id
        sent.repos.append(repo_id)
        sent.tokens.add(self.token)
        # As the Hub does: a bare name is created in the token owner's namespace.
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"alice/{repo_id}")

    def create_commit(self, repo_id, operations, commit_message="", **kwargs):
        files = {}
        for op in operations:
            data = op.path_or_fileobj
            if isinstance(data, (str, Path)):
                data = Path(data).read_bytes()
            elif not isinstance(data, bytes):
                data.seek(0)
                data = data.read()
            files[op.path_in_repo] = data
        sent["files"] = files
        sent.commits.append(SimpleNamespace(repo=repo_id, message=commit_message, files=files))
        sent.tokens.add(self.token)
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/{len(sent.commits) - 1}")

    def refuse(self, *args, **kwargs):
        raise AssertionError("only create_repo and create_commit may be used: they send exactly the planned files")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    for name in ("upload_folder", "upload_file", "preupload_lfs_files", "upload_large_folder", "create_branch"):
        monkeypatch.setattr(HfApi, name, refuse, raising=False)
    return sent


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache folder that the Hub client reads and writes (offline), for checkpoints a test
    writes in the Hub's layout."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert huggingface_hub.constants.HF_HUB_OFFLINE  # set above: the Hub is never reached
    return cache


@torch.no_grad()
def measure_model(model, processor, source=None, split=None, batch_size=256):
    """`(split, metrics)`: top-1/top-5 accuracy of `model` on `split` of `source`'s data set (digits by default),
    measured here apart from the library's evaluation (the processor on the raw split, the plain metrics); by default
    the split a run would report: test when the data set has one, else validation."""
    from hf_vit.data.datasets import DataSource, label_names, load_datasets
    from hf_vit.data.transforms import apply_transforms, make_eval_transform
    from hf_vit.infer.evaluate import final_split
    from hf_vit.infer.loading import model_inputs
    from hf_vit.metrics import compute_metrics

    source = source or DataSource()
    raw = load_datasets(source, seed=0)
    split = split or final_split(raw)
    assert split in raw and len(label_names(raw)) <= model.config.num_labels
    evaluation = make_eval_transform(processor)  # the processor alone, on train too: no augmentation is measured
    ds = apply_transforms(raw, evaluation, evaluation)[split]
    model.eval()
    logits, labels = [], []
    for start in range(0, len(ds), batch_size):
        batch = ds[start : start + batch_size]
        logits.append(model(**model_inputs(batch)).logits.float())
        labels.append(batch["labels"])
    return split, compute_metrics((torch.cat(logits).numpy(), torch.cat(labels).numpy()))
