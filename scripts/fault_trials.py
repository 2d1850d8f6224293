"""Kill a training run with SIGKILL at random moments (inside checkpoint writes too), resume it with
`--resume auto`, and check that every trial resumes from the newest complete checkpoint and ends with the
losses and weights of an uninterrupted run.

    python scripts/fault_trials.py --trials 20                 # tiny CPU model on Tiny Shakespeare (chars)
    python scripts/fault_trials.py --trials 50 --kills 3 --out /tmp/faults --seed 7
    python scripts/fault_trials.py --seed 7 --trials 50 --kills 3 --only 12   # replay one trial's kill plan

Each trial kills the run up to --kills times, then resumes it to the end. The seed draws every trial's kill
plan up front; trial k's first kill is of kind KINDS[k % 4], so any 4 trials in a row cover them all:

    early N.NNs     N.NN s after launch: the trainer's own start-up (lock, recovery, resume, data) or the first steps
    staging S +Ds   D s after the save of step S creates its hidden staging folder: inside the write
    published S     the instant step S's folder is published, before `latest` names it
    between S       the instant step S (not a save step) is logged: between two saves

Each trial's trainer wraps the steps of a checkpoint save (see pause_after_save_steps) so that it pauses
after each, which widens those windows enough to hit; the library itself has no such hook.
Runs are forked from a server process that has imported torch and gpt2train once, so a launch costs tenths
of a second instead of the ~3 s of a fresh interpreter; what a kill can break (files on disk) is the same.
Exit status 1 when any trial ends otherwise than the uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tqdm import tqdm  # noqa: E402

import gpt2train.checkpoint.format as checkpoint_files  # noqa: E402  where a save's steps run
from gpt2train.checkpoint import checkpoint_name  # noqa: E402
from gpt2train.config import Config, dump_toml  # noqa: E402
from gpt2train.model import GPTConfig  # noqa: E402
from gpt2train.runlog import METRICS_FILE, load_run  # noqa: E402

KINDS = ("early", "staging", "published", "between")
EARLY_S = 0.6  # early kills fall in [0, EARLY_S): a forked launch reaches its first save in about 0.4 s here


# The record-setting recipe's keys (issue 45), for trials of a run that uses every one of them: each has state a
# resume must restore (NorMuon's second moment, the value tables and skip weights, the window's schedule).
RECIPE = {"train.optimizer": "muon", "train.muon_orthogonalizer": "polar_express", "train.muon_normalize": True,
          "train.cautious_weight_decay": True, "train.muon_weight_decay": 0.1, "model.value_embeddings": 1,
          "model.unet_skips": True, "model.attention_window": 16, "train.window_warmup_steps": 4,
          "model.mtp_weight": 0.3, "train.embedding_lr": 0.01}


def tiny_config(data_dir: Path, max_steps: int = 8, recipe: dict | None = None) -> Config:
    """A 2-layer model that takes a few milliseconds a step, saving every 2 steps; recipe: keys set on top."""
    cfg = Config()
    cfg.model = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=0)
    cfg.data.dir = str(data_dir)
    cfg.train.device, cfg.train.dtype, cfg.train.compile = "cpu", "float32", False
    cfg.train.micro_batch, cfg.train.seq_len = 4, 32
    cfg.train.max_steps, cfg.train.warmup_steps, cfg.train.lr = max_steps, 2, 1e-3
    cfg.eval.interval, cfg.eval.val_batches = 4, 2
    cfg.log.interval, cfg.log.progress = 1, "lines"
    cfg.checkpoint.every_steps, cfg.checkpoint.keep_last = 2, 2
    for key, value in (recipe or {}).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


# --- widening a save's windows ---------------------------------------------------------------------------
def save_steps() -> list[tuple[object, str]]:
    """(owner, name) of each step of a checkpoint save, in the order a ring save takes them: the weights file,
    the state file, the fsync of the staged folder (also taken by the copy to best/), the publishing rename."""
    files = checkpoint_files
    return [(files, "save_safetensors"), (files.torch, "save"), (files, "_fsync_tree"), (files, "publish")]


def after_each_save_step(after, setattr=setattr) -> None:
    """Call after() each time a step of a save has returned. Pass monkeypatch.setattr to have it undone."""
    def followed_by_after(original):
        def step(*args, **kwargs):
            result = original(*args, **kwargs)
            after()
            return result

        return step

    for owner, name in save_steps():
        setattr(owner, name, followed_by_after(getattr(owner, name)))


def pause_after_save_steps(seconds: float) -> None:
    """A ring save then pauses 3 times before its folder is published and once more before `latest` moves."""
    if seconds > 0:
        after_each_save_step(lambda: time.sleep(seconds))


# --- launching and killing ------------------------------------------------------------------------------
_context = None


def forkserver():
    """Children fork from one server that imported the trainer (and torch._dynamo, which the optimizer pulls
    in) but never ran a torch op, so no thread pool is copied half-locked into a child. Each child imports the
    caller's __main__ module, so a script that calls in here keeps its work under `if __name__ == "__main__"`."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["gpt2train.cli", "gpt2train.training.loop", "torch._dynamo"])
    return _context


