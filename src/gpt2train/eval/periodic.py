"""Evaluations during training: validation loss every eval.interval steps (and at the end), HellaSwag every
eval.hellaswag_interval steps, the multiple-choice suite (eval.tasks) every eval.tasks_interval steps (and at
the end), a few text samples every eval.sample_interval steps, logged as `val`, `hellaswag`, `suite` and
`sample` records (docs/metrics.md).

All run the plain, uncompiled model under no_grad, so they never trigger a recompile, and all run on every
rank: under FSDP each forward gathers weights from all ranks. Sampling uses its own seeded generator, so
the training RNG stream is untouched. The trainer hands this component what it needs; it knows nothing of
the trainer.
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import torch

from gpt2train.config import Config
from gpt2train.data.loader import TokenLoader
from gpt2train.data.mixture import MixtureLoader
from gpt2train.eval.val import mixture_validation, validation_loss
from gpt2train.ranges import UsageError
from gpt2train.runlog import SUITE, SUITE_TASK_FIELDS
from gpt2train.tokenizer import tokenizer_from_spec

SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 200


class PeriodicEvals:
    def __init__(self, cfg: Config, model: torch.nn.Module, val_loader: TokenLoader | MixtureLoader, tokenizer_spec: dict,
                 autocast: Callable, log: Callable, say: Callable[[str], None], is_main: bool):
        self.cfg, self.model, self.val_loader = cfg, model, val_loader
        self.tokenizer_spec = tokenizer_spec
        self.tokenizer = tokenizer_from_spec(tokenizer_spec)
        self.token_bytes = self.tokenizer.token_bytes()  # for bits per byte
        self.autocast = autocast  # () -> the run's autocast context
        self.log, self.say, self.is_main = log, say, is_main  # log(kind, **fields); say(line) prints on rank 0
        self.examples = self.hellaswag_source = None  # HellaSwag examples and where they come from, read at the first run
        self.hellaswag_disabled = False  # set, with one warning, when HellaSwag cannot run for this model
        self.suite = None  # the suite's prepared tasks, read at its first run
        self.suite_disabled = not cfg.eval.tasks  # set, with one warning, when the suite cannot run for this model
        if cfg.eval.tasks:
            from gpt2train.eval.suite import check_tokenizer

            try:  # said at the launch, not at the first suite step thousands of steps later
                check_tokenizer(tokenizer_spec)
            except UsageError as e:
                self._disable_suite(str(e).splitlines()[0])
        self.val_notes = small_val_notes(val_loader, cfg.eval.val_batches)  # said at the first validation

    def after_step(self, step: int, tokens: int, last: bool, best_val: float) -> float | None:
        """Run whatever is due at `step`; returns the validation loss when validation ran."""
        cfg = self.cfg.eval
        val_loss = None
        if (cfg.interval and step % cfg.interval == 0) or last:
            val_loss, bpb, sources = self.validate()
            per_source = {} if sources is None else {"sources": {  # a mixture's sources, each under its folder
                name: {"val_loss": out["loss"], "val_bpb": out["bpb"]} for name, out in sources.items()}}
            self.log("val", step=step, tokens=tokens, val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)),
                     val_bpb=bpb, **per_source)
            bits = f", {bpb:.4f} bits/byte" if bpb is not None else ""
            each = "".join(f"; {name} {out['loss']:.4f}" + (f" ({out['bpb']:.4f} bits/byte)" if out["bpb"] is not None
                                                            else "") for name, out in (sources or {}).items())
            self.say(f"step {step}: val loss {val_loss:.4f}{bits}" + (" (best)" if val_loss < best_val else "") + each)
        if cfg.hellaswag_interval and step % cfg.hellaswag_interval == 0 and not self.hellaswag_disabled:
            self.hellaswag(step)
        if self.suite_due(step, last):
            self.run_suite(step, tokens)
        if cfg.sample_interval and step % cfg.sample_interval == 0:
            self.samples(step)
        return val_loss

    def validate(self) -> tuple[float, float | None, dict | None]:
        """Mean loss and bits per byte over the first val_batches batches of the val split (all of it
        when 0), the same windows every time; a mixture's per source (val_batches of each) and overall, with
        {folder: validation_loss's dict} third (None for one data.dir)."""
        if self.is_main:
            for note in self.val_notes:
                print(f"note: {note}", file=sys.stderr, flush=True)
        self.val_notes = []
        self.model.eval()
        try:
            evaluate = mixture_validation if isinstance(self.val_loader, MixtureLoader) else validation_loss
            out = evaluate(self.model, self.val_loader, self.cfg.eval.val_batches, self.autocast(),
                           token_bytes=self.token_bytes)
        finally:
            self.model.train()
        return out["loss"], out["bpb"], out.get("sources")

    def hellaswag(self, step: int):
        from gpt2train.eval.hellaswag import describe_source, evaluate_hellaswag, load_examples, source_file

        if self.examples is None:
            kind = self.tokenizer_spec.get("kind")
            if kind != "gpt2":
                return self._disable(f"HellaSwag needs the GPT-2 tokenizer and this run uses {kind!r}")
            try:
                path = source_file(self.cfg.eval.hellaswag_path or None)
                self.examples = load_examples(path, self.cfg.eval.hellaswag_limit)
            except (OSError, ValueError) as e:
                return self._disable(str(e).splitlines()[0])
            self.hellaswag_source = describe_source(path)
            self.say(f"hellaswag: {len(self.examples)} examples of {self.hellaswag_source}")
        self.model.eval()
        try:
            out = evaluate_hellaswag(self.model, self.tokenizer, self.examples, max(1, self.cfg.train.micro_batch // 4),
                                     self.autocast())
        finally:
            self.model.train()
        self.log("hellaswag", step=step, acc=out["acc"], acc_norm=out["acc_norm"], n=out["n"], source=self.hellaswag_source)
        self.say(f"step {step}: hellaswag acc_norm {out['acc_norm']:.4f} acc {out['acc']:.4f} ({out['n']} examples)")

    def suite_due(self, step: int, last: bool) -> bool:
        """Every eval.tasks_interval steps (0: every eval.interval steps, with validation) and at the last step."""
        if self.suite_disabled:
            return False
        every = self.cfg.eval.tasks_interval or self.cfg.eval.interval
        return last or bool(every and step % every == 0)

    def run_suite(self, step: int, tokens: int):
        from gpt2train.eval.suite import evaluate_suite, load_suite, resolve_tasks

        if self.suite is None:
            try:  # the suite's own seed picks the examples: every run, whatever its train.seed, sees the same ones
                self.suite = load_suite(resolve_tasks(self.cfg.eval.tasks), self.cfg.eval.tasks_limit)
            except (OSError, ValueError) as e:
                return self._disable_suite(str(e).splitlines()[0])
            limit = f", at most {self.cfg.eval.tasks_limit:,} examples each" if self.cfg.eval.tasks_limit else ""
            self.say(f"suite: {len(self.suite)} task{'s' if len(self.suite) != 1 else ''}{limit}")
        self.model.eval()
        try:
            with torch.no_grad():
                out = evaluate_suite(self.model, self.tokenizer, self.suite, self.cfg.train.micro_batch, self.autocast())
        finally:
            self.model.train()
        tasks = {name: {key: each[key] for key in SUITE_TASK_FIELDS} for name, each in out["tasks"].items()}
        self.log(SUITE, step=step, tokens=tokens, centered_mean=out["centered_mean"], tasks=tasks)
        examples = sum(each["n"] for each in tasks.values())
        self.say(f"step {step}: suite centered mean {out['centered_mean']:.4f} ({len(tasks)} tasks, {examples:,} examples)")

    def samples(self, step: int):
        from gpt2train.generation import generate

        tok = self.tokenizer
        self.model.eval()
        try:
            for prompt in self.cfg.eval.sample_prompts:
                try:
                    prompt_ids = tok.encode(prompt)
                except ValueError as e:  # a character the char tokenizer never saw: skip, do not stop training
                    if self.is_main:
                        print(f"warning: sample prompt {prompt!r} skipped: {e}", file=sys.stderr, flush=True)
                    continue
                ids = generate(self.model, prompt_ids, self.cfg.eval.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                               top_k=SAMPLE_TOP_K, eot_id=tok.eot_id, seed=self.cfg.train.seed)
                text = tok.decode([i for i in ids if i != tok.eot_id])
                self.log("sample", step=step, prompt=prompt, text=text)
                self.say(f"step {step}: sample {prompt + text!r}"[:160])
        finally:
            self.model.train()

    def _disable(self, reason: str):
        self.hellaswag_disabled = True
        if self.is_main:
            print(f"warning: skipping HellaSwag during training: {reason}", file=sys.stderr, flush=True)

    def _disable_suite(self, reason: str):
        self.suite_disabled = True
        if self.is_main:
            print(f"warning: skipping the suite (eval.tasks) during training: {reason}", file=sys.stderr, flush=True)


def small_val_notes(val_loader: TokenLoader | MixtureLoader, val_batches: int) -> list[str]:
    """One line per val split that holds less than validation asks for (eval.val_batches batches of the
    training batch's shape, or one batch when 0): validation reads what it holds, each window once."""
    notes = []
    for loader in val_loader.loaders if isinstance(val_loader, MixtureLoader) else [val_loader]:
        (rows, seq_len), per_pass = loader.requested, loader.batches_per_pass()
        if (loader.B, loader.T) == (rows, seq_len) and val_batches <= per_pass:
            continue
        asked = f"eval.val_batches = {val_batches} batches" if val_batches else "one batch"
        ranks = f" on each of {loader.world_size} ranks" if loader.world_size > 1 else ""
        shorter = (f" (shorter rows than train.seq_len = {seq_len}: less context, a higher loss)"
                   if loader.T < seq_len else "")
        n = min(val_batches, per_pass) if val_batches else per_pass
        notes.append(f"the val split of {loader.paths[0].parent} holds {sum(len(s) for s in loader.shards):,} tokens, "
                     f"less than {asked} of {rows} x {seq_len}{ranks}; validation reads what it holds, no window "
                     f"twice: {n} batch{'es' if n != 1 else ''} of {loader.B} x {loader.T}{shorter}")
    return notes
