"""FSDP2 (torch's fully_shard) on hf-vit, in CPU processes with gloo: each block and the root are sharded units;
a few SGD steps on fixed batches, then the full state dict gathered and saved as one safetensors folder.

    torchrun --nproc_per_node 2 tests/workers/fsdp_worker.py OUT_DIR
    python tests/workers/fsdp_worker.py OUT_DIR --single      # the same steps in one process, unsharded
    torchrun ... OUT_DIR --kill_after 2   # save a sharded checkpoint (model and optimizer) after step 2, then die
    torchrun ... OUT_DIR --resume         # load that checkpoint and do the remaining steps
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hf_vit import VisionTransformerConfig, VisionTransformerForImageClassification

STEPS, BATCH = 4, 8


def batches():
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 3, 16, 16, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
            for _ in range(STEPS)]  # fmt: skip


def main() -> None:
    out, single = Path(sys.argv[1]), "--single" in sys.argv
    config = VisionTransformerConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=3, zero_init_head=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = VisionTransformerForImageClassification(config)
    total = sum(p.numel() for p in model.parameters())
    rank, world = 0, 1
    if not single:
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        for block in model.vit.layers:
            fully_shard(block)
        fully_shard(model)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kill_after = int(sys.argv[sys.argv.index("--kill_after") + 1]) if "--kill_after" in sys.argv else None
    start = 0
    if "--resume" in sys.argv:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(out / "sharded-checkpoint"))  # each rank reads its own shards
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        start = json.loads((out / "sharded-checkpoint" / "step.json").read_text())["step"]
    for step, (pixels, labels) in enumerate(batches()):
        if step < start:
            continue
        # each rank takes its share of the global batch; the mean gradient is the single process's
        share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = model(pixels[share], labels=labels[share]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if kill_after is not None and step + 1 == kill_after:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save(
                {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(out / "sharded-checkpoint")
            )
            dist.barrier()
            if rank == 0:
                (out / "sharded-checkpoint" / "step.json").write_text(json.dumps({"step": step + 1}))
            dist.barrier()
            os._exit(17)  # killed after the checkpoint: no cleanup, no final save
    probe = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.eval()(probe).logits
    if single:
        state = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        consolidated = VisionTransformerForImageClassification(config)
        consolidated.load_state_dict(state)
        consolidated.save_pretrained(out / "model")
        save_file({"logits": logits.contiguous()}, out / "logits.safetensors")
    if not single:
        dist.barrier()  # rank 0 has written the folder
    report = {"rank": rank, "world": world, "local_parameters": local, "total_parameters": total}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if not single:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
