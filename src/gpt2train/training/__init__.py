"""Training: the Trainer (loop.py) and its components: one optimizer step (step.py), the optimizer (AdamW, or
Muon with AdamW) and the LR schedule (optim.py), checkpoint management (checkpointing.py), the console and run
log (console.py), stop signals (signals.py) and the loss guard (guard.py)."""
