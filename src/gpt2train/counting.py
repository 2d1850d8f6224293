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
    non_embedding leaves out the embeddings (value embeddings too) and the head (85,056,000 for GPT-2 124M),
    as scaling laws count."""
    n = cfg.n_layer * layer_parameter_count(cfg) + _layer_norm_count(cfg) + _recipe_count(cfg)  # blocks, ln_f
    if non_embedding:
        return n
    return n + _embedding_count(cfg) + _head_count(cfg) + _position_count(cfg)


def _recipe_count(cfg: GPTConfig) -> int:
    """The record-setting recipe's parameters outside the embeddings: a value-embedding weight in each of the
    2k blocks that mix one in, the U-net's n_layer // 2 skip weights, the C x C multi-token projection."""
    ve_lambdas = 2 * cfg.value_embeddings
    skips = cfg.n_layer // 2 if cfg.unet_skips else 0
    return ve_lambdas + skips + _mtp_count(cfg)


def _mtp_count(cfg: GPTConfig) -> int:
    return cfg.n_embd * cfg.n_embd if cfg.mtp_weight > 0 else 0


def _embedding_count(cfg: GPTConfig) -> int:
    return (1 + cfg.value_embeddings) * cfg.padded_vocab_size * cfg.n_embd  # wte (and the head, when tied), value tables


def _head_count(cfg: GPTConfig) -> int:
    return 0 if cfg.tied_head else cfg.padded_vocab_size * cfg.n_embd


def _position_count(cfg: GPTConfig) -> int:
    return cfg.block_size * cfg.n_embd if cfg.position == "learned" else 0  # rotary has no parameters


def matmul_parameter_count(cfg: GPTConfig) -> int:
    """Parameters that enter a matmul (linear weights and biases, the tied lm_head, the multi-token
    projection): autocast casts these."""
    return cfg.n_layer * _layer_matmul_count(cfg) + cfg.padded_vocab_size * cfg.n_embd + _mtp_count(cfg)


def kv_cache_elements(cfg: GPTConfig, rows: float, slots: float) -> float:
    """Keys and values a KV cache holds: per layer, `slots` of n_embd each for every row, twice (model.KVCache)."""
    return 2 * cfg.n_layer * rows * slots * cfg.n_embd


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 * N + 12 * n_layer * n_embd * keys.

    N counts the parameters that enter a matmul: the blocks and the head (the tied lm_head is the token
    embedding; an untied one counts, and the token embedding is then a lookup, as the position embedding
    and the value embeddings always are), and with multi-token prediction the projection and the head a
    second time. The LayerNorms, rotations, norms and scalars of the modern options are a rounding error.
    6 = 2 (multiply-add) * 3 (forward + two backward matmuls). The second term is attention's QK^T and AV,
    which no parameter count sees: keys is seq_len, or the attention window when it is shorter (the final
    window: a window warmup trains its first steps with fewer).
    """
    head = cfg.padded_vocab_size * cfg.n_embd
    n = parameter_count(cfg, non_embedding=True) + head * (2 if cfg.mtp_weight > 0 else 1)  # blocks, ln_f, head(s)
    keys = min(seq_len, cfg.attention_window) if cfg.attention_window > 0 else seq_len
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * keys
