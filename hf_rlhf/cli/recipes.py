"""Where the `hf-rlhf` subcommands find the recipes they run: `recipes/` of the checkout the package was installed
from (an editable install, or the repository on `PYTHONPATH`), else the copy a wheel ships as `hf_rlhf.recipes`."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# hf_rlhf/cli/recipes.py -> the repository root
CHECKOUT_RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes")


def recipes_dir() -> str | None:
    """The folder holding sft.py, reward.py, ppo.py (and configs/), or None when neither copy is there."""
    if os.path.isfile(os.path.join(CHECKOUT_RECIPES, "sft.py")):
        return CHECKOUT_RECIPES
    spec = importlib.util.find_spec("hf_rlhf.recipes")
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return None


def has_recipe(name: str) -> bool:
    """The recipe `<name>.py` exists and defines `main` (read, not imported: listing the subcommands stays cheap)."""
    folder = recipes_dir()
    path = os.path.join(folder, f"{name}.py") if folder else None
    if not path or not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        return "\ndef main(" in f.read()


def load_recipe(name: str):
    """The recipe module `<name>` (`recipes/<name>.py`), imported once.

    From a checkout it is the module `recipes.<name>` (as `from recipes import ppo` gives it) when that name
    resolves to the same file, else it is loaded from its path; from a wheel it is `hf_rlhf.recipes.<name>`.
    """
    folder = recipes_dir()
    if folder is None:
        raise FileNotFoundError("the recipes are not installed: install hf_rlhf from its repository (pip install -e .)")
    path = os.path.join(folder, f"{name}.py")
    if folder != CHECKOUT_RECIPES:
        return importlib.import_module(f"hf_rlhf.recipes.{name}")
    loaded = loaded_recipe(path)
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("recipes") if "recipes" not in sys.modules else sys.modules["recipes"].__spec__
    if spec is not None and spec.submodule_search_locations and \
            os.path.abspath(list(spec.submodule_search_locations)[0]) == folder:
        return importlib.import_module(f"recipes.{name}")
    return load_recipe_file(path)


def loaded_recipe(path: str):
    """The recipe module already imported from the file `path` (as `recipes.<name>` or `_hf_rlhf_recipes.<name>`),
    or None."""
    path = os.path.abspath(path)
    name = os.path.splitext(os.path.basename(path))[0]
    for module_name in (f"recipes.{name}", f"_hf_rlhf_recipes.{name}"):
        module = sys.modules.get(module_name)
        if module is not None and os.path.abspath(getattr(module, "__file__", "")) == path:
            return module
    return None


def load_recipe_file(path: str):
    """The recipe module of the file `path`, imported once (`loaded_recipe`, else loaded from the path as
    `_hf_rlhf_recipes.<name>`)."""
    loaded = loaded_recipe(path)
    if loaded is not None:
        return loaded
    module_name = f"_hf_rlhf_recipes.{os.path.splitext(os.path.basename(path))[0]}"
    spec = importlib.util.spec_from_file_location(module_name, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
