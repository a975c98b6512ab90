"""The package list: `hf_rlhf*`, plus `recipes/` (scripts, configs/, accelerate/) shipped as `hf_rlhf.recipes`, so an
install that is not a checkout (a wheel) still has the recipes the `hf-rlhf` subcommands run. Everything else is in
pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["hf_rlhf", "hf_rlhf.*"]), "hf_rlhf.recipes"],
    package_dir={"hf_rlhf.recipes": "recipes"},
    package_data={"hf_rlhf.recipes": ["configs/*.yaml", "accelerate/*.yaml"]},
)
