"""Parameters and FLOPs of a GPT, counted from its GPTConfig alone: no model is built, so gpt2-xl costs nothing.

plan, the memory estimator, the trainer's banner and MFU and the generation benchmark ask here; tests check
each count against the modules themselves and against numbers written out by hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpt2train.model import GPTConfig


def _layer_matmul_count(cfg: GPTConfig) -> int:
    """One block's linear layers: qkv (C x 3C), attention projection (C x C), MLP (C x 4C, 4C x C)."""
    C = cfg.n_embd
    return 12 * C * C + (9 * C if cfg.bias else 0)  # biases: 3C + C + 4C + C


def _layer_norm_count(cfg: GPTConfig) -> int:
    return 2 * cfg.n_embd if cfg.bias else cfg.n_embd  # a gain (and a bias)


def layer_parameter_count(cfg: GPTConfig) -> int:
    """One block: its linear layers and its two LayerNorms."""
    return _layer_matmul_count(cfg) + 2 * _layer_norm_count(cfg)


def parameter_count(cfg: GPTConfig, non_embedding: bool = False) -> int:
    """Every parameter once (the tied lm_head is the token embedding): GPT-2 124M padded is 124,475,904.
    non_embedding leaves out the embeddings and the head (85,056,000 for GPT-2 124M), as scaling laws count."""
    n = cfg.n_layer * layer_parameter_count(cfg) + _layer_norm_count(cfg)  # blocks and ln_f
    if non_embedding:
        return n
    return n + _embedding_count(cfg) + _head_count(cfg) + _position_count(cfg)


def _embedding_count(cfg: GPTConfig) -> int:
    return cfg.padded_vocab_size * cfg.n_embd  # wte (and the head, when tied)


def _head_count(cfg: GPTConfig) -> int:
    return 0 if cfg.tied_head else cfg.padded_vocab_size * cfg.n_embd


def _position_count(cfg: GPTConfig) -> int:
    return cfg.block_size * cfg.n_embd if cfg.position == "learned" else 0  # rotary has no parameters


def matmul_parameter_count(cfg: GPTConfig) -> int:
    """Parameters that enter a matmul (linear weights and biases, the tied lm_head): autocast casts these."""
    return cfg.n_layer * _layer_matmul_count(cfg) + cfg.padded_vocab_size * cfg.n_embd


def kv_cache_elements(cfg: GPTConfig, rows: float, slots: float) -> float:
    """Keys and values a KV cache holds: per layer, `slots` of n_embd each for every row, twice (model.KVCache)."""
    return 2 * cfg.n_layer * rows * slots * cfg.n_embd


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 * N + 12 * n_layer * n_embd * seq_len.

    N counts the parameters that enter a matmul: the blocks and the head (the tied lm_head is the token
    embedding; an untied one counts, and the token embedding is then a lookup, as the position embedding
    always is). The LayerNorms, rotations and norms of the modern options are a rounding error. 6 = 2
    (multiply-add) * 3 (forward + two backward matmuls). The second term is attention's QK^T and AV, which
    no parameter count sees.
    """
    n = parameter_count(cfg, non_embedding=True) + cfg.padded_vocab_size * cfg.n_embd  # blocks, ln_f, head
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len