def _train_in_child(argv: list[str], log: str, sleep_in_save: float):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # a file, not a pipe nobody reads
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    pause_after_save_steps(sleep_in_save)
    torch.set_num_threads(1)  # the same kernels, so the same bits, in every run compared
    # tqdm's default lock is a named semaphore; a killed child never frees it and the tracker warns at exit
    tqdm.set_lock(threading.RLock())
    from gpt2train import cli

    status = cli.main(argv)
    Path(log + ".status").write_text(str(status or 0))  # see exit_status
    sys.exit(status)


def launch(config: Path, out: Path, resume: bool, sleep_in_save: float = 0.0):
    argv = ["train", "--config", str(config), "--out", str(out)] + (["--resume", "auto"] if resume else [])
    Path(f"{log_file(out)}.status").unlink(missing_ok=True)
    proc = forkserver().Process(target=_train_in_child, args=(argv, str(log_file(out)), sleep_in_save))
    proc.start()
    return proc


def log_file(out: Path) -> Path:
    return out.parent / f"{out.name}.log"


def exit_status(proc, out: Path) -> int | None:
    """The child's exit status. multiprocessing's forkserver reports 255 when it cannot read the status back
    (an EOF on its pipe: on 2026-11-25 a trainer that had logged "finished at step 8 (done)" came back as 255
    in one full-suite run); the child writes cli.main's own status beside its log, which then says what
    really happened. A child killed or crashed before that writes nothing, and its status stands."""
    status = Path(f"{log_file(out)}.status")
    if proc.exitcode == 255 and status.exists():
        return int(status.read_text())
    return proc.exitcode


def check_finished(proc, out: Path) -> None:
    """Raise, with the log's tail, unless the training in proc ended with status 0 (one still running after
    its join's timeout is killed first)."""
    status = exit_status(proc, out)
    if status != 0:
        proc.kill()
        log = log_file(out).read_text()[-2000:]
        raise RuntimeError(f"training in {out} failed with exit status {status}:\n{log}")


def run_to_end(config: Path, out: Path, resume: bool, sleep_in_save: float = 0.0) -> float:
    start = time.time()
    proc = launch(config, out, resume, sleep_in_save)
    proc.join(timeout=600)
    check_finished(proc, out)
    return time.time() - start


def kill_when(proc, out: Path, due, timeout: float = 600) -> bool:
    """SIGKILL `proc` once due() holds; False when it finished first."""
    started = time.time()
    while proc.is_alive():
        if due():
            proc.kill()
            proc.join()
            return True
        if time.time() - started > timeout:
            proc.kill()
            raise TimeoutError(f"training in {out} ran past {timeout} s")
        time.sleep(0.005)
    proc.join()
    check_finished(proc, out)
    return False


# --- kill moments -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kill:
    kind: str  # one of KINDS
    step: int = 0  # the save (staging, published) or logged step (between) that triggers it
    delay: float = 0.0  # seconds after launch (early) or after the staging folder appears (staging)

    def __str__(self):
        return {"early": f"early {self.delay:.2f}s", "staging": f"staging {self.step} +{self.delay:.2f}s",
                "published": f"published {self.step}", "between": f"between {self.step}"}[self.kind]

    def watch(self, out: Path, launched: float):
        """A function that says when to kill the launch that started at `launched`. Only files made by this
        launch count: the previous one may have left the same names behind."""
        root, seen = out / "checkpoints", []

        def made_now(path: Path) -> bool:
            try:
                return path.stat().st_mtime >= launched
            except OSError:
                return False

        def due() -> bool:
            if self.kind == "early":
                return time.time() - launched >= self.delay
            if self.kind == "staging":
                if not seen and made_now(root / f".tmp-{checkpoint_name(self.step)}"):
                    seen.append(time.time())
                return bool(seen) and time.time() - seen[0] >= self.delay
            if self.kind == "published":
                return made_now(root / checkpoint_name(self.step)) and latest(root) != checkpoint_name(self.step)
            return logged_step(out, launched) >= self.step

        return due


