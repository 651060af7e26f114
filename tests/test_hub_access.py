"""A Hub id that cannot be resolved without a network fails at once, once, with a message that says what to do
offline (HF_HUB_OFFLINE=1, local folders); a file in the local cache is used at once when the Hub does not answer.
The "network" here is a port nothing listens on: the refusal is immediate, as a machine without DNS is."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, tiny_config
from PIL import Image

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification, hub_access
from hf_vit.hub_access import HubLookupError

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The Hub client pointed at a refused port, offline mode off."""
    import huggingface_hub.constants

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # put back after the test
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub_access, "_UNREACHABLE", {})
    return endpoint


def test_offline_a_model_id_not_in_the_cache_fails_at_once_saying_what_to_do(hub_cache):
    started = time.perf_counter()
    with pytest.raises(HubLookupError) as raised:
        VisionTransformerForImageClassification.from_pretrained("nobody/not-in-the-cache")
    assert time.perf_counter() - started < 5
    message = str(raised.value)
    assert "'nobody/not-in-the-cache' is not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in message and "local folder" in message, message
    with pytest.raises(HubLookupError):
        VisionTransformerConfig.from_pretrained("nobody/not-in-the-cache")


def test_an_unreachable_hub_is_asked_once_and_fails_at_once(hub_cache, unreachable_hub, monkeypatch, caplog):
    from huggingface_hub.utils import get_session

    asked = []
    session = get_session()
    original = type(session).head

    def head(self, url, **kwargs):
        asked.append(url)
        return original(self, url, **kwargs)

    monkeypatch.setattr(type(session), "head", head)
    started = time.perf_counter()
    for _ in range(2):
        with pytest.raises(HubLookupError) as raised:
            VisionTransformerForImageClassification.from_pretrained("google/vit-base-patch16-224-in21k")
    assert time.perf_counter() - started < 5
    assert asked == [unreachable_hub]  # one probe in all: no retries, and the answer is kept
    message = str(raised.value)
    assert f"Cannot reach the Hugging Face Hub ({unreachable_hub}: " in message, message
    assert "set HF_HUB_OFFLINE=1" in message and "image folder" in message, message
    warnings = [r.getMessage() for r in caplog.records if r.name == "hf_vit.hub_access"]
    assert len(warnings) == 1 and "continuing offline" in warnings[0], warnings


def test_an_unreachable_hub_leaves_the_cache_usable_at_once(hub_cache, unreachable_hub):
    model = VisionTransformerForImageClassification(tiny_config())
    snapshot = hub_cache / "models--me--cached" / "snapshots" / COMMIT
    model.save_pretrained(snapshot)
    (hub_cache / "models--me--cached" / "refs").mkdir()
    (hub_cache / "models--me--cached" / "refs" / "main").write_text(COMMIT)
    started = time.perf_counter()
    assert hub_access.hub_file("me/cached", "config.json", {}) == snapshot / "config.json"
    loaded = VisionTransformerForImageClassification.from_pretrained("me/cached")
    assert time.perf_counter() - started < 5 and loaded.config.hidden_size == model.config.hidden_size


def test_the_training_command_fails_in_seconds_without_a_network(tmp_path):
    """The README's quick start, on a machine whose Hub does not answer: one error, in seconds, not minutes."""
    images = tmp_path / "images"
    for label in ("cat", "dog"):
        (images / label).mkdir(parents=True)
        for index in range(2):
            Image.new("RGB", (12, 10), (40 * index, 90, 200)).save(images / label / f"{index}.png")
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "PYTHONPATH": str(ROOT)}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HUB_CACHE=str(tmp_path / "cache"))
    command = "from hf_vit.commands.train import finetune; raise SystemExit(finetune())"
    argv = ["--model_name_or_path", "google/vit-base-patch16-224-in21k", "--dataset_name", str(images)]
    argv += ["--output_dir", str(tmp_path / "out"), "--use_cpu", "True"]
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", command, *argv], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Cannot reach the Hugging Face Hub" in output, output[-3000:]
    assert "Retrying in" not in output, output[-3000:]
    print(f"the training command failed after {seconds:.1f} s")
    assert seconds < 60  # mostly imports; the Hub look-up itself takes milliseconds
