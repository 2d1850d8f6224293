"""Measuring the training step: the optimization journey (journey.py) and the memory estimator and batch search (memory.py)."""