def latest(root: Path) -> str:
    try:
        return (root / "latest").read_text().strip()
    except OSError:
        return ""


def logged_step(out: Path, since: float) -> int:
    """The highest train step logged at or after `since` (0 when none)."""
    try:
        lines = (out / METRICS_FILE).read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        if '"train"' in line:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the line being written
                continue
            if rec.get("kind") == "train" and rec.get("time", 0) >= since:
                steps.append(rec["step"])
    return max(steps)


def draw_plans(seed: int, trials: int, kills: int, steps: int, every: int, sleep_in_save: float) -> list[list[Kill]]:
    """Every trial's kills, from the seed alone (not from timings), so that --only replays a trial's plan."""
    rng = random.Random(seed)
    saves = list(range(every, steps + 1, every))
    others = [s for s in range(1, steps) if s % every]
    plans = []
    for trial in range(1, trials + 1):
        plan = []
        for i in range(rng.randint(1, kills)):
            kind = KINDS[trial % len(KINDS)] if i == 0 else rng.choice(KINDS)
            if kind == "early":
                plan.append(Kill(kind, delay=rng.uniform(0, EARLY_S)))
            elif kind == "staging":  # a save pauses 3 times before it is published
                plan.append(Kill(kind, rng.choice(saves), rng.uniform(0, 3 * sleep_in_save)))
            else:
                plan.append(Kill(kind, rng.choice(saves if kind == "published" else others)))
        plans.append(plan)
    return plans


# --- one trial --------------------------------------------------------------------------------------------
@dataclass
class Reference:
    """What the uninterrupted run logged and ended with."""

    losses: dict[tuple[str, int], float]
    weights: dict[str, torch.Tensor]
    seconds: float


def losses(out: Path) -> dict[tuple[str, int], float]:
    """(kind, step) -> train or val loss, as logged; the records of re-done steps replace the earlier ones."""
    return {(r["kind"], r["step"]): r["loss" if r["kind"] == "train" else "val_loss"]
            for r in load_run(out).records if r["kind"] in ("train", "val")}


def run_starts(out: Path) -> list[dict]:
    path = out / METRICS_FILE
    if not path.is_file() or path.stat().st_size == 0:  # a launch killed before it logged its first record
        return []
    return [launch[0] for launch in load_run(out).launches if launch[0]["kind"] == "run_start"]


def newest_complete_step(out: Path) -> int:
    """The step of the newest published checkpoint (0: none). A step folder exists only complete (it is
    renamed into place after its files are synced), and every file it holds has been written."""
    root = out / "checkpoints"
    steps = [int(p.name[len("step_"):]) for p in root.glob("step_*") if (p / "meta.json").is_file()] if root.is_dir() else []
    return max(steps, default=0)


def inside_a_save(out: Path, since: float) -> bool:
    """Whether this launch (started at `since`) left a save's hidden staging folder or file behind."""
    root = out / "checkpoints"
    return root.is_dir() and any(p.name.startswith((".tmp-", ".old-", ".latest")) and p.stat().st_mtime >= since
                                 for p in root.iterdir())


@dataclass
class Trial:
    number: int
    plan: list[Kill]
    notes: list[str] = field(default_factory=list)  # what happened at each kill
    problems: list[str] = field(default_factory=list)  # how it differs from the uninterrupted run
    fired: list[str] = field(default_factory=list)  # the kinds of the kills that happened

    def line(self) -> str:
        verdict = "same" if not self.problems else "DIFFERENT: " + "; ".join(self.problems)
        return f"trial {self.number:>3}: {verdict} | plan {', '.join(map(str, self.plan))} | " + "; ".join(self.notes)


