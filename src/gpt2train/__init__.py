"""gpt2train: pretrain GPT-2-family language models from scratch.

The library face, for `from gpt2train import ...`:

    GPT, GPTConfig     the model and its shape (gpt2train.model)
    load_config        defaults <- a TOML file or preset name <- overrides (gpt2train.config)
    train              train(cfg, run_dir, resume=None) (gpt2train.train.loop)
    load_model         a model from a run directory, a checkpoint or a Hugging Face GPT-2 folder
    load_tokenizer     the tokenizer such a run or checkpoint records
    generate           generate(model, prompt_ids, max_new_tokens, ...) -> new token ids (gpt2train.generate)

They are imported on first use (PEP 562), so `import gpt2train` stays cheap (no torch) and this package
file, the lowest layer, imports nothing from the layers above it at import time.
"""

import sys
import types

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "generate", "load_config", "load_model", "load_tokenizer", "train", "__version__"]


def __getattr__(name: str):
    """Import a library-face name on first access (with _Package below, the only imports this file makes)."""
    if name in ("GPT", "GPTConfig"):
        from gpt2train import model

        return getattr(model, name)
    if name == "load_config":
        from gpt2train.config import load_config

        return load_config
    if name == "load_model":
        from gpt2train.hf import load_pretrained

        return load_pretrained
    if name == "load_tokenizer":
        from gpt2train.hf import load_pretrained_tokenizer

        return load_pretrained_tokenizer
    raise AttributeError(f"module 'gpt2train' has no attribute {name!r}")


class _Package(types.ModuleType):
    """`train` and `generate` are also submodules, and importing a submodule sets it as an attribute of this
    package, which __getattr__ would then never be asked for. So these two are properties that always give
    the function; the importer's assignment is ignored (the submodules stay in sys.modules, and
    `from gpt2train.train.loop import ...` works as before; `gpt2train.train.loop` as an attribute does not)."""

    @property
    def train(self):
        from gpt2train.train.loop import train

        return train

    @train.setter
    def train(self, submodule):
        pass

    @property
    def generate(self):
        from gpt2train.generate import generate

        return generate

    @generate.setter
    def generate(self, submodule):
        pass


sys.modules[__name__].__class__ = _Package
