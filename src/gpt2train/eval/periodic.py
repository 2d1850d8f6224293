"""Evaluations during training: HellaSwag every eval.hellaswag_interval steps and a few text samples every
eval.sample_interval steps, logged as `hellaswag` and `sample` records (docs/metrics.md).

Both run the uncompiled model (trainer.raw_model) under no_grad, so they never trigger a recompile, and
both run on every rank: under FSDP each forward gathers weights from all ranks. Sampling uses its own
seeded generator, so the training RNG stream is untouched.
"""

from __future__ import annotations

import sys

from gpt2train.tokenizer import tokenizer_from_spec

SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 200


class PeriodicEvals:
    def __init__(self, trainer):
        self.trainer = trainer
        self.tokenizer = tokenizer_from_spec(trainer.data_meta["tokenizer"])
        self.examples = None  # HellaSwag examples, read at the first run
        self.hellaswag_disabled = False  # set, with one warning, when HellaSwag cannot run for this model

    def after_step(self, step: int, progress=None):
        cfg = self.trainer.cfg.eval
        if cfg.hellaswag_interval and step % cfg.hellaswag_interval == 0 and not self.hellaswag_disabled:
            self.hellaswag(step, progress)
        if cfg.sample_interval and step % cfg.sample_interval == 0:
            self.samples(step, progress)

    def hellaswag(self, step: int, progress=None):
        from gpt2train.eval.hellaswag import evaluate_hellaswag, load_examples

        t = self.trainer
        if self.examples is None:
            kind = t.data_meta["tokenizer"].get("kind")
            if kind != "gpt2":
                return self._disable(f"HellaSwag needs the GPT-2 tokenizer and this run uses {kind!r}")
            try:
                self.examples = load_examples(t.cfg.eval.hellaswag_path or None, t.cfg.eval.hellaswag_limit)
            except (OSError, ValueError) as e:
                return self._disable(str(e).splitlines()[0])
        model = t.raw_model
        model.eval()
        try:
            out = evaluate_hellaswag(model, self.tokenizer, self.examples, max(1, t.cfg.train.micro_batch // 4), t.autocast)
        finally:
            model.train()
        t.logger.log("hellaswag", step=step, acc=out["acc"], acc_norm=out["acc_norm"], n=out["n"])
        t._print(f"step {step}: hellaswag acc_norm {out['acc_norm']:.4f} acc {out['acc']:.4f} ({out['n']} examples)", progress)

    def samples(self, step: int, progress=None):
        from gpt2train.generate import generate

        t, tok = self.trainer, self.tokenizer
        model = t.raw_model
        model.eval()
        try:
            for prompt in t.cfg.eval.sample_prompts:
                try:
                    prompt_ids = tok.encode(prompt)
                except ValueError as e:  # a character the char tokenizer never saw: skip, do not stop training
                    if t.is_main:
                        print(f"warning: sample prompt {prompt!r} skipped: {e}", file=sys.stderr, flush=True)
                    continue
                ids = generate(model, prompt_ids, t.cfg.eval.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                               top_k=SAMPLE_TOP_K, eot_id=tok.eot_id, seed=t.cfg.train.seed)
                text = tok.decode([i for i in ids if i != tok.eot_id])
                t.logger.log("sample", step=step, prompt=prompt, text=text)
                t._print(f"step {step}: sample {prompt + text!r}"[:160], progress)
        finally:
            model.train()

    def _disable(self, reason: str):
        self.hellaswag_disabled = True
        if self.trainer.is_main:
            print(f"warning: skipping HellaSwag during training: {reason}", file=sys.stderr, flush=True)


def run_periodic_evals(trainer, step: int, progress=None):
    """The training loop's hook: run whatever is due at `step` (state kept on the trainer between calls)."""
    evals = trainer.__dict__.get("_periodic_evals")
    if evals is None:
        evals = trainer._periodic_evals = PeriodicEvals(trainer)
    evals.after_step(step, progress)
