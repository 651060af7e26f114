"""Scale-out rehearsed on one machine with CPU processes and gloo: FSDP2 sharding of hf-vit (torch's fully_shard;
Trainer's --fsdp is refused on CPU, where accelerate does not enable it), and a two-node torchrun launch as two node
processes on 127.0.0.1, each matching one process; DDP on two processes matching one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, keep_weights, torchrun_command
from safetensors.torch import load_file
from test_training import WORKER, deterministic_finetune_args, pretrained_folder

from hf_vit import VisionTransformerForImageClassification
from hf_vit.tasks.model_setup import load_checkpoint as load_for_finetuning
from hf_vit.train.arguments import parse_args
from hf_vit.train.training import train

ROOT = Path(__file__).resolve().parents[1]
FSDP_WORKER = ROOT / "tests" / "workers" / "fsdp_worker.py"


def run(cmd, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """The FSDP worker's uninterrupted run on two processes, once: the sharding test reads it, and it is the killed
    run's reference (the same command). Returns its folder, read only."""
    out = tmp_path_factory.mktemp("fsdp") / "sharded"
    run(torchrun_command() + [str(FSDP_WORKER), str(out)])
    return out


def test_fsdp_shards_hf_vit_on_cpu_and_saves_one_consolidated_model(tmp_path, sharded_run):
    run([sys.executable, str(FSDP_WORKER), str(tmp_path / "single"), "--single"])
    ranks = [json.loads((sharded_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    total = ranks[0]["total_parameters"]
    # parameters (and so gradients and SGD's momentum) are sharded: each rank holds about half
    assert all(r["world"] == 2 and r["local_parameters"] < 0.6 * total for r in ranks)
    assert sum(r["local_parameters"] for r in ranks) == total
    sharded = VisionTransformerForImageClassification.from_pretrained(sharded_run / "model").eval()
    single = VisionTransformerForImageClassification.from_pretrained(tmp_path / "single" / "model").eval()
    probe = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reloaded = sharded(probe).logits
    # the consolidated model.safetensors computes what the sharded model computed
    torch.testing.assert_close(reloaded, load_file(sharded_run / "logits.safetensors")["logits"])
    worst = max(
        (a - b).abs().max().item() for a, b in zip(sharded.state_dict().values(), single.state_dict().values())
    )
    print(f"FSDP (2 CPU processes) vs one process, 4 SGD steps: max weight difference {worst:.1e}")
    assert worst < 1e-5


def test_a_killed_fsdp_run_resumes_from_its_sharded_checkpoint(tmp_path, sharded_run):
    torchrun = torchrun_command()
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    died = subprocess.run(
        torchrun + [str(FSDP_WORKER), str(killed), "--kill_after", "2"], env=env, capture_output=True
    )
    assert died.returncode != 0 and (killed / "sharded-checkpoint" / "step.json").is_file()
    assert not (killed / "model").exists()
    # one file of shards per rank: no process ever held the whole model or optimizer state
    assert len(list((killed / "sharded-checkpoint").glob("*.distcp"))) == 2
    run(torchrun + [str(FSDP_WORKER), str(killed), "--resume"])
    straight = load_file(sharded_run / "model" / "model.safetensors")  # the uninterrupted run
    resumed = load_file(killed / "model" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_trainer_fsdp_on_cpu_is_refused_with_the_reason(tmp_path):
    args = ["--output_dir", str(tmp_path), "--fsdp", "full_shard auto_wrap", "--use_cpu", "True"]
    with pytest.raises(ValueError, match="accelerate does not enable FSDP.*DistributedDataParallel"):
        parse_args("pretrain", args)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The one-process side of the distributed comparisons: a pretrained folder and the weights of one process
    fine-tuning from it on a batch of 16, trained once, in this process."""
    root = tmp_path_factory.mktemp("one-process")
    source = pretrained_folder(root / "pre")
    keep = keep_weights()
    task, *argv = deterministic_finetune_args(source, root / "one", 16, extra=["--save_strategy", "no"])
    train(task, *parse_args(task, argv), callbacks=[keep])
    return source, keep.weights


def test_distributed_two_processes_match_one(tmp_path, one_process_run):
    source, single = one_process_run
    two = tmp_path / "two"
    torchrun = torchrun_command()
    done = run(torchrun + [str(WORKER)] + deterministic_finetune_args(source, two, 8, extra=["--save_strategy", "no"]))
    assert "find_unused_parameters=True was specified" not in done.stderr  # DDP does not search for unused params
    info = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [i["world_size"] for i in info] == [2, 2] and [i["rank"] for i in info] == [0, 1]
    rank0, rank1 = load_file(two / "rank0.safetensors"), load_file(two / "rank1.safetensors")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # DDP keeps the replicas identical

    start = load_for_finetuning(str(source), {i: str(i) for i in range(10)}, image_size=8).state_dict()
    moved = max((single[k] - start[k]).abs().max().item() for k in single)
    worst = max((single[k] - rank0[k]).abs().max().item() for k in single)
    print(f"2 processes x 8 vs 1 x 16: max weight difference {worst:.2e} (weights moved up to {moved:.2e})")
    assert moved > 1e-3 and worst < 1e-4


def node_launch(launcher: str, node_rank: int, port: int) -> list[str]:
    """docs/distributed.md's multi-node command for node `node_rank` of 2, one worker each, master on 127.0.0.1."""
    if launcher == "torchrun":
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank)]
        return launch + ["--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    launch += [str(ROOT / "configs" / "accelerate" / "cpu.yaml"), "--num_machines", "2", "--num_processes", "2"]
    return launch + [
        "--machine_rank",
        str(node_rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
    ]


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_nodes_on_one_machine_match_one_process(tmp_path, launcher, one_process_run):
    port = free_port()
    source, single = one_process_run
    two = tmp_path / "two-nodes"
    nodes = []
    for node_rank in (0, 1):
        launch = node_launch(launcher, node_rank, port)
        args = deterministic_finetune_args(source, two, 8, extra=["--save_strategy", "no"])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        nodes.append(
            subprocess.Popen(
                launch + [str(WORKER)] + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    for node in nodes:
        _, err = node.communicate(timeout=600)
        assert node.returncode == 0, err[-4000:]
    info = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(i["rank"], i["world_size"]) for i in info] == [(0, 2), (1, 2)]
    rank0, rank1 = load_file(two / "rank0.safetensors"), load_file(two / "rank1.safetensors")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    worst = max((single[k] - rank0[k]).abs().max().item() for k in single)
    print(f"2 nodes x 1 process x 8 vs 1 process x 16: max weight difference {worst:.1e}")
    assert worst < 1e-4
