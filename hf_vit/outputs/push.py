"""Pushing a folder to the Hub: an explicit list of the files this project writes (`hf_vit.outputs.files`), checked
for symlinks and local paths before anything is sent, in one commit; a run's pushes go through the same plan."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import ModelCard

from .files import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    CARD_FILE,
    CONFIG_FILE,
    PROCESSOR_FILE,
    RESULT_FILES,
    RESUME_FILE_PATTERN,
    RESUME_FILES,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    remote_code_files,
)

logger = logging.getLogger(__name__)


def upload_file_names() -> tuple[str, ...]:
    """The fixed names a push takes from a folder's top level, besides the weights."""
    return (CONFIG_FILE, PROCESSOR_FILE, *remote_code_files(), *RESULT_FILES)


_TEXT_SUFFIXES = {".json", ".md", ".txt", ".py", ".yaml", ".yml", ".csv", ".toml", ".cfg", ".ini"}


class HubPushError(OSError):
    """The Hub could not be reached or refused the push; the message says which repository and what to try."""


@dataclass(frozen=True)
class UploadFile:
    """One file of an upload: its place in the repository, its source, corrected bytes if any."""

    path_in_repo: str
    source: Path
    content: bytes | None = None


def _plain_file(path: Path, name: str) -> bool:
    """Whether `path` is a regular file; a symlink is an error naming it (its target's bytes would be sent)."""
    if path.is_symlink():
        raise ValueError(
            f"{name} in {path.parent} is a symlink (to {os.readlink(path)}); symlinks are not uploaded, since the "
            f"bytes sent would be its target's. Replace it with a copy of the file (`cp --remove-destination "
            f'"$(readlink -f {path})" {path}`) if you mean to publish it.'
        )
    return path.is_file()


def _weights(folder: Path, only: Collection[str] | None = None) -> list[str]:
    """The safetensors weights (single, sharded with index, or a LoRA adapter); with `only`, named."""

    def available(path: Path, name: str) -> bool:
        return (only is None or name in only) and _plain_file(path, name)

    index = folder / WEIGHTS_INDEX_FILE
    if available(index, WEIGHTS_INDEX_FILE):
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, TypeError) as error:
            raise ValueError(f"{index} is not a safetensors index with a weight_map ({error}).") from error
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise ValueError(f"{index} names {shard!r}, not a .safetensors file beside it.")
            if not available(folder / shard, shard):
                raise FileNotFoundError(f"{index} names the shard {shard}, which is not in {folder}.")
        return [*shards, WEIGHTS_INDEX_FILE]
    if available(folder / WEIGHTS_FILE, WEIGHTS_FILE):
        return [WEIGHTS_FILE]
    if available(folder / ADAPTER_FILE, ADAPTER_FILE) and available(folder / ADAPTER_CONFIG, ADAPTER_CONFIG):
        return [ADAPTER_FILE, ADAPTER_CONFIG]  # a LoRA run's folder: peft's adapter, loaded onto its base model
    found = sorted(p.name for p in folder.glob("*.safetensors") if only is None or p.name in only)
    hint = f" (found {found}: name other files with extra_files / --include)" if found else ""
    raise FileNotFoundError(
        f"{folder} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX_FILE}); hf-vit only publishes safetensors weights "
        f"saved by `save_pretrained`{hint}."
    )


def _extra_file(folder: Path, name: str | os.PathLike) -> str:
    """The repository path of a user-named file: it must be a regular file inside `folder`, not a symlink."""
    path = Path(name) if Path(name).is_absolute() else folder / name
    if not _plain_file(path, os.fspath(name)):
        raise FileNotFoundError(f"{name} is not a file in {folder}: --include names files inside the pushed folder.")
    try:
        return path.resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:
        raise ValueError(f"{name} is outside {folder}: only files inside the pushed folder are uploaded.") from None


