"""Training: the Trainer (loop.py) and its components: one optimizer step (step.py), the optimizer (AdamW, or
Muon with AdamW) and the LR schedule (optim.py), checkpoint management (checkpointing.py), the console and run
log (console.py), stop signals (signals.py), the loss guard (guard.py), the run lock (runlock.py) and fine-tuning's
first weights (init_from.py)."""
