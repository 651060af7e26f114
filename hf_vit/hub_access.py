"""Hub look-ups that fail fast, once, and say what to do offline: the Hub is asked once per process whether it
answers (no retries; huggingface_hub's retries took 100 seconds to fail offline). When it does not, the process goes
on in huggingface_hub's offline mode (one warning), and a model the cache lacks is a `HubLookupError` suggesting
`HF_HUB_OFFLINE=1` and local folders."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCAL_ALTERNATIVES = (
    "pass local folders instead: a model folder (an hf-vit, transformers or timm folder, e.g. outputs/main, which "
    "`make train` writes, or outputs/quick from `make train QUICK=1`) and, for --dataset_name, an image folder "
    "(root/<label>/*.jpg), a save_to_disk folder or 'digits'"
)
# Why the Hub did not answer, by endpoint: asked once per process.
_UNREACHABLE: dict[str, str] = {}


class HubLookupError(OSError):
    """A Hub id neither downloadable nor cached (an `OSError`, as transformers' loading errors)."""


def offline_mode() -> bool:
    """Whether huggingface_hub is in offline mode (`HF_HUB_OFFLINE=1`, or a Hub found unreachable)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_unreachable_reason() -> str | None:
    """Why the Hub cannot be reached, or None; asked once per process, one request."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = constants.ENDPOINT
    if endpoint in _UNREACHABLE:
        return _UNREACHABLE[endpoint]
    if constants.HF_HUB_OFFLINE:
        return None
    try:  # any HTTP answer, even an error status, means the Hub can be reached
        get_session().head(endpoint, timeout=float(constants.HF_HUB_ETAG_TIMEOUT), follow_redirects=False)
        return None
    except Exception as error:  # noqa: BLE001 - the client's transport errors (httpx's or httpx2's, by version)
        reason = f"{endpoint}: {type(error).__name__}: {error}"
        _UNREACHABLE[endpoint] = reason
        # Every later look-up of this process (transformers' included, which asks for files a repository may not
        # have) would otherwise retry the network for about 25 seconds before trying the cache.
        constants.HF_HUB_OFFLINE = True
        logger.warning(
            "The Hugging Face Hub cannot be reached (%s): continuing offline, as with HF_HUB_OFFLINE=1 (Hub ids "
            "resolve from the local cache).",
            reason,
        )
    return reason


def lookup_error(kind: str, name: str, reason: str | None) -> HubLookupError:
    """The error for the `kind` Hub id `name` found neither on the Hub nor in the cache."""
    if reason is None:
        cause = f"{kind} {name!r} is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 forbids downloading it"
        advice = f"Download it where the Hub can be reached (the same cache serves it then), or {LOCAL_ALTERNATIVES}"
    else:
        cause = (
            f"cannot reach the Hugging Face Hub ({reason}) to look up {kind} {name!r}, and it is not in the local "
            "cache"
        )
        advice = (
            "Without a network, set HF_HUB_OFFLINE=1 (Hub ids then resolve from the local cache at once, with no "
            f"retries) and {LOCAL_ALTERNATIVES}"
        )
    return HubLookupError(f"{cause[0].upper()}{cause[1:]} (there is no local folder {name!r} either). {advice}.")


def hub_file(repo_id: str, filename: str, options: dict[str, Any], kind: str = "model") -> Path | None:
    """`filename` of the Hub repository `repo_id` from the cache, None when it lacks it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    options = {k: v for k, v in options.items() if v is not None}
    reason = hub_unreachable_reason()
    if offline_mode():
        options["local_files_only"] = True  # straight to the cache: no HTTP client, no retries
    try:
        path = Path(hf_hub_download(repo_id, filename, **options))
    except LocalEntryNotFoundError as error:  # (a subclass of EntryNotFoundError) not in the cache, no download
        if reason is None and not options.get("local_files_only"):  # the Hub answered the probe, then failed
            reason = f"{type(error).__name__}: {error}"
        raise lookup_error(kind, repo_id, reason) from error
    except EntryNotFoundError:
        return None
    return path
