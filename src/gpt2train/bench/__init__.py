"""Benchmarks, above the library they measure: the optimization journey (journey.py), the largest micro-batch that
fits, measured on CUDA (find_batch.py), generation (generate.py), the server under load (serve.py), prepare
(prepare.py), the quality journey (quality.py) and the scaling ladder (scaling.py). Nothing in the library imports
them; plan, doctor and the trainer read their result files through gpt2train.bench_results."""
