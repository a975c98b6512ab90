"""Repeated preemption (issue 44, item 2): a toy run killed with SIGKILL at seeded random moments, resumed each time
with `resume_from_checkpoint="latest"`, then stopped once with SIGTERM and resumed to its end, must end with the
weights and the logged metrics of the same run left alone.

    python bench/chaos.py                                  # PPO, GRPO with tools, DPO: 10 SIGKILLs + 1 SIGTERM each
    python bench/chaos.py --trainers dpo --kills 3 --seed 1

One SIGTERM comes first (the next attempt resumes from its checkpoint), then the kills. The moments, drawn with
`random.Random(seed)`: sorted steps spread over the rest of the run (a step after the checkpoint resumed from at the
earliest), the kinds taken in turn (each one the run still reaches there):
  - between steps: after an optimizer step, before its save;
  - inside a save: while `optimizer.pt`, `scheduler.pt` or `rng_state.pth` of the staged checkpoint is being written
    (left 0 bytes, as a write cut by the kill), or with the staged folder complete, before its rename;
  - mid-rollout (PPO, GRPO): inside the reward call of a rollout, generation done, the rest of the rollout not;
  - during a tool call (GRPO with tools): inside the tool function, on its worker thread.
Each attempt is a child forked from this process (no re-import of torch) that patches the point and, when it gets
there, sets a fork-context Event and waits: the kill lands exactly there, not at a racy wall-clock time. The
SIGTERM attempt waits for the signal instead, then runs on: it must save at the next step boundary and stop
(`hf_rlhf.training.preemption`; the child exits 0 only when `trainer.preempted` says so). The last resume runs in
this process, so its model and log history are compared with the uninterrupted run's directly.

Prints one JSON line per trainer: kills, the moments, the SIGTERM's step and time to exit, max |weight difference|,
the metrics compared and the largest difference, the wall time of the reference and of the chaos run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_rlhf.training.checkpoints import latest_complete_checkpoint  # noqa: E402

NOT_COMPARED = {"tokens_per_second"}  # wall-clock figures in the step logs
MAX_STEPS = {"ppo": 16, "grpo_tools": 16, "dpo": 16}
ROLLOUT_STEPS = 4  # optimizer steps of one PPO / GRPO rollout (2 mini-batches x 2 epochs)
SAVE_STEPS = 2
KINDS = {"ppo": ("between steps", "inside a save", "mid-rollout"),
         "grpo_tools": ("between steps", "inside a save", "mid-rollout", "during a tool call"),
         "dpo": ("between steps", "inside a save")}
SAVE_POINTS = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "before the rename")


# ---------------------------------------------------------------------------------------------------
# the hook: where the child stops to be killed (or signalled)


class Hook:
    """One moment `(kind, step, detail)`: fires the first time `kind` happens at or after `step` (the last finished
    optimizer step), in the child only. `mode` "kill": set `reached` and wait for SIGKILL; "term": set `reached`,
    wait until the parent has sent SIGTERM, then go on."""

    current = None  # the child's hook (a forked child has its own copy of this class attribute)
    step = 0  # the last finished optimizer step, kept by `StepTracker`

    def __init__(self, kind, step, detail, mode, reached, sent):
        self.kind, self.target, self.detail, self.mode = kind, step, detail, mode
        self.reached, self.sent = reached, sent
        self.fired = False

    @classmethod
    def at(cls, kind: str, detail: str | None = None, step: int | None = None) -> None:
        hook = cls.current
        if hook is None or hook.fired or hook.kind != kind or (detail is not None and hook.detail != detail):
            return
        if (cls.step if step is None else step) < hook.target:
            return
        hook.fired = True
        hook.reached.set()
        if hook.mode == "kill":
            time.sleep(600)  # killed here
        else:
            hook.sent.wait(60)


class StepTracker(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        Hook.step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        Hook.step = state.global_step
        Hook.at("between steps")


def install_save_hooks() -> None:
    """In the child: `torch.save` of a checkpoint's file and the publishing rename stop at the hook."""
    import hf_rlhf.training.checkpoints as checkpoints

    save, publish = torch.save, checkpoints.AtomicCheckpointMixin._publish

    def hooked_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and "checkpoint-" in str(f):
            step = int(str(f).split("checkpoint-")[-1].split(os.sep)[0])
            hook = Hook.current
            if hook is not None and hook.kind == "inside a save" and hook.detail == os.path.basename(str(f)):
                open(f, "wb").close()  # as a write cut by the kill
                Hook.at("inside a save", os.path.basename(str(f)), step)
        return save(obj, f, *args, **kwargs)

    def hooked_publish(staged, final):
        Hook.at("inside a save", "before the rename", int(final.rsplit("-", 1)[1]))
        return publish(staged, final)

    torch.save = hooked_save
    checkpoints.AtomicCheckpointMixin._publish = staticmethod(hooked_publish)


