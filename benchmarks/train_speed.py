"""Tokens/s of `gpt2train train` on this machine for a config and a few variants of it, one after the other.

Each variant is a real training run (the CLI in a subprocess, so the checkout under test can be another
worktree: --src) of --steps steps with validation, the suite and checkpoints off, on the config's device (`auto`: a GPU
where there is one); the figure is the median tokens/s of the logged steps after the first --skip
(compilation and warm-up); beside it the median MFU and the peak GPU memory where the run logged them, and
the process's peak RSS. Machines differ: compare only figures from one invocation of this script.

    python benchmarks/train_speed.py --config configs/shakespeare-cpu.toml --data data/shakespeare \\
        --variant shipped= --variant bf16+compile="train.dtype=bfloat16 train.compile=true"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_variant(src: Path, config: str, data: str, steps: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="train-speed-") as tmp:
        sets = [f"train.max_steps={steps}", "log.interval=1", "eval.interval=0", "checkpoint.every_steps=0",
                "checkpoint.save_final=false", "checkpoint.save_best=false", "eval.sample_interval=0",
                "log.progress=lines", f"data.dir={data}", *overrides]
        # The suite during training (eval.tasks, on in the GPT-2 presets) is no part of a step's speed; a checkout
        # from before the key would refuse it, so only one that has it is told.
        if "tasks_limit" in (src / "src" / "gpt2train" / "config.py").read_text():
            sets.append("eval.tasks=[]")
        cmd = [sys.executable, "-m", "gpt2train", "train", "--config", config, "--out", f"{tmp}/run"]
        for s in sets:
            cmd += ["--set", s]
        # this checkout first; what else is on the path stays (packages installed with --target, say)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src / "src"), os.environ.get("PYTHONPATH")]))}
        start = time.time()
        with open(f"{tmp}/stderr", "w+") as err:
            proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)  # this run's own peak RSS, not any earlier child's
            proc.returncode = os.waitstatus_to_exitcode(status)
            err.seek(0)
            stderr = err.read().strip()
        if proc.returncode != 0:
            return {"error": stderr.splitlines()[-1] if stderr else f"exit {proc.returncode}"}
        records = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        train = [x for x in records if x["kind"] == "train"]
        return {"train": train, "wall_s": time.time() - start, "peak_rss_mib": usage.ru_maxrss / 1024,
                "val_loss": next((x["val_loss"] for x in records if x["kind"] == "val"), None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", required=True, help="prepared data folder (absolute, or relative to --src)")
    ap.add_argument("--src", action="append", default=[], help="checkout(s) to measure (default: this one)")
    ap.add_argument("--variant", action="append", default=[], help='NAME=\"key=value key=value\" (empty: as shipped)')
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=10, help="logged steps left out of the median (warm-up, compile)")
    ap.add_argument("--repeat", type=int, default=1, help="measure each variant this many times, interleaved")
    args = ap.parse_args()
    srcs = [Path(s).resolve() for s in args.src] or [REPO]
    variants = [v.partition("=")[::2] for v in args.variant] or [("shipped", "")]
    rows = []
    for _ in range(args.repeat):
        for src in srcs:
            for name, sets in variants:
                out = run_variant(src, args.config, args.data, args.steps, sets.split())
                label = f"{src.name}:{name}"
                if "error" in out:
                    print(f"{label:40s} error: {out['error']}", flush=True)
                    continue
                speeds = [x["tokens_per_s"] for x in out["train"][args.skip:]]
                median = statistics.median(speeds)
                losses = [x["loss"] for x in out["train"]]
                rows.append((label, median))
                mfus = [x["mfu"] for x in out["train"][args.skip:] if x.get("mfu") is not None]
                device_mem = max((x.get("peak_mem_mb") or 0 for x in out["train"]), default=0)
                extra = f"  MFU {statistics.median(mfus):.1%}" if mfus else ""
                extra += f"  peak GPU memory {device_mem:,.0f} MiB" if device_mem else ""
                print(f"{label:40s} {median:9,.0f} tokens/s (median of {len(speeds)} steps){extra}  loss@{len(losses)} "
                      f"{losses[-1]:.4f}  peak RSS {out['peak_rss_mib']:,.0f} MiB  wall {out['wall_s']:.0f} s", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