# Any absolute path, whatever its prefix: POSIX (`/srv/models/base`: two components at least, not inside a URL or
# a fraction), `file://` URLs, a home folder (`~/x`, `~alice/x`), Windows drives (`C:\Users\...`) and UNC shares.
_LOCAL_PATH = re.compile(
    r"file://\S+"
    r"|(?<![\w.:/\\~-])/[\w@+-][\w.@+-]*/[^\s\"'`<>()\[\]{},;|]*"
    r"|(?<![\w/\\])~[\w.-]*/[^\s\"'`<>()\[\]{},;|]*"
    r"|(?<![\w])[A-Za-z]:[\\/][^\s\"'`<>()\[\]{},;|]+"
    r"|\\\\[\w.$-]+\\[^\s\"'`<>()\[\]{},;|]+"
)


def find_local_path(text: str) -> str | None:
    """The first absolute local path (or home-relative path) written in `text`, or None."""
    match = _LOCAL_PATH.search(text)
    return match.group(0) if match else None


def _corrected_card(text: str, repo_id: str) -> str:
    """The card with the repository id it names replaced by `repo_id` (metadata, heading, code examples)."""
    try:
        card = ModelCard(text)
    except ValueError:  # not a card with metadata this project wrote: the user's text goes as it is
        return text
    old = getattr(card.data, "model_name", None)
    if not old:
        match = re.search(r'from_pretrained\("([^"]+)"|model="([^"]+)"', card.text)
        old = match and (match.group(1) or match.group(2))
    if not old or old == repo_id:
        return text
    if getattr(card.data, "model_name", None):
        card.data.model_name = repo_id
    body = card.text.replace(f'"{old}"', f'"{repo_id}"')
    body = re.sub(rf"^# {re.escape(old.split('/')[-1])}$", f"# {repo_id.split('/')[-1]}", body, count=1, flags=re.M)
    card.text = body
    return str(card)


def _checked(folder: Path, name: str, path_in_repo: str, text: str | None = None) -> UploadFile:
    """`folder/name` as an upload, refused if it is a text file naming a local path; `text` replaces its content."""
    source = folder / name
    content = None if text is None else text.encode("utf-8")
    if Path(name).suffix.lower() in _TEXT_SUFFIXES:
        text = source.read_text(encoding="utf-8", errors="replace") if text is None else text
        found = find_local_path(text)
        if found:
            raise ValueError(
                f"{source} contains the local path {found!r}; nothing naming a path of this machine is uploaded. "
                "Remove it from the file (a card names Hub ids or plain names: re-render it with "
                "hf_vit.outputs.cards.write_model_card) or leave the file out."
            )
    return UploadFile(path_in_repo, source, content)


