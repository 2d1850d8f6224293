"""Benchmarks: the optimization journey (journey.py), the memory estimator and batch search (memory.py), generation
(generate.py), the server under load (serve.py), prepare (prepare.py), the quality journey (quality.py) and the
scaling ladder (scaling.py)."""
