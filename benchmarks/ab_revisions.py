"""A/B of hf-vit's model at two revisions, alternating in one process on identical weights.

git worktree add /tmp/before <rev>
python benchmarks/ab_revisions.py --before /tmp/before [--rounds 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from benchmarks.runners import random_batch
from benchmarks.timing import make_infer_step, make_train_step, timed_rounds


def load_package(root: Path, name: str):
    spec = importlib.util.spec_from_file_location(
        name, root / "hf_vit" / "__init__.py", submodule_search_locations=[str(root / "hf_vit")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="a checkout of the earlier revision")
    parser.add_argument("--model", default="vit-small-patch16-224")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    before = load_package(args.before, "hf_vit_before")
    import hf_vit as after

    config = after.VisionTransformerConfig.from_preset(args.model, num_labels=10, zero_init_head=False)
    new = after.VisionTransformerForImageClassification(config)
    old = before.VisionTransformerForImageClassification(before.VisionTransformerConfig(**config.to_dict()))
    old.load_state_dict(new.state_dict())
    x, labels = random_batch(config, args.batch_size, torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(old.eval()(x).logits, new.eval()(x).logits), "the revisions compute different logits"

    steps = {  # one model's step in one dtype (training: forward, loss and backward, no optimiser)
        "inference": lambda model, dtype: make_infer_step(model.eval(), x, dtype),
        "training": lambda model, dtype: make_train_step(model.train(), None, x, labels, dtype),
    }

    print(
        f"{args.model}, batch {args.batch_size}, {torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}; medians of {args.rounds} undisturbed alternating rounds of "
        f"{args.steps} steps"
    )
    print(f"{'row':<16}{'before s/step':>14}{'after s/step':>14}{'after speed-up':>16}")
    for mode, step in steps.items():
        for dtype in ("fp32", "bf16"):
            fns = {label: step(model, dtype) for label, model in (("before", old), ("after", new))}
            b, a = timed_rounds(fns, args.steps, args.rounds)["seconds"].values()
            print(f"{mode + ' ' + dtype:<16}{b:>14.3f}{a:>14.3f}{b / a:>15.3f}x")


if __name__ == "__main__":
    main()
