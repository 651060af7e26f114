"""The package's shape, read from its source: every import statement of every module (at module level and inside
functions) points down the stages, serving never reaches training, `import hf_vit` loads neither, and the habits
that hid options in global state or fake argument objects stay gone.

The order, lowest first (a module may import its own package and any package of a lower layer, nothing else):

    0  model, metrics       the core (copied beside checkpoints as remote code) and the offline metric modules
    0  flags                the checks of flag values and the commands' error line, shared by every layer
    1  outputs              what the project writes: file lists, output folders, cards, pushes, plots
    1  hub_access           asking the Hub once (and going offline when it does not answer)
    2  convert, lora        readers of foreign checkpoints and of LoRA run folders, registered with the core's
                            loading hook by `hf_vit/__init__.py`, which sits on top of them (`import hf_vit` loads
                            exactly this much)
    3  data                 images to batches (data sets, pixel path, augmentation)
    4  tasks                what a run learns (labels, model builders, collators, metrics, losses)
    5  infer                a saved folder at work: loading, predict, evaluate, the compute dial
    6  train                the Trainer run (uses infer for `--do_train False` and the compute dial after training)
    6  variants, export, analysis    tools used after training (beside train: they never import it)
    7  commands             console entry points: parse flags, then one library call
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_vit

PACKAGE = Path(hf_vit.__file__).parent
LAYERS = {
    "model": 0,
    "metrics": 0,
    "flags": 0,
    "outputs": 1,
    "hub_access": 1,
    "convert": 2,
    "lora": 2,
    "__init__": 2,
    "data": 3,
    "tasks": 4,
    "infer": 5,
    "train": 6,
    "variants": 6,
    "export": 6,
    "analysis": 6,
    "commands": 7,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def parse(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))


def imports_of(module: str) -> set[str]:
    """Every hf_vit module `module` names in an import statement, anywhere in its file (`from x import name` counts
    `x.name` when that is a module, else `x`)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(parse(module)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    return {name for name in found if name == "hf_vit" or name.startswith("hf_vit.")}


def stage(module: str) -> str:
    """The package (or top-level module) of hf_vit that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def reached_from(roots: list[str]) -> set[str]:
    """Every hf_vit module the imports of `roots` reach, transitively (a package's import runs its __init__)."""
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        for target in imports_of(module):
            parts = target.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return seen


def test_every_package_has_a_layer():
    unplaced = sorted({stage(module) for module in MODULES} - set(LAYERS))
    assert not unplaced, f"hf_vit packages without a place in the order: {unplaced}"


def allowed(own: str, target: str) -> bool:
    """Whether a module of `own` may import one of `target`: its own package, a lower layer, or, for the package's
    `__init__`, the readers it registers (its own layer)."""
    if own == target:
        return True
    if own == "__init__":
        return LAYERS.get(target, 99) <= LAYERS["__init__"]
    return LAYERS.get(target, 99) < LAYERS.get(own, -1)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    own = stage(module)
    upward = sorted(target for target in imports_of(module) if not allowed(own, stage(target)))
    assert not upward, f"{module} ({own}, layer {LAYERS.get(own)}) imports up or sideways: {upward}"


def test_serving_never_reaches_training():
    served = reached_from([module for module in MODULES if stage(module) == "infer"])
    assert not sorted(m for m in served if stage(m) == "train")


TRAINING_ONLY = {
    "hf_vit.data.augment.rand_augment": "RandAugment",
    "hf_vit.data.augment.random_erasing": "random erasing",
    "hf_vit.data.augment.mixing": "Mixup/CutMix",
    "hf_vit.data.augment.train_transform": "the training transform",
    "hf_vit.train.ema": "EMA",
    "hf_vit.train.arguments": "the training flags",
    "hf_vit.commands.train": "the training commands",
}


@pytest.mark.parametrize("command", ["hf_vit.commands.predict", "hf_vit.commands.evaluate"])
def test_serving_commands_reach_no_training_part(command):
    """Every import statement predict's and evaluate's modules hold (in functions too) reaches no augmentation, EMA or
    training entry: the eval pixel path and the training augmentation live apart."""
    served = reached_from([command])
    reached = {module: what for module, what in TRAINING_ONLY.items() if module in served}
    assert not reached and not sorted(m for m in served if stage(m) == "train" or ".augment" in m), reached


def test_import_hf_vit_reaches_neither_training_nor_serving():
    reached = reached_from(["hf_vit"])
    assert not sorted(m for m in reached if stage(m) in ("train", "infer"))
    # and as Python runs it: the modules loaded by `import hf_vit` in a fresh interpreter
    code = (
        "import sys, hf_vit; print(' '.join(m for m in sys.modules if m.startswith(('hf_vit.train', 'hf_vit.infer'))))"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert loaded.stdout.strip() == ""


def calls(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called == name:
                yield node


def argument_object(node: ast.expr) -> bool:
    """Whether `node` names a whole argument object: `args`, `training_args`, `self.args`, ..."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "args" or name.endswith("_args")


def hidden_options() -> dict[str, list[str]]:
    """Where options travel as hidden state or fake objects, per kind."""
    found: dict[str, list[str]] = {"ContextVar": [], "SimpleNamespace": [], "getattr(args, name, default)": []}
    found["argument dataclass built below the edge"] = []
    for module in MODULES:
        tree = parse(module)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) in (
                "ContextVar",
                "contextvars",
            ):
                found["ContextVar"].append(f"{module}:{node.lineno}")
            if isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) == (
                "SimpleNamespace"
            ):
                found["SimpleNamespace"].append(f"{module}:{node.lineno}")
        for node in calls(tree, "getattr"):
            if len(node.args) == 3 and argument_object(node.args[0]):
                found["getattr(args, name, default)"].append(f"{module}:{node.lineno}")
        if module != "hf_vit.train.arguments":  # the edge: where the flags' dataclasses are parsed
            for name in ("DataArguments", "ModelArguments", "VisionTransformerTrainingArguments"):
                found["argument dataclass built below the edge"] += [f"{module}:{n.lineno}" for n in calls(tree, name)]
    return found


def test_no_options_in_hidden_state_or_fake_argument_objects():
    found = hidden_options()
    assert {kind: places for kind, places in found.items() if places} == {}


def test_one_trainer_subclass_overrides_each_trainer_method_once():
    from transformers import Trainer

    overriding = {}
    for module in MODULES:
        for node in ast.walk(parse(module)):
            if isinstance(node, ast.ClassDef):
                methods = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
                trainer_methods = [m for m in methods if hasattr(Trainer, m) and not m.startswith("__")]
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                if trainer_methods or "Trainer" in bases:
                    overriding[f"{module}.{node.name}"] = (bases, methods)
    assert list(overriding) == ["hf_vit.train.trainer.VisionTransformerTrainer"], overriding
    bases, methods = overriding["hf_vit.train.trainer.VisionTransformerTrainer"]
    assert bases == ["Trainer"]  # no mix-ins deciding the order of the overrides
    assert len(methods) == len(set(methods))


def test_one_helper_makes_the_seeded_numbers():
    """Every seeded shuffle, draw and augmentation takes its numbers from `hf_vit.data.seeding` (one hash, in one
    place), and they are those earlier runs drew, so that resuming one reproduces it."""
    from hf_vit.data.augment.mixing import mixing_seed
    from hf_vit.data.seeding import seeded_generator, seeded_int

    hashing = sorted(module for module, path in MODULES.items() if "blake2b" in path.read_text())
    assert hashing == ["hf_vit.data.seeding"]
    assert seeded_int(3, "seq_len", 2) == 5370997803009878425 and seeded_int(3, 1, 7) == 14611834967996484535
    assert seeded_generator(3, "order", 1).initial_seed() == 1656595375284765039
    assert seeded_generator(3, "packed rows", 2).initial_seed() == 6323678348051828269
    assert mixing_seed(3, 5, 1) == 9293102001733139489
