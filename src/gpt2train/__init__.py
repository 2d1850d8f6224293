"""gpt2train: pretrain GPT-2-family language models from scratch."""

__version__ = "0.1.0"
