"""Data: documents in (sources.py), tokens out as llm.c shards (prepare.py, shards.py), a prepared folder read
back and checked (prepared.py), batches for training (loader.py; mixture.py for several folders at once), and
the scaling ladder's corpus (markov.py)."""
