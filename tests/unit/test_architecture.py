"""The package's layers (docs/architecture.md), read from its imports: each module imports only its own layer or
the ones below, the math layer imports torch alone, nothing outside `toy/` imports the toy world, no import cycle."""

import ast
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "hf_rlhf")

# layer of each module, by the longest matching prefix (the docs' table); "toy" may import anything, nothing imports it
LAYERS = {
    "tensors": 1, "losses": 1, "rl": 1, "rollout.experience": 1, "rollout.shared_prompts": 1, "trainers.metrics": 1,
    "trainers.grpo_metrics": 1, "trainers.eval_metrics": 1, "collators": 1, "tools.masks": 1,
    "trainers.base_config": 2, "trainers.model_config": 2, "trainers.config_checks": 2, "trainers.option_ranges": 2,
    "trainers.policy_loss_options": 2,
    "trainers.sft_config": 2, "trainers.reward_config": 2, "trainers.dpo_config": 2, "trainers.kto_config": 2,
    "trainers.ppo_config": 4,
    "trainers.eval_options": 2, "trainers.vllm_options": 2, "trainers.grpo_config": 4, "trainers.rloo_config": 4,
    "trainers.distillation_config": 4, "tools": 2, "imports": 2, "data": 2,
    "models": 3, "generation": 3,
    "rewards": 4, "rollout": 4, "callbacks": 4, "training": 4,
    "trainers": 5, "": 5,
    "cli": 6,
    "toy": 7,
}
MATH_THIRD_PARTY = {"torch", "math", "__future__", "collections", "dataclasses", "typing", "numbers", "functools"}


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                rel = rel.removesuffix("__init__").rstrip(".")
                out[rel] = path
    return out


def _layer(module: str) -> int:
    best = max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".") or prefix == ""),
               key=len)
    return LAYERS[best]


def _imports(module: str, path: str, modules: dict) -> tuple[set[str], set[str]]:
    """(package modules imported, top-level third-party names imported), function-local imports included."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    is_package = path.endswith("__init__.py")
    inside, outside = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if module else []
                base = parts if is_package else parts[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{alias.name}".strip(".") for alias in node.names] + [target]
                names = ["hf_rlhf." + n if n else "hf_rlhf" for n in names]
            else:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "hf_rlhf" or name.startswith("hf_rlhf."):
                rel = name.removeprefix("hf_rlhf").lstrip(".")
                while rel and rel not in modules:
                    rel = rel.rpartition(".")[0]
                if rel != module and (rel in modules):
                    inside.add(rel)
            else:
                outside.add(name.split(".")[0])
    return inside, outside


MODULES = _modules()
GRAPH = {module: _imports(module, path, MODULES) for module, path in MODULES.items()}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_to_the_same_layer_or_below(module):
    inside, outside = GRAPH[module]
    if module == "":  # the package root re-exports the public API lazily
        return
    mine = _layer(module)
    upward = sorted(dep for dep in inside if _layer(dep) > mine and not dep.startswith(module))
    assert not upward, f"hf_rlhf.{module} (layer {mine}) imports a higher layer: {upward}"
    if not module.startswith("toy"):
        assert not any(dep == "toy" or dep.startswith("toy.") for dep in inside), f"hf_rlhf.{module} imports toy"
    if mine == 1:
        extra = outside - MATH_THIRD_PARTY - set(sys.stdlib_module_names)
        assert not extra, f"hf_rlhf.{module} is math (torch only) but imports {sorted(extra)}"


def test_no_import_cycle():
    # a package __init__ that re-exports its children is not a cycle
    edges = {m: {d for d in GRAPH[m][0]
                 if not (m == "" or d.startswith(m + ".") and MODULES[m].endswith("__init__.py"))}
             for m in MODULES}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in edges[node]:
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [module])
