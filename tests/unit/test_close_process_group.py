"""A recipe that succeeded destroys its process group (a gloo group left alive can abort the process at interpreter
exit, failing the launcher after a good run); one that failed leaves it alone (other ranks may be mid-collective).
And a recipe's main() runs on a frozen start-up heap, with no garbage frozen."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch.distributed as dist

from hf_rlhf.cli.errors import RecipeOptionError, close_process_group, run_recipe


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_successful_recipe_closes_the_group_and_returns_its_results(one_rank_group):
    assert run_recipe(lambda: {"after": 1}) == {"after": 1}
    assert not dist.is_initialized()


def test_close_false_leaves_the_group_to_the_caller(one_rank_group):
    run_recipe(lambda: None, close=False)
    assert dist.is_initialized()
    close_process_group()
    assert not dist.is_initialized()
    close_process_group()  # no group: nothing to do


def test_a_failed_recipe_leaves_the_group_up(one_rank_group):
    def bad():
        raise RecipeOptionError("give --model_name_or_path")

    with pytest.raises(SystemExit, match=r"\[hf_rlhf\] error: give --model_name_or_path"):
        run_recipe(bad)
    assert dist.is_initialized()


def test_a_recipe_runs_on_a_frozen_heap_without_freezing_garbage():
    class Node:
        pass

    gc.disable()  # no automatic pass may reclaim the cycle first
    try:
        garbage = Node()
        garbage.cycle = garbage
        dropped = weakref.ref(garbage)
        del garbage
        alive = Node()
        alive.cycle = alive
        frozen_before = gc.get_freeze_count()
        assert run_recipe(lambda: gc.get_freeze_count()) > frozen_before  # main() already runs frozen
    finally:
        gc.enable()
    assert dropped() is None  # collected before the freeze, not kept forever
    assert not any(o is alive for o in gc.get_objects())  # out of every collection's walk
    gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())
