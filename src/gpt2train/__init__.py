"""gpt2train: pretrain GPT-2-family language models from scratch.

The library face, for `from gpt2train import ...`:

    GPT, GPTConfig     the model and its shape (gpt2train.model)
    load_config        defaults <- a TOML file or preset name <- overrides: what you wrote (gpt2train.config)
    resolve_run        that config resolved for a run, with where each derived value came from (gpt2train.runconfig)
    train              train(cfg, run_dir, resume=None): a config or a resolved one (gpt2train.training.loop)
    load_model         a model from a run directory, a checkpoint or a Hugging Face GPT-2 folder
    load_tokenizer     the tokenizer such a run or checkpoint records
    generate           generate(model, prompt_ids, max_new_tokens, ...) -> new token ids (gpt2train.generation)

They are imported on first use (PEP 562), so `import gpt2train` stays cheap (no torch) and this package
file, the lowest layer, imports nothing from the layers above it at import time.
"""

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "generate", "load_config", "load_model", "load_tokenizer", "resolve_run", "train",
           "__version__"]


def __getattr__(name: str):
    """Import a library-face name on first access (the only imports this file makes)."""
    if name in ("GPT", "GPTConfig"):
        from gpt2train import model

        return getattr(model, name)
    if name == "load_config":
        from gpt2train.config import load_config

        return load_config
    if name == "resolve_run":
        from gpt2train.runconfig import resolve_run

        return resolve_run
    if name == "load_model":
        from gpt2train.loading import load_pretrained

        return load_pretrained
    if name == "train":
        from gpt2train.training.loop import train

        return train
    if name == "generate":
        from gpt2train.generation import generate

        return generate
    if name == "load_tokenizer":
        from gpt2train.loading import load_pretrained_tokenizer

        return load_pretrained_tokenizer
    raise AttributeError(f"module 'gpt2train' has no attribute {name!r}")
