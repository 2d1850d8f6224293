"""Data: documents in (sources.py), tokens out as llm.c shards (prepare.py, shards.py), batches for training (loader.py)."""
