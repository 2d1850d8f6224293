"""`gpt2train pipeline`: the whole job, data to a chat model, as one resumable command. definition.py (a pipeline
file: stages, each a gpt2train command; what each reads and writes, checked before any runs), runner.py (each
stage skipped when done from the same fingerprint, resumed when interrupted, rerun when a setting changed),
measure.py (what each stage measured), estimate.py (--plan), card.py (the report card)."""
