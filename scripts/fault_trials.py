"""Kill a training run with SIGKILL at random moments (inside checkpoint writes too), resume it with
`--resume auto`, and check that every trial ends with weights equal to those of an uninterrupted run.

    python scripts/fault_trials.py --trials 20                 # tiny CPU model on Tiny Shakespeare (chars)
    python scripts/fault_trials.py --trials 50 --kills 3 --out /tmp/faults --seed 7

Each trial kills the run up to --kills times, each time at a moment drawn at random: a delay after launch
(anywhere, from start-up to the end), the instant a checkpoint's hidden staging folder appears (inside a
write), or the instant a new checkpoint folder appears (before `latest` has moved). The environment variable
GPT2TRAIN_FAULT_SLEEP_IN_SAVE makes each save pause between its steps so that those windows can be hit.
Exit status 1 when any trial ends with other weights.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from gpt2train.checkpoint import FAULT_SLEEP_ENV, checkpoint_name  # noqa: E402
from gpt2train.config import Config, dump_toml  # noqa: E402
from gpt2train.model import GPTConfig  # noqa: E402


def tiny_config(data_dir: Path, max_steps: int = 12) -> Config:
    """A 2-layer model that takes a few tens of milliseconds a step, saving every 2 steps."""
    cfg = Config()
    cfg.model = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=0)
    cfg.data.dir = str(data_dir)
    cfg.train.device, cfg.train.dtype, cfg.train.compile = "cpu", "float32", False
    cfg.train.micro_batch, cfg.train.seq_len = 4, 32
    cfg.train.max_steps, cfg.train.warmup_steps, cfg.train.lr = max_steps, 2, 1e-3
    cfg.eval.interval, cfg.eval.val_batches = 4, 2
    cfg.log.interval, cfg.log.progress = 1, "lines"
    cfg.checkpoint.every_steps, cfg.checkpoint.keep_last = 2, 2
    return cfg


def launch(config: Path, out: Path, resume: bool, sleep_in_save: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", FAULT_SLEEP_ENV: str(sleep_in_save)}
    cmd = [sys.executable, "-m", "gpt2train", "train", "--config", str(config), "--out", str(out)]
    if resume:
        cmd += ["--resume", "auto"]
    with open(log_file(out), "a") as log:  # a file, not a pipe: a pipe nobody reads can block the child
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def log_file(out: Path) -> Path:
    return out.parent / f"{out.name}.log"


def run_to_end(config: Path, out: Path, resume: bool, sleep_in_save: float = 0.0) -> float:
    start = time.time()
    proc = launch(config, out, resume, sleep_in_save)
    if proc.wait(timeout=600) != 0:
        tail = log_file(out).read_text()[-2000:]
        raise RuntimeError(f"training in {out} failed with exit status {proc.returncode}:\n{tail}")
    return time.time() - start


def final_weights(out: Path, max_steps: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / checkpoint_name(max_steps) / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def inside_a_save(out: Path, since: float) -> bool:
    """Whether this launch (started at `since`) left a save's hidden staging folder or file behind."""
    root = out / "checkpoints"
    return root.is_dir() and any(p.name.startswith((".tmp-", ".old-", ".latest")) and p.stat().st_mtime >= since
                                 for p in root.iterdir())


KILL_KINDS = ("delay", "staging", "published")


def kill_moment(rng: random.Random, reference_s: float, kind: str | None = None):
    """A (description, condition) pair: the run is killed as soon as condition(out, started) holds."""
    kind = kind or rng.choice(["delay", "delay", "staging", "published"])
    if kind == "delay":
        delay = rng.uniform(0.0, reference_s)
        return f"after {delay:.2f} s", lambda out, started: time.time() - started >= delay
    if kind == "staging":
        return "when a staging folder appears", lambda out, started: any((out / "checkpoints").glob(".tmp-step_*"))
    return "when a checkpoint folder appears before `latest` names it", unpointed_checkpoint


def unpointed_checkpoint(out: Path, started: float) -> bool:
    """A step folder newer than the one `latest` names: the save has published it and not yet moved `latest`."""
    root = out / "checkpoints"
    try:
        latest = (root / "latest").read_text().strip()
    except OSError:
        latest = ""
    return any(p.name > latest for p in root.glob("step_*"))  # zero-padded names sort by step


def kill_when(proc: subprocess.Popen, out: Path, condition, timeout: float = 600) -> bool:
    """SIGKILL `proc` once condition holds; False when it finished first."""
    started = time.time()
    while proc.poll() is None:
        if condition(out, started):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        if time.time() - started > timeout:
            proc.kill()
            raise TimeoutError(f"training in {out} ran past {timeout} s")
        time.sleep(0.005)
    return False


def run_trial(config: Path, out: Path, reference: dict, max_steps: int, rng: random.Random, reference_s: float,
              kills: int = 1, sleep_in_save: float = 0.2, kinds: tuple[str, ...] = ()) -> tuple[bool, list[str]]:
    """Kill the run up to `kills` times (at moments of `kinds`, in order, else drawn at random), then resume
    until it finishes; returns (weights equal to the reference, what happened)."""
    shutil.rmtree(out, ignore_errors=True)
    log_file(out).unlink(missing_ok=True)
    notes = []
    for i in range(kills):
        what, condition = kill_moment(rng, reference_s, kinds[i] if i < len(kinds) else None)
        launched = time.time()
        proc = launch(config, out, resume=i > 0, sleep_in_save=sleep_in_save)
        if kill_when(proc, out, condition):
            notes.append(f"killed {what}" + (" (inside a save)" if inside_a_save(out, launched) else ""))
        else:
            if proc.returncode != 0:
                raise RuntimeError(f"training in {out} failed: {log_file(out).read_text()[-2000:]}")
            notes.append(f"finished before the kill ({what})")
            break
    run_to_end(config, out, resume=True)
    return same_weights(final_weights(out, max_steps), reference), notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kills", type=int, default=2, help="most kills per trial (default 2)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (default 12)")
    parser.add_argument("--sleep-in-save", type=float, default=0.2, help="pause between a save's steps, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/fault_trials"))
    parser.add_argument("--data", type=Path, help="prepared data folder (default: Tiny Shakespeare, chars, in --out)")
    args = parser.parse_args(argv)

    data = args.data
    if data is None:
        from gpt2train.data.prepare import prepare_shakespeare

        data = args.out / "data"
        if not (data / "meta.json").is_file():
            prepare_shakespeare(data, tokenizer="char")
    args.out.mkdir(parents=True, exist_ok=True)
    config = args.out / "config.toml"
    config.write_text(dump_toml(tiny_config(data, args.steps)))

    shutil.rmtree(args.out / "reference", ignore_errors=True)
    log_file(args.out / "reference").unlink(missing_ok=True)
    reference_s = run_to_end(config, args.out / "reference", resume=False, sleep_in_save=args.sleep_in_save)
    reference = final_weights(args.out / "reference", args.steps)
    print(f"reference run: {args.steps} steps in {reference_s:.1f} s")

    rng, failures = random.Random(args.seed), 0
    for trial in range(1, args.trials + 1):
        kills = rng.randint(1, args.kills)
        equal, notes = run_trial(config, args.out / "trial", reference, args.steps, rng, reference_s, kills,
                                 args.sleep_in_save)
        failures += not equal
        print(f"trial {trial:>3}: {'equal' if equal else 'DIFFERENT'} | " + "; ".join(notes), flush=True)
    print(f"{args.trials - failures}/{args.trials} trials ended with the reference weights")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