def own_progress_bar_lock():
    """The forked child's own tqdm locks (a child killed inside a bar must not leave the parent's lock taken; see
    tests/integration/test_faults.py)."""
    from tqdm.std import TqdmDefaultWriteLock, tqdm

    TqdmDefaultWriteLock.mp_lock = multiprocessing.get_context("fork").RLock()
    classes = [tqdm]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if "_lock" in vars(cls) or cls is tqdm:
            cls.set_lock(TqdmDefaultWriteLock())


# ---------------------------------------------------------------------------------------------------
# the three toy runs


def toy_reward(prompts, completions, **kwargs):
    Hook.at("mid-rollout")
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) + 0.1 * i for i, t in enumerate(texts)]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    Hook.at("during a tool call")
    return a + b


def scripted_first_turn(tokenizer, inner):
    """An engine whose first turn of a row calls `add` with a number drawn from torch's RNG (a tiny random policy never
    writes a tool call itself); later turns are sampled by the model through `inner`."""
    from hf_rlhf.generation.engines import GenerationEngine

    marker = tokenizer("result:", add_special_tokens=False)["input_ids"]

    class FirstTurnCalls(GenerationEngine):
        def _generate(self, model, query_ids, query_mask, kwargs):
            a = int(torch.randint(0, 1000, (1,)).item())
            call = tokenizer(f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": 2}}}}</tool_call><|eos|>',
                             add_special_tokens=False)["input_ids"][:kwargs["max_new_tokens"]]
            seen = []
            for ids, mask in zip(query_ids, query_mask):
                context = ids[mask.bool()].tolist()
                seen.append(any(context[i:i + len(marker)] == marker for i in range(len(context))))
            later = [i for i, s in enumerate(seen) if s]
            sampled = inner._generate(model, query_ids[later], query_mask[later], kwargs).tolist() if later else []
            rows = [sampled.pop(0) if s else call for s in seen]
            width = max(len(r) for r in rows)
            return torch.tensor([r + [kwargs["pad_token_id"]] * (width - len(r)) for r in rows])

    return FirstTurnCalls()


