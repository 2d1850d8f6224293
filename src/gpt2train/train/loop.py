"""The training loop: one batch from shard to optimizer step, in the order that keeps runs correct.

    lr = lr_at(step)                       an explicit function of the step, so resume needs no scheduler state
    zero_grad(set_to_none)
    for each micro-batch:                  gradient accumulation
        loss = model(x, y) / n_micro       autocast (bf16 / fp16 / fp32); DDP syncs on the last one only
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)             before the clip, so the clip sees true gradients
    norm = clip_grad_norm_(1.0)            the pre-clip norm is logged
    scaler.step(optimizer); scaler.update()
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

import gpt2train
from gpt2train import distributed as D
from gpt2train.checkpoint import (
    CheckpointError,
    check_same_shape,
    load_training_checkpoint,
    newest_checkpoint,
    point_latest,
    read_meta,
    recover,
    resolve_checkpoint,
    ring_entries,
    rng_state,
    save_training_checkpoint,
    set_aside_newer,
    set_rng_state,
)
from gpt2train.config import Config, ConfigError, save_config, to_dict
from gpt2train.data.loader import TokenLoader
from gpt2train.data.prepare import load_meta
from gpt2train.model import GPT
from gpt2train.runlog import MetricsLogger
from gpt2train.train.guard import GuardError, TrainingGuard, Verdict
from gpt2train.train.metrics import flops_per_token, peak_for_run
from gpt2train.train.optim import lr_at, make_optimizer


def use_expandable_segments():
    """Ask PyTorch's CUDA allocator for expandable segments (fewer fragmentation OOMs), unless the user set
    the allocator config. The allocator reads this once, when CUDA starts: it must run before any CUDA call."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:  # the older name of the same setting
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")


