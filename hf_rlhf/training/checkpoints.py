"""Atomic checkpoints and "resume from the latest complete checkpoint".

The Trainer writes `checkpoint-N` in place, file after file: a process killed during the save leaves an empty
folder, weights without `trainer_state.json`, or a 0-byte `optimizer.pt`, and `resume_from_checkpoint=True` then
picks that folder and crashes. Here the Trainer's own `_save_checkpoint` runs unchanged but into a staging folder
`.tmp-checkpoint-N/` of the same output directory; every rank waits, the files and folders are fsync'ed, and the
main process renames the staged `checkpoint-N` into place, one atomic `rename`. Only then are old checkpoints
rotated. A checkpoint therefore exists whole or not at all.

`latest_complete_checkpoint` is the reader's half: the newest `checkpoint-N` whose files are all there (so a broken
folder left by an older, in-place writer is skipped too), with a warning naming every folder skipped.

A bad environment is named, and leaves nothing half-written: an output directory that cannot be written (read-only,
no permission) stops `train()` before the first step (`check_writable`); a save that fails (a full disk: torch's
writer reports it as a `RuntimeError` about a file position, safetensors as its own error; a folder deleted under
the save) removes its staging folder and raises `CheckpointWriteError`, which names the checkpoint, the cause, the
free space and the last complete checkpoint to resume from; an output directory deleted between two saves is
written again, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import zipfile

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

logger = logging.getLogger("hf_rlhf")

STAGING_PREFIX = ".tmp-"
TRAINER_STATE = "trainer_state.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
OPTIMIZER_FILES = ("optimizer.pt", "scheduler.pt")

_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (nothing of it was published). `errno` is the cause's, when it had one."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


def check_writable(output_dir: str) -> None:
    """Create `output_dir` if needed and write (then remove) a probe file in it.

    Raises:
        CheckpointWriteError: naming the folder and the system's reason (read-only file system, permission denied,
            no space left).
    """
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hf_rlhf-write-check-", dir=output_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise CheckpointWriteError(
            f"output_dir {output_dir!r} cannot be written ({err.strerror or err}): checkpoints and the trained model "
            "are saved there; give a writable --output_dir (or save_strategy='no' to train without checkpoints)",
            err.errno) from err


def _free_space(folder: str) -> str:
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        return f"{shutil.disk_usage(folder or '.').free / 2**20:,.0f} MiB free there"
    except OSError:
        return "free space unknown"


def file_problem(path: str) -> str | None:
    """Why a written weights / optimizer / RNG file is cut short, or None: a torch archive (`.pt`, `.pth`, `.bin`:
    a zip) whose central directory is missing or names bytes past the end, or a `.safetensors` file shorter than its
    header says. A full disk can leave such a file without any error from the writer (torch's writer reported none
    when writing to /dev/full here). Reads the header / directory only, not the tensors."""
    name, size = os.path.basename(path), os.path.getsize(path)
    try:
        if name.endswith(".safetensors"):
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length))
            end = 8 + length + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        elif name.endswith((".pt", ".pth", ".bin")):
            with zipfile.ZipFile(path) as archive:
                end = max((i.header_offset + i.compress_size for i in archive.infolist()), default=0)
        else:
            return None
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as err:
        return f"{name} is unreadable ({type(err).__name__}: {err})"
    return f"{name} is cut short ({size} bytes, its index names {end})" if size < end else None


def _files_problem(folder: str) -> str | None:
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        problem = file_problem(path) if os.path.isfile(path) and os.path.getsize(path) > 0 else None
        if problem is not None:
            return problem
    return None


def checkpoint_problem(folder: str, save_only_model: bool = False) -> str | None:
    """Why `folder` is not a complete checkpoint, or None when it is.

    Complete: `trainer_state.json` parses; a weights file (or every shard of a weights index) is present and not
    empty; unless `save_only_model`, `optimizer.pt` and `scheduler.pt` are there and not empty, or a DeepSpeed
    `latest` tag names a non-empty folder (DeepSpeed keeps its optimizer there); no file is cut short
    (`file_problem`).
    """
    def nonempty(name):
        path = os.path.join(folder, name)
        return os.path.isfile(path) and os.path.getsize(path) > 0

    try:
        with open(os.path.join(folder, TRAINER_STATE), encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as err:
        return f"{TRAINER_STATE} is missing or unreadable ({type(err).__name__})"
    weights = [name for name in WEIGHT_FILES if nonempty(name)]
    for index in WEIGHT_INDEXES:
        if nonempty(index):
            try:
                with open(os.path.join(folder, index), encoding="utf-8") as f:
                    shards = set(json.load(f)["weight_map"].values())
            except (OSError, ValueError, KeyError):
                return f"{index} is unreadable"
            missing = sorted(s for s in shards if not nonempty(s))
            if missing:
                return f"weight shards missing or empty: {', '.join(missing)}"
            weights.append(index)
    deepspeed_tag = None
    if nonempty("latest"):
        with open(os.path.join(folder, "latest"), encoding="utf-8") as f:
            deepspeed_tag = f.read().strip()
    if not weights and deepspeed_tag is None:
        return f"no weights file (one of {', '.join(WEIGHT_FILES + WEIGHT_INDEXES)}), or an empty one"
    if not save_only_model:
        if deepspeed_tag is not None:
            tag_dir = os.path.join(folder, deepspeed_tag)
            if not (os.path.isdir(tag_dir) and os.listdir(tag_dir)):
                return f"the DeepSpeed folder {deepspeed_tag!r} named by `latest` is missing or empty"
        else:
            missing = [name for name in OPTIMIZER_FILES if not nonempty(name)]
            if missing:
                return f"{', '.join(missing)} missing or empty (save_only_model was off)"
    return _files_problem(folder)


def latest_complete_checkpoint(output_dir: str, save_only_model: bool = False) -> str | None:
    """The newest complete `checkpoint-N` folder of `output_dir`, or None.

    Staging folders (`.tmp-checkpoint-N`, a save that never finished) and incomplete checkpoints (see
    `checkpoint_problem`) are skipped, each with a warning that names it and says why.
    """
    if not os.path.isdir(output_dir):
        return None
    steps = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            steps.append((int(match.group(1)), name))
        elif name.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR):
            logger.warning("[hf_rlhf] skipping %s: a checkpoint save that never finished",
                           os.path.join(output_dir, name))
    for _, name in sorted(steps, reverse=True):
        folder = os.path.join(output_dir, name)
        problem = checkpoint_problem(folder, save_only_model)
        if problem is None:
            return folder
        logger.warning("[hf_rlhf] skipping incomplete checkpoint %s: %s", folder, problem)
    return None


def _fsync_tree(root: str) -> None:
    """fsync every file under `root`, then every folder (so the names are durable too)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in sorted(files):
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some filesystems (and Windows) do not open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicCheckpointMixin:
    """For `transformers.Trainer` subclasses (put it before `Trainer` in the bases): atomic checkpoint saves, and
    `train(resume_from_checkpoint=True | "latest")` resuming from `latest_complete_checkpoint`.

    A subclass that writes its own files into a checkpoint overrides `_save_checkpoint_extras(folder)`; it runs
    first, inside the staging folder.
    """

    _staging_dir: str | None = None
    _published: str | None = None  # the last checkpoint this trainer published

    def _get_output_dir(self, trial):
        # while a checkpoint is staged, the Trainer's save (and its rotation, a no-op there) runs in the staging dir
        return self._staging_dir if self._staging_dir is not None else super()._get_output_dir(trial)

    def _save_checkpoint_extras(self, checkpoint_dir: str) -> None:
        """Files a subclass adds to the checkpoint folder (written before the Trainer's own)."""

    def _save_checkpoint(self, model, trial):
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging, final = os.path.join(run_dir, STAGING_PREFIX + name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.isdir(run_dir):  # staging folders left by saves that were killed
            for stale in os.listdir(run_dir):
                if stale.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR):
                    shutil.rmtree(os.path.join(run_dir, stale), ignore_errors=True)
        if self.args.should_save and self._published and not os.path.isdir(run_dir):
            logger.warning("[hf_rlhf] output_dir %s was deleted since %s was saved; writing %s into a new one",
                           run_dir, self._published, name)
        self.accelerator.wait_for_everyone()
        push, self.args.push_to_hub = self.args.push_to_hub, False  # pushed from the final folder, below
        self._staging_dir = staging
        try:
            self._save_checkpoint_extras(os.path.join(staging, name))
            super()._save_checkpoint(model, trial)
        except Exception as err:  # a full disk reaches here as torch's RuntimeError or safetensors' own error
            raise self._write_failed(err, staging, name, run_dir) from err
        finally:
            self._staging_dir, self.args.push_to_hub = None, push
        staged_best = os.path.join(staging, name)
        if self.state.best_model_checkpoint == staged_best:  # the Trainer saw the staging path
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged_best, TRAINER_STATE))
        self.accelerator.wait_for_everyone()  # every rank's files are in the staging folder
        if self.args.should_save:
            try:
                problem = _files_problem(staged_best)  # a file a full disk cut short without telling the writer
                if problem is not None:
                    raise CheckpointWriteError(f"{problem}; the disk may be full")
                self._publish(staged_best, final)
            except (OSError, CheckpointWriteError) as err:
                raise self._write_failed(err, staging, name, run_dir) from err
            self._published = final
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()
        if push:
            self._push_from_checkpoint(final)

    def _write_failed(self, err: Exception, staging: str, name: str, run_dir: str) -> CheckpointWriteError:
        """Remove the staging folder (it may hold most of a full disk's last bytes) and say what failed."""
        cause = f"{type(err).__name__}: {err}"
        if not os.path.isdir(staging):
            cause += f" ({'output_dir' if not os.path.isdir(run_dir) else 'the staging folder'} was deleted during "
            cause += "the save)"
        shutil.rmtree(staging, ignore_errors=True)
        last = latest_complete_checkpoint(run_dir, self.args.save_only_model)
        return CheckpointWriteError(
            f"{name} could not be written to {run_dir} ({cause}; {_free_space(run_dir)}). Nothing of it was "
            f"published; the last complete checkpoint is {last or 'none'}. Free space or give a writable "
            "--output_dir, then resume with --resume_from_checkpoint latest", getattr(err, "errno", None))

    @staticmethod
    def _publish(staged: str, final: str) -> None:
        """fsync `staged`, then rename it to `final` (an older folder of that name is moved aside first)."""
        _fsync_tree(staged)
        old = None
        if os.path.exists(final):  # e.g. an incomplete in-place checkpoint, or a re-run of the same step
            old = os.path.join(os.path.dirname(final), STAGING_PREFIX + os.path.basename(final) + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(staged, final)
        _fsync_dir(os.path.dirname(final))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def resolve_resume_checkpoint(self, resume_from_checkpoint):
        """`True` / `"latest"` -> the latest complete checkpoint of `output_dir` (ValueError when there is none);
        any other value unchanged."""
        if resume_from_checkpoint is True or resume_from_checkpoint == "latest":
            found = latest_complete_checkpoint(self.args.output_dir, self.args.save_only_model)
            if found is None:
                raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: no complete checkpoint-N "
                                 f"folder in output_dir {self.args.output_dir!r} (incomplete ones are named in the "
                                 "warnings above); pass a checkpoint path, or start without resuming")
            logger.info("[hf_rlhf] resuming from %s", found)
            return found
        return resume_from_checkpoint

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        if self.args.should_save and self.args.save_strategy != "no":  # fail before the first step, not at a save
            check_writable(self.args.output_dir)
        return super().train(resume_from_checkpoint=self.resolve_resume_checkpoint(resume_from_checkpoint),
                             trial=trial, **kwargs)
