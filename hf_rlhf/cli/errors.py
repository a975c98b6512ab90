"""How a recipe fails on the command line: a bad option or input exits with one `[hf_rlhf] error: ...` line."""

from __future__ import annotations

from collections.abc import Callable


class RecipeOptionError(ValueError):
    """A recipe's options that cannot make a run (a missing dataset, policy or reward); raised before any loading."""


def run_recipe(main: Callable):
    """Run a recipe's `main()` from the command line: a bad input or option exits with its message, not a traceback.

    Returns:
        what `main()` returns (a recipe's results).
    """
    from ..config_checks import RenamedOptionError
    from ..data import DataFileError, DataValidationError

    try:
        return main()
    except (DataFileError, DataValidationError, RecipeOptionError, RenamedOptionError) as e:
        raise SystemExit(f"[hf_rlhf] error: {e}") from None
