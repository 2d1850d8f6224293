"""`gpt2train serve`: an OpenAI-compatible completions server over a trained model (engine.py: continuous
batching; app.py: the HTTP routes, limits, metrics and the playground page). Only cli/use.py imports it."""
