"""How a recipe ends on the command line: a bad option or input exits with one `[hf_rlhf] error: ...` line; a run
that succeeded closes its process group."""

from __future__ import annotations

from collections.abc import Callable


class RecipeOptionError(ValueError):
    """A recipe's options that cannot make a run (a missing dataset, policy or reward); raised before any loading."""


def close_process_group() -> None:
    """Destroy the default process group, if one is up (every rank, after its last collective).

    A process that exits with a gloo group still alive can abort at interpreter exit ("terminate called without an
    active exception", SIGABRT): gloo's worker threads still hold work objects whose tensors are freed after the
    interpreter is gone (pytorch#190489, #179291). A run that trained and saved everything then fails its launcher.
    Called only after a successful run: destroying while other ranks are still inside a collective could hang.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still talks to it
        dist.destroy_process_group()


def run_recipe(main: Callable, close: bool = True):
    """Run a recipe's `main()` from the command line: a bad input or option exits with its message, not a traceback.

    Args:
        main: the recipe's entry point.
        close: after `main()` returns, destroy the process group (`close_process_group`); a caller that still
            talks to the other ranks passes False and calls it itself.

    Returns:
        what `main()` returns (a recipe's results).
    """
    from ..config_checks import RenamedOptionError
    from ..data import DataFileError, DataValidationError

    try:
        results = main()
    except (DataFileError, DataValidationError, RecipeOptionError, RenamedOptionError) as e:
        raise SystemExit(f"[hf_rlhf] error: {e}") from None
    if close:
        close_process_group()
    return results
