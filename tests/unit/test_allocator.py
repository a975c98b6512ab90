"""`hf_rlhf.cli.allocator.keep_freed_memory`: a recipe's freed C blocks are reused, not faulted in again; a user's
own allocator settings are left alone. The allocator is process-wide, so each behaviour runs in a fresh process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import hf_rlhf.cli.allocator as allocator
from hf_rlhf.cli.errors import run_recipe

ROOT = Path(__file__).resolve().parents[2]

# four 3 MiB blocks written and freed 20 times, as a training step's activations are; prints the page faults taken
STEPS = """
import ctypes, resource, sys
from hf_rlhf.cli.allocator import keep_freed_memory
made = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 3 << 20
def step():
    blocks = [libc.malloc(size) for _ in range(4)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(made, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def page_faults(mode: str, **extra_env: str) -> tuple[bool, int]:
    env = {name: value for name, value in os.environ.items() if name not in allocator.USER_SETTINGS}
    env.update(extra_env, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", STEPS, mode], env=env, capture_output=True, text=True, check=True)
    made, faults = done.stdout.split()
    return made == "True", int(faults)


@glibc_only
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    made, default_faults = page_faults("default")
    assert not made
    # 12 MiB written per step: glibc's defaults hand it back on free and fault every page in again (3,072 a step)
    assert default_faults > 20 * 1000
    made, kept_faults = page_faults("keep")
    assert made
    assert kept_faults < 100


@glibc_only
@pytest.mark.parametrize("name, value", [("MALLOC_TRIM_THRESHOLD_", "131072"), ("MALLOC_ARENA_MAX", "8"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")])
def test_a_users_own_allocator_settings_are_left_alone(name, value):
    made, faults = page_faults("keep", **{name: value})
    assert not made
    assert faults > 20 * 1000


def test_nothing_is_changed_off_glibc_or_under_a_preloaded_allocator(monkeypatch):
    assert not allocator.keep_freed_memory({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"})
    assert not allocator.keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "65536"})
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert not allocator.keep_freed_memory({})


def test_a_recipe_runs_with_freed_memory_kept(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(True) or True)
    assert run_recipe(lambda: "results", close=False) == "results"
    assert calls == [True]