def build(kind: str, output_dir: str, callbacks=()):
    """The toy trainer of `kind` writing to `output_dir`: a checkpoint every 2 steps, a log every step."""
    from hf_rlhf.toy import build_toy_model, build_toy_tokenizer, build_toy_tool_tokenizer

    common = dict(output_dir=str(output_dir), max_steps=MAX_STEPS[kind], logging_steps=1, save_strategy="steps",
                  save_steps=SAVE_STEPS, report_to="none", seed=0, disable_tqdm=True, learning_rate=3e-3)
    callbacks = [StepTracker(), *callbacks]
    if kind == "dpo":
        from hf_rlhf import DPOConfig, DPOTrainer
        from hf_rlhf.toy import preference_dataset

        tokenizer = build_toy_tokenizer()
        args = DPOConfig(per_device_train_batch_size=8, max_length=48, warmup_steps=0, **common)
        return DPOTrainer(build_toy_model(tokenizer, "tiny", seed=0), args=args, processing_class=tokenizer,
                          train_dataset=preference_dataset(128, seed=1), callbacks=callbacks)
    from hf_rlhf.trainers.ppo_config import PPOConfig
    from hf_rlhf.trainers.ppo_trainer import PPOTrainer

    rollout = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, num_mini_batches=2, num_ppo_epochs=2,
                   temperature=1.0, kl_target=0.5, kl_horizon=40)
    if kind == "ppo":
        from hf_rlhf.toy import prompt_dataset

        tokenizer = build_toy_tokenizer()
        args = PPOConfig(response_length=6, reward_normalization="running", **rollout, **common)
        return PPOTrainer(build_toy_model(tokenizer), toy_reward, args=args, train_dataset=prompt_dataset(16, seed=0),
                          processing_class=tokenizer, callbacks=callbacks)
    from datasets import Dataset

    tokenizer = build_toy_tool_tokenizer()
    prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{40 + i}+2="}]} for i in range(8)])
    args = PPOConfig(response_length=100, rollout_batch_size=4, max_tool_calling_iterations=2, tool_call_timeout=30.0,
                     advantage_estimator="grpo", num_generations=2, kl_in_loss=True, **rollout, **common)
    trainer = PPOTrainer(build_toy_model(tokenizer), toy_reward, args=args, train_dataset=prompts,
                         processing_class=tokenizer, callbacks=callbacks, tools=[add])
    trainer.rollout_maker.engine = scripted_first_turn(tokenizer, trainer.rollout_maker.engine)
    return trainer


# ---------------------------------------------------------------------------------------------------
# one attempt, the whole chaos run


def latest_step(run_dir: str) -> int:
    found = latest_complete_checkpoint(run_dir)
    return int(found.rsplit("-", 1)[1]) if found else 0


def kill_plan(rng: random.Random, kind: str, kills: int, after: int) -> list[tuple[int, str]]:
    """`kills` (step, kind of moment): seeded steps spread over the rest of the run (sorted), the kinds of moment
    taken in turn from a seeded shuffle so that every kind is hit."""
    steps = sorted(rng.randint(after + 1, MAX_STEPS[kind] - 1) for _ in range(kills))
    kinds = []
    while len(kinds) < kills:
        kinds += rng.sample(KINDS[kind], len(KINDS[kind]))
    return list(zip(steps, kinds))


def draw_moment(rng: random.Random, kind: str, after: int, aim: int, wanted: str | None = None,
                margin: int = 0) -> tuple[str, int, str | None]:
    """A moment at step `aim` (or the step after `after`, the checkpoint resumed from, when that is later) that the run
    still reaches `margin` steps before its end (a SIGTERM there must still stop it early): (kind of moment, step,
    detail). `wanted` when the run still has it there (rollout moments fire at the next rollout, so need one left)."""
    last = MAX_STEPS[kind] - margin
    step = min(max(aim, after + 1), last - 1)
    kinds = [k for k in KINDS[kind] if k not in ("mid-rollout", "during a tool call") or step <= last - ROLLOUT_STEPS]
    moment = wanted if wanted in kinds else rng.choice(kinds)
    return moment, step, rng.choice(SAVE_POINTS) if moment == "inside a save" else None


def _child(kind, run_dir, moment, mode, reached, sent):
    own_progress_bar_lock()
    install_save_hooks()
    Hook.current = Hook(*moment, mode, reached, sent)
    resume = "latest" if latest_complete_checkpoint(run_dir) else None  # the first attempt may have nothing yet
    trainer = build(kind, run_dir)
    trainer.train(resume_from_checkpoint=resume)
    os._exit(0 if trainer.preempted is not None or mode == "kill" else 3)


