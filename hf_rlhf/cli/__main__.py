"""`python -m hf_rlhf.cli ...` (and `accelerate launch -m hf_rlhf.cli ...`): the `hf-rlhf` command."""

from .main import main

raise SystemExit(main())
