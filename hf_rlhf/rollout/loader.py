"""The PPO "dataloader": prompts in, experience micro-batches out, resumable without regenerating rollouts.

`ExperienceLoader` is a plain object, not a torch `DataLoader`: `accelerate` wraps only torch DataLoaders, and a
wrapped one reads a batch ahead, which would make every rollout one optimizer step stale. It shards the prompts
itself (`process_index` / `num_processes`). Per epoch of the prompt dataset::

    prompts (shuffled by seed + epoch, the same order on every rank)
      -> rollouts of `rollout_batch_size / num_generations` prompts per rank (the last incomplete one is dropped),
         each prompt repeated `num_generations` times in consecutive rows: `rollout_batch_size` rows (completions)
      -> per rollout: `num_ppo_epochs` shuffled passes over its rows, cut into micro-batches of `micro_batch_size`;
         with `group_by_length` the rows of each optimizer step (its `gradient_accumulation_steps` micro-batches)
         are re-cut by length (`group_steps_by_length`): the step's rows and its gradient stay the same, each
         micro-batch carries less padding

`len(loader)` is the number of micro-batches per epoch, so the Trainer's `steps_in_epoch` and
`num_update_steps_per_epoch` come out right.

Resume: the Trainer is run with `ignore_data_skip=True`, loads the RNG state, then calls `set_epoch(e)` and
`iter()`. The loader skips `global_step * gradient_accumulation_steps - e * len(self)` micro-batches: whole
rollouts are skipped without generating anything (their prompts are known from the seeded order); a rollout that
a checkpoint cut in the middle is read back from the per-rank experience file that `save_state` wrote into the
checkpoint, so it is not regenerated either (its responses were sampled, so regenerating could not reproduce it).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable

import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from ..data import (
    MISSING,
    DataValidationError,
    Verbatim,
    as_dataset,
    check_messages,
    check_not_empty,
    check_text,
    check_unknown_tokens,
    column_names,
    column_values,
    encode_plain_batch,
    is_conversational_column,
    special_prefix,
    validate_rows,
)
from .experience import Experience

logger = logging.getLogger("hf_rlhf")

EXPERIENCE_FILE = "ppo_experience_rank{rank}.pt"


def length_keys(experience: Experience, num_generations: int) -> list[tuple[int, int, int]]:
    """Per row of a rollout, the key `group_steps_by_length` sorts by: (prompt length, prompt group, response
    length). The group (row // G for G > 1 completions per prompt, 0 otherwise) keeps a prompt's rows next to each
    other, so that the forward of a micro-batch computes their shared prompt once (`prefix_sharing`)."""
    prompt = experience.query_mask.sum(1).tolist()
    response = experience.context_mask.sum(1).tolist()
    groups = [row // num_generations if num_generations > 1 else 0 for row in range(len(prompt))]
    return list(zip(prompt, groups, response))


def group_steps_by_length(batches: list[list[int]], keys: list, per_step: int) -> list[list[int]]:
    """Micro-batches re-cut by length within each optimizer step.

    Args:
        batches: micro-batches (lists of row indices), `per_step` consecutive ones making one optimizer step, all of
            one size.
        keys: a sortable key per row (`length_keys`).
        per_step: micro-batches per optimizer step (`gradient_accumulation_steps`).

    Returns:
        as many micro-batches of the same size: each step's rows sorted by key (ties in their order in `batches`)
        and cut again, so a step holds the same rows as before and each micro-batch rows of similar length.

    >>> group_steps_by_length([[0, 1], [2, 3], [4, 5]], [9, 1, 8, 2, 3, 4], per_step=2)
    [[1, 3], [2, 0], [4, 5]]
    """
    out = []
    for start in range(0, len(batches), per_step):
        step = batches[start:start + per_step]
        rows = sorted((row for batch in step for row in batch), key=keys.__getitem__)
        size = len(step[0])
        out += [rows[i:i + size] for i in range(0, len(rows), size)]
    return out


def seeded_generator(*key: int) -> torch.Generator:
    """A torch generator seeded from integers, the same in every process and Python version (no `hash`)."""
    digest = hashlib.sha256(repr(tuple(int(k) for k in key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


# ---------------------------------------------------------------------------------------------------
# Prompts


def check_prompt_messages(row: int, field: str, value) -> None:
    """Check a conversational prompt: messages (`check_messages`) that do not end with an assistant turn.

    A prompt ending with the assistant's turn already holds its answer: the policy would be asked to continue it,
    and the reward would judge the continuation of an answer, not an answer.
    """
    check_messages(row, field, value)
    if value[-1]["role"] == "assistant":
        raise DataValidationError(row, f"{field}[{len(value) - 1}].role", "a prompt that ends with a user (or "
                                  "system / tool) turn, for the policy to answer", "assistant")


def validate_prompt_dataset(dataset) -> tuple[object, bool]:
    """Check every prompt row; rename a `messages` column to `prompt`.

    Args:
        dataset: a `Dataset` or a list of dict rows with `prompt` (a string or messages) or `messages`.

    Returns:
        (the dataset as given, with `messages` renamed for a `Dataset`; whether the prompts are conversational).

    Raises:
        DataValidationError: naming the row and field (missing, empty or whitespace-only, ending with an assistant
            turn).
    """
    check_not_empty(dataset)
    columns = column_names(dataset)
    key = "prompt" if "prompt" in columns else "messages" if "messages" in columns else None
    if key is None:
        raise DataValidationError(None, None, "a 'prompt' or 'messages' column", Verbatim(f"columns {columns}"))
    conversational = is_conversational_column(dataset, key)
    validate_rows(dataset, {key: check_prompt_messages if conversational else check_text})
    if key == "messages" and isinstance(dataset, Dataset):
        dataset = dataset.rename_column("messages", "prompt")
    return dataset, conversational


def prompt_length_limit(args, max_positions: int | None) -> int | None:
    """The longest prompt: `args.max_prompt_length`, else the model's positions minus `args.response_length`.

    Args:
        args: a `PPOConfig`.
        max_positions: the policy's `max_position_embeddings`, or None when unknown.

    Raises:
        ValueError: a prompt of that length plus a response would not fit in the model's positions.
    """
    if max_positions is None:
        return args.max_prompt_length
    limit = max_positions - args.response_length
    if limit < 1 or (args.max_prompt_length is not None and args.max_prompt_length > limit):
        given = args.max_prompt_length if args.max_prompt_length is not None else "unset"
        raise ValueError(f"PPOConfig: max_prompt_length ({given}) + response_length ({args.response_length}) must "
                         f"fit in the model's {max_positions} positions (max_position_embeddings)")
    return limit if args.max_prompt_length is None else args.max_prompt_length


def prepare_prompt_dataset(dataset, tokenizer, args, max_positions: int | None = None,
                           conversational: bool | None = None, tools: list | None = None,
                           row_tools: Callable[[dict], list] | None = None) -> Dataset:
    """Validate and tokenize prompt rows: adds `input_ids` (the prompt's tokens); other columns are kept.

    Rows have a `prompt` (a string, or a list of messages) or a `messages` list (renamed to `prompt`). Plain
    prompts get the tokenizer's leading special tokens (bos), conversations the chat template with the generation
    prompt. Prompts longer than `prompt_length_limit(args, max_positions)` (`max_prompt_length`, by default the
    model's positions minus the response length) follow `args.prompt_overlong_policy`; prompts made mostly of
    unknown tokens are counted (`check_unknown_tokens`).

    Args:
        conversational: None: the rows are checked here (`validate_prompt_dataset`); a bool: `dataset` is what
            `validate_prompt_dataset` returned, with this kind of prompts (PPOTrainer checks the rows before it loads
            any model, so they are not checked twice).
        tools: callables rendered into conversational prompts by the chat template (`tools=`), as TRL does.
        row_tools: `row -> tools` instead of `tools`, per row (TRL's dict `environment_factory`: each row rendered
            with its own environment's tools).

    Raises:
        DataValidationError: naming the row and field (a missing or empty prompt, a prompt that is too long).
    """
    if conversational is None:
        dataset, conversational = validate_prompt_dataset(as_dataset(dataset))
    max_length = prompt_length_limit(args, max_positions)
    if conversational and tokenizer.chat_template is None:
        raise ValueError("the prompts are conversational but the tokenizer has no chat template")
    if "input_ids" not in dataset.column_names:
        prefix = special_prefix(tokenizer)
        template_kwargs = getattr(args, "chat_template_kwargs", None) or {}  # TRL GRPOConfig's (enable_thinking, ...)

        def tokenize(batch):  # a batch of rows: plain prompts in one call into the tokenizer's batch encoder
            if conversational:
                rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
                ids = [tokenizer.apply_chat_template(list(row["prompt"]), tokenize=True, return_dict=True,
                                                     add_generation_prompt=True, **template_kwargs,
                                                     tools=(row_tools(row) if row_tools else tools) or None)
                       ["input_ids"] for row in rows]
            else:
                encoded = encode_plain_batch(tokenizer, list(batch["prompt"]))
                ids = [prefix + row_ids for row_ids in encoded]
            return {"input_ids": [list(row_ids) for row_ids in ids]}

        dataset = dataset.map(tokenize, batched=True, num_proc=args.dataset_num_proc, desc="Tokenizing prompts")
        check_unknown_tokens(dataset, ("input_ids",), tokenizer, getattr(args, "max_unk_share", None),
                             getattr(args, "strict", False), "prompt")
    limit = (f"max_prompt_length={max_length}" if args.max_prompt_length is not None or max_length is None else
             f"{max_length} (max_prompt_length unset: the model's {max_positions} positions minus "
             f"response_length={args.response_length})")
    return _apply_prompt_length(dataset, max_length, args.prompt_overlong_policy, limit)


def _apply_prompt_length(dataset: Dataset, max_length: int | None, policy: str, limit: str) -> Dataset:
    lengths = [len(ids) for ids in column_values(dataset, "input_ids")]
    for row, n in enumerate(lengths):
        if n == 0:
            raise DataValidationError(row, "prompt", "at least one token", MISSING)
    overlong = [] if max_length is None else [i for i, n in enumerate(lengths) if n > max_length]
    if not overlong:
        return dataset
    if policy == "error":
        row = overlong[0]
        raise DataValidationError(
            row, "prompt", f"at most {limit} tokens ({len(overlong)} of {len(lengths)} prompts "
            "are longer; set prompt_overlong_policy='truncate' or 'drop' to go on)", Verbatim(f"{lengths[row]} tokens"))
    if policy == "drop":
        logger.warning("%d of %d prompts longer than %s were dropped", len(overlong), len(lengths), limit)
        if len(overlong) == len(lengths):
            raise ValueError(f"all {len(lengths)} prompts are longer than {limit}")
        keep = set(range(len(lengths))) - set(overlong)
        return dataset.select(sorted(keep))
    logger.warning("%d of %d prompts longer than %s were truncated (their last tokens kept)",
                   len(overlong), len(lengths), limit)
    return dataset.map(lambda row: {"input_ids": row["input_ids"][-max_length:]})


# ---------------------------------------------------------------------------------------------------
# Experience


class ExperienceLoader:
    """Experience micro-batches for the Trainer (see the module docstring).

    Args:
        dataset: tokenized prompts (`prepare_prompt_dataset`).
        make_experience: `(rows, dataset_indices) -> (Experience, stats)`; called once per rollout.
        rollout_batch_size: rows (completions) per rollout on this rank.
        micro_batch_size: rows per yielded micro-batch.
        num_ppo_epochs: passes over each rollout.
        seed: seeds the prompt order and the micro-batch shuffles (own generators: the global RNG is untouched).
        process_index, num_processes: this rank and the number of ranks.
        gradient_accumulation_steps: micro-batches per optimizer step.
        get_global_step: the Trainer's `state.global_step`, read when iteration starts.
        get_resume_dir: the checkpoint being resumed from, or None.
        device: where restored experience goes.
        extra_batch: `global_micro_batch_index -> dict`, merged into each micro-batch (the ptx rows).
        num_generations: G, rows per prompt: each rollout takes `rollout_batch_size / G` prompts and hands each to
            `make_experience` G times in a row (a prompt's group stays on this rank).
        refill: pass `make_experience` a `refill=round -> (rows, indices)` keyword for dynamic sampling: round r of
            rollout k draws `rollout_batch_size / G` further prompts by a generator seeded with (seed, epoch, k,
            rank, r), so a resumed run draws the same ones with no state saved (`refill_indices`).
        group_by_length: re-cut each optimizer step's micro-batches by length (`group_steps_by_length`); the cut is
            part of the rollout's state, so a resumed run reads it from the checkpoint.
        shuffle: False takes the prompts in dataset order every epoch (TRL GRPOConfig's `shuffle_dataset=False`).
        num_workers: worker processes that read the prompt rows of the coming rollouts ahead (a torch `DataLoader`
            over the seeded order, `dataloader_num_workers`); 0 reads each rollout's rows when it starts. The rows,
            their order and the global RNG are the same either way.
    """

    def __init__(self, dataset, make_experience: Callable, *, rollout_batch_size: int, micro_batch_size: int,
                 num_ppo_epochs: int, seed: int, process_index: int = 0, num_processes: int = 1,
                 gradient_accumulation_steps: int = 1, get_global_step: Callable[[], int] = lambda: 0,
                 get_resume_dir: Callable[[], str | None] = lambda: None, device=None,
                 extra_batch: Callable[[int], dict] | None = None, num_generations: int = 1,
                 refill: bool = False, group_by_length: bool = False, shuffle: bool = True, num_workers: int = 0):
        self.shuffle, self.num_workers = shuffle, num_workers
        if num_generations < 1 or rollout_batch_size % num_generations:
            raise ValueError(f"rollout_batch_size={rollout_batch_size} is not a multiple of num_generations="
                             f"{num_generations}")
        if rollout_batch_size % micro_batch_size:
            raise ValueError(f"rollout_batch_size={rollout_batch_size} is not a multiple of the micro-batch size "
                             f"{micro_batch_size}")
        self._dataset, self.make_experience = dataset, make_experience
        self.rollout_batch_size, self.micro_batch_size = rollout_batch_size, micro_batch_size
        self.num_ppo_epochs, self.seed = num_ppo_epochs, seed
        self.process_index, self.num_processes = process_index, num_processes
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.get_global_step, self.get_resume_dir = get_global_step, get_resume_dir
        self.device, self.extra_batch = device, extra_batch
        self.num_generations, self.refill, self.group_by_length = num_generations, refill, group_by_length
        self.epoch = 0
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, prompt permutation)
        self._rollout: dict | None = None  # the rollout being handed out, and how far (for checkpoints)
        if self.rollouts_per_epoch == 0:
            raise ValueError(f"the prompt dataset has {len(dataset)} rows; one rollout takes rollout_batch_size / "
                             f"num_generations x processes = {self.prompts_per_rollout} x {num_processes} prompts")

    @property
    def dataset(self):
        return self._dataset

    @property
    def prompts_per_rollout(self) -> int:
        return self.rollout_batch_size // self.num_generations

    @property
    def rollouts_per_epoch(self) -> int:
        return len(self._dataset) // (self.prompts_per_rollout * self.num_processes)

    @property
    def batches_per_rollout(self) -> int:
        return self.num_ppo_epochs * (self.rollout_batch_size // self.micro_batch_size)

    def __len__(self) -> int:
        return self.rollouts_per_epoch * self.batches_per_rollout

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # -- orders (seeded generators, so a resumed run recomputes them without replaying anything) ---------
    def rollout_indices(self, epoch: int, rollout: int) -> list[int]:
        """Dataset indices of this rank's prompts for one rollout (each once: `num_generations` not applied)."""
        if self._order is None or self._order[0] != epoch:
            order = torch.randperm(len(self._dataset), generator=seeded_generator(self.seed, epoch)) if self.shuffle \
                else torch.arange(len(self._dataset))
            self._order = (epoch, order)
        order = self._order[1]
        start = (rollout * self.num_processes + self.process_index) * self.prompts_per_rollout
        return order[start:start + self.prompts_per_rollout].tolist()

    def refill_indices(self, epoch: int, rollout: int, round_: int) -> list[int]:
        """Dataset indices of the prompts of refill round `round_` >= 1 of a rollout (each once; see `refill`)."""
        generator = seeded_generator(self.seed, epoch, rollout, self.process_index, 3, round_)
        return torch.randperm(len(self._dataset), generator=generator)[:self.prompts_per_rollout].tolist()

    def _refill(self, epoch: int, rollout: int):
        def rows_of_round(round_: int):
            indices = [i for i in self.refill_indices(epoch, rollout, round_) for _ in range(self.num_generations)]
            return _rows(self._dataset, indices), indices
        return rows_of_round

    def _batch_order(self, epoch: int, rollout: int, experience: Experience) -> list[list[int]]:
        generator = seeded_generator(self.seed, epoch, rollout, self.process_index, 1)
        batches = []
        for _ in range(self.num_ppo_epochs):
            perm = torch.randperm(self.rollout_batch_size, generator=generator)
            batches += [perm[i:i + self.micro_batch_size].tolist()
                        for i in range(0, self.rollout_batch_size, self.micro_batch_size)]
        if self.group_by_length:
            keys = length_keys(experience, self.num_generations)
            batches = group_steps_by_length(batches, keys, self.gradient_accumulation_steps)
        return batches

    # -- iteration -------------------------------------------------------------------------------------
    def __iter__(self):
        epoch, per_rollout = self.epoch, self.batches_per_rollout
        skip = max(self.get_global_step() * self.gradient_accumulation_steps - epoch * len(self), 0)
        first, offset = divmod(skip, per_rollout)
        # the prompt rows of every rollout still to generate (a rollout cut by the checkpoint is read back whole)
        prompts = self._prompt_rows(epoch, range(first + bool(offset), self.rollouts_per_epoch))
        for rollout in range(first, self.rollouts_per_epoch):
            if offset:
                self._rollout = self._restore(epoch, rollout, offset)
            else:
                # the previous rollout is all handed out: free its experience before generating the next one, or
                # both are alive through the whole generation (a second rollout's worth of memory at the peak)
                self._rollout = None
                self._rollout = self._make_rollout(epoch, rollout, *next(prompts))  # no local keeps an experience
            for j in range(offset, per_rollout):
                self._rollout["position"] = j + 1
                yield self._micro_batch(j, epoch * len(self) + rollout * per_rollout + j)
            offset = 0
        self._rollout = None

    def _prompt_rows(self, epoch: int, rollouts: range):
        """(rows, dataset indices) of each rollout in `rollouts`, each prompt `num_generations` times in a row; read
        ahead by `num_workers` workers (seeded by their own generator: the global RNG is not drawn from)."""
        batches = [[i for i in self.rollout_indices(epoch, r) for _ in range(self.num_generations)] for r in rollouts]
        if not self.num_workers:
            return ((_rows(self._dataset, indices), indices) for indices in batches)
        reader = DataLoader(self._dataset, batch_sampler=batches, num_workers=self.num_workers, collate_fn=list,
                            generator=seeded_generator(self.seed, epoch, 4))
        return zip(reader, batches)

    def _make_rollout(self, epoch: int, rollout: int, rows: list[dict], indices: list[int]) -> dict:
        extra = {"refill": self._refill(epoch, rollout)} if self.refill else {}
        experience, stats = self.make_experience(rows, indices, **extra)
        return {"epoch": epoch, "rollout": rollout, "position": 0, "experience": experience, "stats": stats,
                "order": self._batch_order(epoch, rollout, experience)}

    def _micro_batch(self, j: int, global_index: int) -> dict:
        current = self._rollout
        batch = current["experience"].select(current["order"][j]).trimmed().to_dict()
        batch["rollout_stats"] = dict(current["stats"])
        if self.extra_batch is not None:
            batch.update(self.extra_batch(global_index))
        return batch

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_state(self, checkpoint_dir: str) -> None:
        """Write the current rollout's experience into the checkpoint if the checkpoint cuts it in the middle."""
        current = self._rollout
        if current is None or current["position"] in (0, self.batches_per_rollout):
            return
        os.makedirs(checkpoint_dir, exist_ok=True)
        state = {**current, "experience": current["experience"].to("cpu").to_dict()}
        torch.save(state, os.path.join(checkpoint_dir, EXPERIENCE_FILE.format(rank=self.process_index)))

    def _restore(self, epoch: int, rollout: int, position: int) -> dict:
        directory = self.get_resume_dir()
        path = os.path.join(directory or "", EXPERIENCE_FILE.format(rank=self.process_index))
        if directory is None or not os.path.isfile(path):
            raise FileNotFoundError(
                f"resuming at micro-batch {position} of rollout {rollout} (epoch {epoch}) needs that rollout's "
                f"experience, but {path} does not exist; the checkpoint was not written by PPOTrainer, or with "
                "another batch configuration")
        state = torch.load(path, map_location="cpu", weights_only=True)
        found = (state["epoch"], state["rollout"], state["position"])
        if found != (epoch, rollout, position):
            raise ValueError(f"{path} holds (epoch, rollout, position) = {found}, but the resumed run is at "
                             f"{(epoch, rollout, position)}: the batch configuration changed since the checkpoint")
        state["experience"] = Experience.from_dict(state["experience"]).to(self.device or "cpu")
        return state


def _rows(dataset: Dataset, indices: list[int]) -> list[dict]:
    columns = dataset[indices]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]