def attempt(kind: str, run_dir: str, moment, mode: str = "kill", timeout: float = 300.0) -> dict:
    """Run the child to `moment`, then SIGKILL it (mode "kill") or SIGTERM it and wait for its exit (mode "term")."""
    fork = multiprocessing.get_context("fork")
    reached, sent = fork.Event(), fork.Event()
    child = fork.Process(target=_child, args=(kind, run_dir, moment, mode, reached, sent))
    record = {"moment": list(moment), "resumed_from": latest_step(run_dir)}
    start = time.monotonic()
    child.start()
    deadline = start + timeout
    while not reached.wait(0.05):
        if not child.is_alive():
            raise RuntimeError(f"{kind}: the child ended (exit {child.exitcode}) before the moment {moment}")
        if time.monotonic() > deadline:
            child.kill()
            raise RuntimeError(f"{kind}: the moment {moment} was not reached in {timeout} s")
    if mode == "kill":
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        record["exit"] = child.exitcode
    else:
        signalled = time.monotonic()
        os.kill(child.pid, signal.SIGTERM)
        sent.set()
        child.join(timeout)
        record.update(exit=child.exitcode, seconds_to_exit=round(time.monotonic() - signalled, 2),
                      checkpoint_step=latest_step(run_dir))
    record["seconds"] = round(time.monotonic() - start, 2)
    return record


def step_logs(trainer) -> dict:
    return {h["step"]: {k: v for k, v in h.items() if k not in NOT_COMPARED}
            for h in trainer.state.log_history if "loss" in h}


def compare(reference, resumed) -> dict:
    """Max |weight difference| and the logged metrics compared, step by step."""
    sa, sb = reference.model.state_dict(), resumed.model.state_dict()
    assert sa.keys() == sb.keys()
    weights = max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)
    ref, got = step_logs(reference), step_logs(resumed)
    keys = sorted({k for log in ref.values() for k in log})
    differences = [abs(ref[s][k] - got[s][k]) for s in ref if s in got for k in ref[s]
                   if k in got[s] and isinstance(ref[s][k], (int, float))]
    mismatched = sorted({k for s in ref for k in ref[s] if s not in got or got[s].get(k, object()) != ref[s][k]})
    return {"max_weight_difference": weights, "steps_logged": sorted(got) == sorted(ref) and len(ref),
            "metrics_compared": len(keys), "metric_names": keys, "max_metric_difference": max(differences),
            "metrics_not_equal": mismatched}


def chaos(kind: str, workdir: str, kills: int = 10, seed: int = 0, sigterm: bool = True) -> dict:
    """The uninterrupted run, then `kills` SIGKILLs and one SIGTERM at seeded moments, then the last resume."""
    torch.set_num_threads(1)  # forking is safe with one intra-op thread; tiny matmuls run fastest on one
    start = time.monotonic()
    reference = build(kind, os.path.join(workdir, "full"))
    reference.train()
    reference_s = time.monotonic() - start
    run_dir = os.path.join(workdir, "chaos")
    os.makedirs(run_dir, exist_ok=True)
    rng = random.Random(seed)
    start = time.monotonic()
    # the SIGTERM first (a fresh run: the moment leaves steps to stop early), then every kill resumes
    term = None
    if sigterm:
        term = attempt(kind, run_dir, draw_moment(rng, kind, 0, rng.randint(1, 3), margin=SAVE_STEPS), mode="term")
    records = [attempt(kind, run_dir, draw_moment(rng, kind, latest_step(run_dir), aim, wanted))
               for aim, wanted in kill_plan(rng, kind, kills, latest_step(run_dir))]
    if term is not None:
        term["next_attempt_resumed_from"] = records[0]["resumed_from"] if records else None
    resumed = build(kind, run_dir)
    resumed.train(resume_from_checkpoint="latest")
    chaos_s = time.monotonic() - start
    return {"trainer": kind, "kills": len(records), "killed_exit_codes": sorted({r["exit"] for r in records}),
            "moments": [r["moment"] for r in records], "sigterm": term, **compare(reference, resumed),
            "reference_s": round(reference_s, 1), "chaos_s": round(chaos_s, 1)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", default="ppo,grpo_tools,dpo", help="comma-separated: ppo, grpo_tools, dpo")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="kept when given (default: a temporary folder)")
    args = parser.parse_args(argv)
    out = []
    for kind in args.trainers.split(","):
        with tempfile.TemporaryDirectory(prefix=f"chaos-{kind}-") as tmp:
            result = chaos(kind, os.path.join(args.workdir, kind) if args.workdir else tmp, args.kills, args.seed)
        result.pop("metric_names")
        print(json.dumps(result), flush=True)
        out.append(result)
    return out


if __name__ == "__main__":
    main()