def run_trial(config: Path, out: Path, reference: Reference, steps: int, trial: Trial, sleep_in_save: float) -> Trial:
    """Launch, kill at each moment of the plan, resume until the run finishes; record what differs."""
    shutil.rmtree(out, ignore_errors=True)
    log_file(out).unlink(missing_ok=True)
    expected_start = 1  # the step a launch must start at: one past the newest complete checkpoint
    for i, kill in enumerate([*trial.plan, None]):  # None: the last launch runs to the end
        before, launched = len(run_starts(out)), time.time()
        proc = launch(config, out, resume=i > 0, sleep_in_save=sleep_in_save if kill else 0.0)
        killed = kill is not None and kill_when(proc, out, kill.watch(out, launched))
        if kill is None:
            proc.join(timeout=600)
            check_finished(proc, out)
        for start in run_starts(out)[before:]:  # none when killed before it logged one
            if start["step"] != expected_start:
                trial.problems.append(f"launch {i + 1} started at step {start['step']}, expected {expected_start} "
                                      f"(resumed from {start.get('resumed_from')})")
        if not killed:
            if kill is not None:
                trial.notes.append(f"finished before {kill}")
            break
        newest = newest_complete_step(out)
        trial.fired.append(kill.kind)
        trial.notes.append(f"killed at {kill}{' (inside a save)' if inside_a_save(out, launched) else ''}, "
                           f"newest complete checkpoint {newest}")
        expected_start = newest + 1

    logged = losses(out)
    if logged.keys() != reference.losses.keys():
        trial.problems.append(f"logged steps differ: {sorted(logged.keys() ^ reference.losses.keys())}")
    differing = sorted(k for k in logged.keys() & reference.losses.keys() if logged[k] != reference.losses[k])
    if differing:
        trial.problems.append(f"{len(differing)} losses differ, first {differing[0]}: {logged[differing[0]]!r} "
                              f"vs {reference.losses[differing[0]]!r}")
    if not same_weights(final_weights(out, steps), reference.weights):
        trial.problems.append("final weights differ")
    return trial


def final_weights(out: Path, max_steps: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / checkpoint_name(max_steps) / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- many trials ------------------------------------------------------------------------------------------
def run_trials(out: Path, data: Path, trials: int, kills: int = 2, steps: int = 8, seed: int = 0,
               sleep_in_save: float = 0.1, jobs: int = 2, only: int | None = None, say=print,
               recipe: dict | None = None) -> list[Trial]:
    """The uninterrupted reference run, then the trials (`jobs` at a time: they mostly wait on sleeps and
    start-ups, so two share a CPU well); returns them in order."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(data, steps, recipe)
    config = out / "config.toml"
    config.write_text(dump_toml(cfg))
    shutil.rmtree(out / "reference", ignore_errors=True)
    log_file(out / "reference").unlink(missing_ok=True)
    seconds = run_to_end(config, out / "reference", resume=False, sleep_in_save=sleep_in_save)
    reference = Reference(losses(out / "reference"), final_weights(out / "reference", steps), seconds)
    say(f"reference run: {steps} steps in {seconds:.1f} s; seed {seed}")

    plans = draw_plans(seed, trials, kills, steps, cfg.checkpoint.every_steps, sleep_in_save)
    chosen = [Trial(n, plan) for n, plan in enumerate(plans, 1) if only in (None, n)]

    def one(trial: Trial) -> Trial:
        return run_trial(config, out / f"trial{trial.number}", reference, steps, trial, sleep_in_save)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(one, chosen))
    for trial in done:
        say(trial.line())
    return done


def replay_hint(trials: list[Trial], seed: int, count: int, kills: int, steps: int) -> str:
    """What failed and the command that replays each failing trial's kill plan."""
    lines = [f"seed {seed}: {sum(bool(t.problems) for t in trials)} of {len(trials)} trials differ"]
    for t in trials:
        if t.problems:
            lines += [t.line(), f"  replay: python scripts/fault_trials.py --seed {seed} --trials {count} "
                                f"--kills {kills} --steps {steps} --only {t.number}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--kills", type=int, default=2, help="most kills per trial (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    parser.add_argument("--sleep-in-save", type=float, default=0.1, help="pause between a save's steps, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="trials run at once (default 2)")
    parser.add_argument("--only", type=int, help="run only this trial of the seed's plans (a replay)")
    parser.add_argument("--out", type=Path, default=Path("runs/fault_trials"))
    parser.add_argument("--data", type=Path, help="prepared data folder (default: Tiny Shakespeare, chars, in --out)")
    args = parser.parse_args(argv)

    data = args.data
    if data is None:
        from gpt2train.data.prepare import prepare_shakespeare

        data = args.out / "data"
        if not (data / "meta.json").is_file():
            prepare_shakespeare(data, tokenizer="char")
    trials = run_trials(args.out, data, args.trials, args.kills, args.steps, args.seed, args.sleep_in_save,
                        args.jobs, args.only)
    if any(t.problems for t in trials):
        print(replay_hint(trials, args.seed, args.trials, args.kills, args.steps))
        return 1
    print(f"{len(trials)}/{len(trials)} trials resumed from the newest complete checkpoint and ended with the "
          "uninterrupted run's losses and weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