def plan_upload(
    folder: str | os.PathLike,
    repo_id: str | None = None,
    extra_files: Iterable[str | os.PathLike] = (),
    *,
    card: bool = True,
    only: Collection[str] | None = None,
) -> list[UploadFile]:
    """Exactly what pushing `folder` sends, checked, offline: the project's files at its top level (with `only`,
    those named), plus the user's `extra_files`; the card as a copy naming `repo_id` (`card=False`: none expected).
    A symlink, or a text file naming an absolute path, is an error; the user's files are never modified."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: pass the folder that a training run or script wrote.")
    if not _plain_file(folder / CONFIG_FILE, CONFIG_FILE):
        raise FileNotFoundError(f"{folder} has no config.json: save the model there before pushing it.")
    shared = [name for name in upload_file_names() if only is None or name in only]
    names = _weights(folder, only) + [name for name in shared if _plain_file(folder / name, name)]
    names += [_extra_file(folder, name) for name in extra_files]
    if card and CARD_FILE not in names:
        logger.warning("%s has no model card (README.md): the repository will have none.", folder)
    plan = []
    for name in dict.fromkeys(names):  # in order, each once
        text = None
        if name == CARD_FILE and repo_id:
            original = (folder / name).read_text(encoding="utf-8", errors="replace")
            corrected = _corrected_card(original, repo_id)
            text = corrected if corrected != original else None
        plan.append(_checked(folder, name, name, text))
    return plan


def plan_checkpoint_upload(checkpoint: str | os.PathLike, path_in_repo: str) -> list[UploadFile]:
    """What a checkpoint push sends under `path_in_repo` (never `training_args.bin`)."""
    folder = Path(checkpoint)
    plan = [
        UploadFile(f"{path_in_repo}/{item.path_in_repo}", item.source, item.content)
        for item in plan_upload(folder, card=False)
    ]
    for entry in sorted(folder.iterdir()):
        name, text = entry.name, None
        resumed = name in RESUME_FILES or RESUME_FILE_PATTERN.fullmatch(name) or name == TRAINER_STATE_FILE
        if not resumed or not _plain_file(entry, name):
            continue
        if name == TRAINER_STATE_FILE:
            state = json.loads(entry.read_text())
            if isinstance(state.get("best_model_checkpoint"), str):
                state["best_model_checkpoint"] = Path(state["best_model_checkpoint"]).name
            text = json.dumps(state, indent=2, sort_keys=True) + "\n"
        plan.append(_checked(folder, name, f"{path_in_repo}/{name}", text))
    return plan


def _hub_call(what: str, repo_id: str, call):
    """Run a call to the Hub; a network or Hub error becomes one `HubPushError` line naming the repository."""
    try:
        return call()
    except Exception as error:  # httpx / huggingface_hub errors have no common base but Exception
        offline = " HF_HUB_OFFLINE=1 is set in this environment." if os.environ.get("HF_HUB_OFFLINE") else ""
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "no message")
        raise HubPushError(
            f"could not {what} {repo_id} on the Hugging Face Hub ({type(error).__name__}: {first}).{offline} Check "
            "the network and the token (--hub_token or `hf auth login`), then push the folder again with "
            "`hf-vit-push --model <folder> --hub_model_id <org>/<name>`."
        ) from error


def create_repo(repo_id: str, *, token: str | None = None, private: bool | None = None) -> str:
    """Create (or find) the model repository; returns its full id."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    created = _hub_call(
        "create", repo_id, lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    )
    return getattr(created, "repo_id", None) or repo_id


def commit_plan(
    repo_id: str,
    plan: list[UploadFile],
    *,
    token: str | None = None,
    commit_message: str,
    revision: str | None = None,
) -> str:
    """Send exactly `plan` to `repo_id` in one commit; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    logger.info("Uploading %d files to %s: %s", len(plan), repo_id, ", ".join(f.path_in_repo for f in plan))
    # O_NOFOLLOW: a file swapped for a symlink after the checks is refused rather than followed.
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    api = HfApi(token=token)
    with contextlib.ExitStack() as stack:
        operations = [
            CommitOperationAdd(
                path_in_repo=item.path_in_repo,
                path_or_fileobj=item.content
                if item.content is not None
                else stack.enter_context(open(item.source, "rb", opener=lambda p, f: os.open(p, f | nofollow))),
            )
            for item in plan
        ]
        options = {"commit_message": commit_message, "revision": revision, "repo_type": "model"}
        commit = _hub_call("push to", repo_id, lambda: api.create_commit(repo_id, operations, **options))
    return str(getattr(commit, "commit_url", commit))


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str | None,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload hf-vit model",
    revision: str | None = None,
    extra_files: Iterable[str | os.PathLike] = (),
) -> str:
    """Push an hf-vit folder in one commit of exactly `plan_upload`'s files; the commit URL."""
    if not repo_id:
        raise ValueError("Pushing needs a repository id: pass --hub_model_id <user or org>/<name>.")
    plan = plan_upload(folder, repo_id, extra_files)
    full_id = create_repo(repo_id, token=token, private=private)
    if full_id != repo_id:  # the card must name the full id
        repo_id, plan = full_id, plan_upload(folder, full_id, extra_files)
    return commit_plan(repo_id, plan, token=token, commit_message=commit_message, revision=revision)