def set_tf32(enabled: bool):
    """TF32 tensor cores for fp32 matmuls and convolutions (Ampere and newer): ~8x the fp32 rate for a
    10-bit mantissa in the products, which training does not notice. Matters for fp32 runs and for the
    fp32 parts of mixed-precision ones."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on GPUs that have it, fp16 (with a GradScaler) on older GPUs, fp32 elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def seed_everything(seed: int):
    """Seed Python, NumPy and torch (the CPU generator and every CUDA device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CPU and every CUDA device


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def format_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def accumulation_steps(cfg: Config, world_size: int) -> int:
    """Micro-batches per optimizer step: total_batch_tokens / (micro_batch * seq_len * world_size), exactly."""
    per_pass = cfg.train.micro_batch * cfg.train.seq_len * world_size
    if cfg.train.total_batch_tokens <= 0:
        return 1
    if cfg.train.total_batch_tokens % per_pass:
        raise ConfigError(f"train.total_batch_tokens = {cfg.train.total_batch_tokens} is not a multiple of "
                          f"micro_batch * seq_len * world_size = {per_pass}; pick a multiple of {per_pass}")
    return cfg.train.total_batch_tokens // per_pass


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path | None, resume: str | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else None
        use_expandable_segments()  # before init_distributed, whose device choice may start CUDA
        self.dist = D.init_distributed(cfg.train.device)
        self.device = self.dist.device
        self.is_main = self.dist.is_main

        # Data first: the tokenizer's vocabulary sizes the model.
        self.data_meta = load_meta(cfg.data.dir)
        data_vocab = int(self.data_meta["vocab_size"])
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = data_vocab
        elif cfg.model.vocab_size < data_vocab:
            raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the data's vocabulary "
                              f"({data_vocab}); set it to {data_vocab} or 0 (from the data)")
        if cfg.train.seq_len == 0:
            cfg.train.seq_len = cfg.model.block_size
        if cfg.train.seq_len > cfg.model.block_size:
            raise ConfigError(f"train.seq_len = {cfg.train.seq_len} exceeds model.block_size = {cfg.model.block_size}")
        self.grad_accum = accumulation_steps(cfg, self.dist.world_size)
        self.tokens_per_step = cfg.train.micro_batch * cfg.train.seq_len * self.dist.world_size * self.grad_accum

        # Numerics: TF32 matmuls, autocast dtype, and a GradScaler only for fp16 (bf16 has fp32's range).
        if self.device.type == "cuda":
            set_tf32(cfg.train.tf32)
        self.dtype = resolve_dtype(cfg.train.dtype, self.device)
        self.autocast = (torch.autocast(self.device.type, dtype=self.dtype) if self.dtype != torch.float32
                         else nullcontext())
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)

        # Model: built plain and seeded identically on every rank (DDP also broadcasts rank 0's weights),
        # then wrapped (DDP / FSDP2) and compiled from outside. raw_model stays the plain, uncompiled GPT
        # (sharded in place under FSDP): evaluation and sampling call it, so they never trigger a recompile.
        seed_everything(cfg.train.seed)
        self.raw_model = GPT(cfg.model).to(self.device)
        self.compiled = cfg.train.compile is True or (cfg.train.compile == "auto" and self.device.type == "cuda")
        model = D.wrap_model(self.raw_model, self.dist, cfg.train.distributed)
        self.model = torch.compile(model) if self.compiled else model
        self.optimizer = make_optimizer(self.raw_model, cfg.train, self.device.type)
        # From here on each rank draws its own random numbers (dropout masks differ across ranks).
        seed_everything(cfg.train.seed + self.dist.rank)

        # Data streams: the same seed on every rank, each rank taking its own slice of every draw.
        loader_args = dict(rank=self.dist.rank, world_size=self.dist.world_size, mode=cfg.data.loader, device=self.device)
        self.train_loader = TokenLoader(cfg.data.dir, "train", cfg.train.micro_batch, cfg.train.seq_len,
                                        seed=cfg.train.seed, order=cfg.data.order, **loader_args)
        self.val_loader = TokenLoader(cfg.data.dir, "val", cfg.train.micro_batch, cfg.train.seq_len,
                                      seed=cfg.train.seed + 1, order="sequential", **loader_args)

        self.step = 0  # optimizer steps done
        self.tokens = 0
        self.best_val = math.inf
        self.val_loss = None  # the latest validation loss
        self.wall_before = 0.0  # training wall seconds of earlier launches (from the checkpoint)
        self.launch_start = time.time()
        self.first_step = 1  # the first step of this launch (fit() sets it after a resume)
        self.resumed_from = None
        self.sharded = cfg.train.distributed == "fsdp" and self.dist.enabled  # DCP checkpoints
        self.guard = TrainingGuard(cfg.guard)
        if resume:
            self._resume(resume)

        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_flops = peak_for_run(self.device, self.dtype, cfg.train.tf32)
        if self.is_main and self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logger = MetricsLogger(self.run_dir if self.is_main else None, cfg.log.tensorboard, cfg.log.wandb,
                                    cfg.log.wandb_project, cfg.log.wandb_mode, to_dict(cfg))
        self.stop_signal = None

    # --- resume ------------------------------------------------------------------------------------
    def _resume(self, resume: str):
        """`auto`: the newest good checkpoint of the run directory, or a fresh start when there is none;
        otherwise a run directory (its newest good checkpoint) or a checkpoint folder."""
        if resume == "auto":
            if self.run_dir is None:
                return
            if self.is_main:
                recover(self.run_dir / "checkpoints")  # undo what a crash mid-save left behind
            D.barrier()
            ckpt = newest_checkpoint(self.run_dir, warn=self.is_main)
            if ckpt is None:
                if ring_entries(self.run_dir / "checkpoints"):  # never silently start over a damaged run
                    raise CheckpointError(f"every checkpoint in {self.run_dir / 'checkpoints'} is damaged; move them "
                                          "away to start fresh, or resume from a copy with --resume PATH")
                return
            if self.is_main:
                # Damaged newer checkpoints leave the ring, and `latest` names the one resumed from (a crash
                # between publishing a checkpoint and moving `latest` leaves it behind).
                for name in set_aside_newer(ckpt.parent, int(read_meta(ckpt)["step"])):
                    print(f"warning: moved damaged {name} aside to .damaged-{name}", file=sys.stderr)
                point_latest(ckpt.parent, ckpt.name)
            D.barrier()
        else:
            ckpt = resolve_checkpoint(resume)
        self._load_state(ckpt, restore_data=True)
        self.resumed_from = str(ckpt)

    def _load_state(self, ckpt: Path, restore_data: bool) -> dict:
        """Load a checkpoint into the live run. `restore_data` (resume): also every rank's RNG and loader state
        and the guard; a rollback leaves those moving forward so that the bad batches are not replayed."""
        check_same_shape(read_meta(ckpt)["config"]["model"], to_dict(self.cfg)["model"])
        state, meta = load_training_checkpoint(ckpt, self.raw_model, self.optimizer, sharded=self.sharded)
        self.scaler.load_state_dict(state["scaler"])
        if restore_data:
            ranks = state["ranks"]
            if len(ranks) == self.dist.world_size:
                set_rng_state(ranks[self.dist.rank]["rng"])
                self.train_loader.load_state_dict(ranks[self.dist.rank]["loader"])
            elif self.is_main:
                print(f"warning: checkpoint saved with {len(ranks)} ranks, resuming with {self.dist.world_size}; "
                      "data order and RNG restart from the seed", file=sys.stderr)
            self.guard.load_state_dict(state.get("guard", {}))
            self.best_val = float(meta.get("best_val_loss") or math.inf)
            self.val_loss = meta.get("val_loss")
            self.wall_before = float(meta.get("train_wall_s") or 0.0)
        self.step, self.tokens = int(meta["step"]), int(meta["tokens"])
        return meta

    # --- one optimizer step ------------------------------------------------------------------------
    def train_step(self) -> dict:
        step = self.step + 1
        lr = lr_at(step, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.grad_accum):
            x, y = self.train_loader.next_batch()
            with D.gradient_sync(self.model, sync=micro == self.grad_accum - 1), self.autocast:
                _, loss = self.model(x, y)
                loss = loss / self.grad_accum  # the sum over micro-batches is the mean over the full batch
            loss_sum += loss.detach()
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip)
        loss_value, norm_value = loss_sum.item(), float(grad_norm)
        skipped = self.cfg.guard.enabled and not (math.isfinite(loss_value) and math.isfinite(norm_value))
        if skipped and not self.scaler.is_enabled():
            pass  # a non-finite update would poison the weights: leave them as they are
        else:
            self.scaler.step(self.optimizer)  # with fp16, the scaler itself skips non-finite steps
        self.scaler.update()
        self.step = step
        self.tokens += self.tokens_per_step
        return {"loss": loss_value, "lr": lr, "grad_norm": norm_value, "skipped": skipped}

    # --- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first val_batches windows of the val split (all of it when 0), the same
        windows every time. Runs the uncompiled model so that evaluation never triggers a recompile."""
        self.raw_model.eval()
        self.val_loader.reset()
        n = self.cfg.eval.val_batches or max(1, int(self.val_loader.cum_starts[-1]) // (self.val_loader.B * self.dist.world_size))
        total = torch.zeros((), device=self.device)
        for _ in range(n):
            x, y = self.val_loader.next_batch()
            with self.autocast:
                _, loss = self.raw_model(x, y)
            total += loss.float()
        self.raw_model.train()
        return float(D.all_reduce_mean(total / n))

    # --- checkpoints -------------------------------------------------------------------------------
    def save(self, ring: bool = True, best: bool = False):
        """Save a checkpoint: into the ring (`ring`), and/or as best/ (`best`). Every rank contributes its RNG and
        loader state; rank 0 writes (every rank writes its own shards under FSDP)."""
        if self.run_dir is None:
            return None
        if ring:
            self.guard.after_checkpoint()
        ranks = D.all_gather_objects({"rng": rng_state(), "loader": self.train_loader.state_dict()})
        state = {"scaler": self.scaler.state_dict(), "ranks": ranks, "guard": self.guard.state_dict()}
        meta = {"tokens": self.tokens, "val_loss": self.val_loss,
                "best_val_loss": None if math.isinf(self.best_val) else self.best_val,
                "train_wall_s": self.wall_before + (time.time() - self.launch_start),
                "config": to_dict(self.cfg), "tokenizer": self.data_meta["tokenizer"],
                "world_size": self.dist.world_size, "params": self.raw_model.num_params(), "torch": torch.__version__}
        path = save_training_checkpoint(self.run_dir, self.step, self.raw_model, self.optimizer, state, meta,
                                        is_main=self.is_main, sharded=self.sharded,
                                        keep_last=self.cfg.checkpoint.keep_last, ring=ring, best=best)
        self.logger.log("checkpoint", step=self.step, path=str(path), best=best)
        return path

    def _rollback(self, verdict: Verdict, out: dict, loss: float, progress) -> None:
        """Reload the newest good checkpoint (weights, optimizer, scaler; not the data) after a guard verdict."""
        step = self.step
        ckpt = newest_checkpoint(self.run_dir, warn=self.is_main) if self.run_dir is not None else None
        if ckpt is None:
            raise GuardError(f"guard: {verdict.reason} at step {step} and no checkpoint to roll back to; "
                             "lower train.lr, check the data, or save earlier (checkpoint.every_steps)")
        to_step = int(ckpt.name.split("_")[-1])
        self.guard.before_rollback(to_step, step)
        self._load_state(ckpt, restore_data=False)
        self.logger.log("guard", step=step, action="rollback", reason=verdict.reason, loss=_finite_or_none(loss),
                        grad_norm=_finite_or_none(out["grad_norm"]), to_step=self.step)
        self._print(f"guard: {verdict.reason} at step {step}; rolled back to step {self.step}", progress)
        if progress is not None:
            progress.n = self.step
            progress.refresh()

    def _agree(self, loss: float, stop: bool, save_due_by_time: bool) -> tuple[float, bool, bool]:
        """What every rank must decide alike: the rank-averaged loss (for the guard), whether any rank got a
        stop signal, and whether the wall-clock save is due (clocks differ between hosts). One all-reduce."""
        if not self.dist.enabled:
            return loss, stop, save_due_by_time
        t = torch.tensor([loss, float(stop), float(save_due_by_time)], device=self.device, dtype=torch.float64)
        mean = D.all_reduce_mean(t).tolist()
        return mean[0], mean[1] > 0, mean[2] > 0

    # --- the run -----------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict:
        """SIGTERM/SIGINT finish the current step, save and exit; a second one stops at once (the previous
        checkpoint stays valid). Returns the handlers to put back when the run ends."""
        def handler(signum, frame):
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = signum

        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        return previous

    def _restore_signal_handlers(self):
        for sig, handler in getattr(self, "_previous_handlers", {}).items():
            signal.signal(sig, handler)
        self._previous_handlers = {}

    def log_failure(self, error: BaseException):
        """A `run_end` record for a launch that ended in an exception (the checkpoints before it stand)."""
        self._restore_signal_handlers()
        if self.logger.active and not self.logger.file.closed:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            reason = "signal" if isinstance(error, KeyboardInterrupt) else "error"  # a second Ctrl-C / SIGTERM
            self.logger.log("run_end", step=self.step, tokens=self.tokens, reason=reason, error=message,
                            wall_s=time.time() - self.launch_start)
            self.logger.close()

    def _log_start(self):
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
        hardware = {"device": str(self.device), "device_name": name, "torch": torch.__version__,
                    "world_size": self.dist.world_size, "cuda": torch.version.cuda}
        self.logger.log("run_start", step=self.step + 1, config=to_dict(self.cfg), hardware=hardware,
                        git=git_revision(), version=gpt2train.__version__, params=self.raw_model.num_params(),
                        params_non_embedding=self.raw_model.num_params(non_embedding=True),
                        flops_per_token=self.flops_per_token, peak_flops=self.peak_flops, resumed_from=self.resumed_from)
        if self.is_main:
            print(f"device: {name} ({self.device}), world size {self.dist.world_size}, dtype {str(self.dtype).split('.')[-1]}, "
                  f"compile {'on' if self.compiled else 'off'}")
            print(f"model: {self.raw_model.num_params() / 1e6:.2f}M parameters "
                  f"({self.raw_model.num_params(non_embedding=True) / 1e6:.2f}M without embeddings)")
            print(f"batch: {self.tokens_per_step:,} tokens/step = {self.cfg.train.micro_batch} x {self.cfg.train.seq_len} "
                  f"x {self.dist.world_size} ranks x {self.grad_accum} micro-steps")
            if self.peak_flops:
                print(f"mfu: against {self.peak_flops / 1e12:.0f} TFLOP/s per device, "
                      f"{self.flops_per_token / 1e6:.1f} MFLOP per token")
            else:
                print(f"mfu: unknown for {name} (no peak FLOP/s in gpt2train.train.metrics.PEAK_FLOPS); "
                      "reporting tokens/s only")
            if self.resumed_from:
                print(f"resumed from {self.resumed_from} at step {self.step}")

    def fit(self) -> dict:
        cfg = self.cfg
        if self.is_main and self.run_dir is not None:
            save_config(cfg, self.run_dir / "config.toml")
        self._previous_handlers = self._install_signal_handlers()
        self._log_start()
        self.launch_start = time.time()
        self.first_step = self.step + 1
        last_save = time.time()
        progress = self._progress_bar()
        reason = "done"
        val_loss = None
        while self.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            out = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            step = self.step
            loss, stop, minutes_due = self._agree(out["loss"], self.stop_signal is not None, bool(
                cfg.checkpoint.every_minutes and time.time() - last_save >= 60 * cfg.checkpoint.every_minutes))
            verdict = self.guard.observe(loss, out["grad_norm"], norm_may_overflow=self.scaler.is_enabled())
            if verdict is not None and verdict.action == "rollback":
                self._rollback(verdict, out, loss, progress)
                if stop:  # the state is a saved checkpoint's already
                    reason = "signal"
                    break
                continue
            if out["skipped"]:
                self.logger.log("guard", step=step, action="skip", reason="non-finite loss or grad norm",
                                loss=_finite_or_none(out["loss"]), grad_norm=_finite_or_none(out["grad_norm"]))
            first_compiled = self.compiled and step == self.first_step
            if step % cfg.log.interval == 0 or step == self.first_step or step == cfg.train.max_steps:
                self._log_train(out, dt, first_compiled, progress)
            if progress is not None:
                progress.update(1)

            last = step == cfg.train.max_steps
            is_best = False
            if (cfg.eval.interval and step % cfg.eval.interval == 0) or last:
                val_loss = self.val_loss = self.evaluate()
                is_best = val_loss < self.best_val
                self.best_val = min(self.best_val, val_loss)
                self.logger.log("val", step=step, tokens=self.tokens, val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
                self._print(f"step {step}: val loss {val_loss:.4f}" + (" (best)" if is_best else ""), progress)
            if cfg.eval.hellaswag_interval or cfg.eval.sample_interval:  # HellaSwag and text samples when due
                from gpt2train.eval.periodic import run_periodic_evals
                run_periodic_evals(self, step, progress)
            # A regular save goes into the ring; a new best alone is written to best/ only.
            due = bool(cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or minutes_due
            regular = due or (last and cfg.checkpoint.save_final) or stop
            best = is_best and cfg.checkpoint.save_best
            if regular or best:
                self.save(ring=regular, best=best)
                if regular:
                    last_save = time.time()
            if stop:
                reason = "signal"
                self._print(f"stop signal received: saved step {step}, exiting", progress)
                break
        if progress is not None:
            progress.close()
        self._restore_signal_handlers()
        self.logger.log("run_end", step=self.step, tokens=self.tokens, wall_s=time.time() - self.launch_start, reason=reason)
        self.logger.close()
        return {"step": self.step, "tokens": self.tokens, "val_loss": val_loss, "best_val_loss": self.best_val,
                "reason": reason}

    def _log_train(self, out: dict, dt: float, first_compiled: bool, progress):
        loss = float(D.all_reduce_mean(torch.tensor(out["loss"], device=self.device)))
        tok_s = self.tokens_per_step / dt
        mfu = tok_s * self.flops_per_token / (self.peak_flops * self.dist.world_size) if self.peak_flops else None
        peak_mem = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
        record = dict(step=self.step, tokens=self.tokens, loss=loss, lr=out["lr"], grad_norm=out["grad_norm"],
                      step_ms=dt * 1000, tokens_per_s=tok_s, mfu=mfu, peak_mem_mb=peak_mem)
        if first_compiled:
            record["compile_ms"] = dt * 1000  # the first compiled step includes compilation
        self.logger.log("train", **record)
        mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        line = (f"step {self.step:>6}/{self.cfg.train.max_steps} | loss {loss:.4f} | lr {out['lr']:.2e} | "
                f"norm {out['grad_norm']:.2f} | {tok_s:,.0f} tok/s | mfu {mfu_text} | {dt * 1000:.0f} ms | "
                f"eta {format_eta(self.eta_seconds())}")
        if first_compiled:
            line += " (includes compilation)"
        if progress is not None:
            progress.set_postfix_str(f"loss {loss:.3f} | {tok_s:,.0f} tok/s | mfu {mfu_text}", refresh=False)
            if self.cfg.log.progress == "bar":
                return
        self._print(line, progress)

    def eta_seconds(self) -> float:
        """Seconds to max_steps at this launch's pace so far (evaluations and saves included)."""
        done = self.step - self.first_step + 1
        return (time.time() - self.launch_start) / max(done, 1) * (self.cfg.train.max_steps - self.step)

    def _progress_bar(self):
        mode = self.cfg.log.progress
        if not self.is_main or mode == "lines" or (mode == "auto" and not sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.train.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)

    def _print(self, text: str, progress=None):
        if not self.is_main:
            return
        if progress is not None:
            progress.write(text)
        else:
            print(text, flush=True)


def _finite_or_none(x: float):
    return x if math.isfinite(x) else None


def train(cfg: Config, run_dir: str | Path | None, resume: str | None = None) -> dict:
    """Build a Trainer, run it to max_steps (or a signal), and shut the process group down."""
    use_expandable_segments()  # nothing on the CLI path has touched CUDA yet
    clean, trainer = False, None
    try:
        trainer = Trainer(cfg, run_dir, resume)
        out = trainer.fit()
        clean = True
        return out
    except BaseException as e:
        if trainer is not None:
            trainer.log_failure(e)  # a run_end record with reason "error"
        raise
    finally:
        D.shutdown_distributed(clean)  # even after an error, so that every rank's process can exit
