"""GPT-2 in one file, in the order the data flows.

Token + position embeddings -> n_layer pre-LN blocks (attention, MLP) -> final LayerNorm -> lm_head,
whose weight is the token embedding (tied). Parameter names follow Hugging Face's GPT-2 so that
import/export is a transpose and a rename away (see hf.py). Nothing here knows about training loops,
devices or distributed wrappers: those are applied from outside.

The modern recipe's changes are config options whose defaults are GPT-2's own choices, each a few lines
where it acts: rotary position encoding (queries and keys rotated by their position instead of a learned
position embedding), RMS-normalized queries and keys, a ReLU-squared MLP, an untied output head,
zero-initialized residual projections, and a tanh soft cap on the logits.

The record-setting recipe (modded-nanogpt's speedruns, nanochat) adds four more, off by default, in the order
the data meets them:
- value_embeddings: k extra token-embedding tables whose rows join the attention values of the first k and
  the last k blocks (table i feeds block i and block n_layer - k + i: a U shape), each block weighing its
  table by a learned scalar;
- unet_skips: the outputs of the first n_layer // 2 blocks are added, each times a learned scalar, to the
  inputs of the last n_layer // 2 blocks in reverse order (block 0's output into the last block);
- attention_window: each token attends to itself and the window - 1 tokens before it (a boolean mask
  through SDPA); the trainer may grow the window to this size over train.window_warmup_steps (GPT.window);
- mtp_weight: in training, the loss adds this weight times the cross-entropy of the token after the target,
  predicted from the same final hidden state through a small projection and the same head (multi-token
  prediction); evaluation's loss stays the plain next-token loss.

The embedding has padded_vocab_size rows (a multiple of 64, for fast matmuls) but the model is a
distribution over vocab_size tokens: the padded columns of the logits are cut off before the softmax,
so padded ids are never scored nor sampled, and an exported model (unpadded) gives the same numbers.

Beside it: classifier.py (the soft cap and the fused classifier that loss_chunk > 0 uses) and counting.py
(parameters and FLOPs from a GPTConfig, without building a model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gpt2train.classifier import chunked_cross_entropy, softcap
from gpt2train.ranges import Range, above, at_least, between
from gpt2train.sections import Section
from gpt2train.tokenizer import GPT2_VOCAB_SIZE


@dataclass
class GPTConfig(Section):
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024  # longest sequence the position embedding covers
    vocab_size: int = GPT2_VOCAB_SIZE  # the tokenizer's vocabulary; 0 means "take it from the prepared data"
    pad_vocab_multiple: int = 64  # 50257 -> 50304: matmuls on multiples of 64 run faster
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"  # "sdpa" (flash / memory-efficient kernels) or "naive" (reference)
    grad_checkpointing: bool = False  # recompute each block's activations in backward
    loss_chunk: int = 0  # > 0: cross-entropy over this many rows at a time, never the full logits
    # The modern recipe (configs/shakespeare-modern.toml); each default is GPT-2's own choice.
    position: str = "learned"  # learned: GPT-2's position embedding; rotary: queries and keys rotated (RoPE)
    rope_base: float = 10000.0  # rotary: the base of the rotation frequencies
    qk_norm: bool = False  # RMS-normalize each head's queries and keys before attention
    mlp: str = "gelu"  # gelu (GPT-2's tanh approximation) | relu2 (relu(x) squared)
    tied_head: bool = True  # the output head is the token embedding; false: a separate matrix
    zero_init_proj: bool = False  # residual projections (and an untied head) start at zero
    logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap)
    # The record-setting recipe; each 0 / false is GPT-2 as it was.
    value_embeddings: int = 0  # extra token-embedding tables mixed into the values of the first and last blocks
    unet_skips: bool = False  # the first half's block outputs added to the second half's inputs, in reverse order
    attention_window: int = 0  # > 0: each token attends to itself and the window - 1 tokens before it
    mtp_weight: float = 0.0  # > 0: training loss + this x the cross-entropy of the token two ahead
    # The size dial (sizing.py): depth > 0 sets n_layer = depth, n_embd = depth * aspect_ratio, n_head =
    # n_embd / head_dim, and the training settings by rule, where the config does not set them. 0: off.
    depth: int = 0
    aspect_ratio: int = 64  # width per layer: depth 12 is GPT-2 124M's 768
    head_dim: int = 64  # GPT-2's head size

    # The values each choice above takes (config.py's CHOICES lists these, it does not repeat them).
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "attention": ("sdpa", "naive"),
        "position": ("learned", "rotary"),
        "mlp": ("gelu", "relu2"),
    }
    # The numbers each size takes (config.py's RANGES lists these, it does not repeat them). 0 means "off" or
    # "from elsewhere" where it is allowed: the comments beside the fields say which.
    RANGES: ClassVar[dict[str, Range]] = {
        "n_layer": at_least(1),
        "n_head": at_least(1),
        "n_embd": at_least(1),
        "block_size": at_least(1),
        "vocab_size": at_least(0),
        "pad_vocab_multiple": at_least(1),
        "dropout": between(0, 1, high_open=True),
        "loss_chunk": at_least(0),
        "rope_base": above(1),  # frequencies base^(-2i/hs) fall from pair to pair; a tiny base overflows fp32 (nan)
        "logit_softcap": at_least(0),
        "value_embeddings": at_least(0),
        "attention_window": at_least(0),
        "mtp_weight": at_least(0),
        "depth": at_least(0),
        "aspect_ratio": at_least(1),
        "head_dim": at_least(1),
    }

    def check(self, vocab_from_data: bool = False) -> GPTConfig:
        """Raise ValueError (one line naming the key) for a shape no GPT can take; returns self. GPT checks
        its config when built, config.validate every run's; vocab_from_data: vocab_size 0 is allowed (a run
        config's "take it from the prepared data")."""
        for key, allowed in self.CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.{key} = {getattr(self, key)!r} is not allowed; use one of: {', '.join(allowed)}")
        for key, allowed in self.RANGES.items():  # a GPTConfig built in code has had no other check
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"model.{key} = {value!r} has the wrong type; expected a number")
            if value not in allowed:
                raise ValueError(f"model.{key} = {value!r} is out of range; it must be {allowed}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd = {self.n_embd} is not a multiple of model.n_head = {self.n_head}; each "
                             f"head gets n_embd / n_head channels, so n_embd must be divisible by n_head")
        if self.position == "rotary" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"model.position = rotary needs an even head size; n_embd / n_head = "
                             f"{self.n_embd // self.n_head}")
        if 2 * self.value_embeddings > self.n_layer:
            raise ValueError(f"model.value_embeddings = {self.value_embeddings} needs 2 blocks per table (the first "
                             f"and the last blocks share them); model.n_layer = {self.n_layer} holds at most "
                             f"{self.n_layer // 2}")
        if self.unet_skips and self.n_layer < 2:
            raise ValueError("model.unet_skips = true needs model.n_layer >= 2 (a first half to skip from)")
        if self.vocab_size <= 0 and not vocab_from_data:
            raise ValueError("model.vocab_size must be set (the trainer takes it from the data's meta.json)")
        return self

    def value_table(self, layer: int) -> int | None:
        """The value-embedding table block `layer` mixes into its values: i for block i and for block
        n_layer - k + i (the first k blocks and the last k, in the same order); None for the blocks between."""
        k = self.value_embeddings
        if layer < k:
            return layer
        return layer - (self.n_layer - k) if layer >= self.n_layer - k else None

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the token embedding: vocab_size rounded up to pad_vocab_multiple (50257 -> 50304)."""
        m = max(1, self.pad_vocab_multiple)
        return (self.vocab_size + m - 1) // m * m

    def beyond_gpt2(self) -> list[str]:
        """The options set here that Hugging Face's GPT-2 cannot hold (zero_init_proj is only an init)."""
        gpt2 = GPTConfig()
        keys = ("position", "qk_norm", "mlp", "tied_head", "logit_softcap", "value_embeddings", "unet_skips",
                "attention_window", "mtp_weight")
        return [f"model.{k} = {getattr(self, k)}" for k in keys if getattr(self, k) != getattr(gpt2, k)]


# Hugging Face's shapes for the four GPT-2 sizes, plus small ones that train on a CPU.
PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
    "gpt2-mini": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2-tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
}


def preset_config(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})


class KVCache:
    """Keys and values of every layer for the tokens seen so far, in `size` slots preallocated once.

    Rows may be left-padded to a common length (several prompts in one batch): `real` marks the slots that
    hold a real token, a token's position id is the count of real tokens before it in its row, and no query
    attends to a padded slot. Every piece of state is a tensor updated in place, so a decode step has the
    same shapes and addresses at every call: it compiles once (and can be captured as a CUDA graph).
    """

    def __init__(self, cfg: GPTConfig, batch_size: int, size: int, device, dtype):
        if size > cfg.block_size:
            raise ValueError(f"a KV cache of {size} slots exceeds block_size {cfg.block_size}")
        # A tensor per layer, not one for all: a compiled step that wrote into a layer's slice of one
        # tensor rewrote the whole tensor at every layer (so inductor compiled cache.k[layer].index_copy_).
        shape = (batch_size, cfg.n_head, size, cfg.n_embd // cfg.n_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.real = torch.zeros(batch_size, size, dtype=torch.bool, device=device)  # False: padding or unused
        self.filled = torch.zeros((), dtype=torch.long, device=device)  # slots used, the same in every row
        self.size = size
        self.reads = size  # slots the current forward's attention reads (set by start)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)  # the slots the current forward writes (start)

    @property
    def length(self) -> int:
        return int(self.filled)

    def new_slots(self, T: int) -> torch.Tensor:
        """The slots the T tokens of this forward go to (T,)."""
        return self.filled + torch.arange(T, device=self.filled.device)

    def start(self, padding_mask: torch.Tensor, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Record which of the T new tokens are real ((B, T), False at left padding); their position ids
        (B, T) and the attention mask (B, 1, T, reads): each query sees the real tokens up to itself, and
        with a window > 0 only those fewer than `window` positions before it.

        reads, the slots this forward's attention reads: eagerly the used ones and the new (the rest are
        empty, and a generation of 256 tokens would read twice what it needs); compiled, all of them, so
        that every decode step has one shape."""
        T = padding_mask.size(1)
        self.reads = self.size if torch.compiler.is_compiling() else self.length + T
        self.slots = slots = self.new_slots(T)
        self.real.index_copy_(1, slots, padding_mask)
        order = self.real.cumsum(1) - 1  # (B, size): each real token's position id
        positions = order.clamp(min=0).index_select(1, slots)
        key = torch.arange(self.reads, device=slots.device)
        causal = key <= slots[:, None]  # (T, reads)
        real = self.real[:, None, :self.reads]  # (B, 1, reads)
        if window > 0:  # by position ids, not slots: padding between a row's tokens takes no room in it
            real = real & (positions[:, :, None] - order[:, None, :self.reads] < window)  # (B, T, reads)
        # A padding query sees only itself: a row of the softmax with no key at all would be NaN, and NaN
        # times a zero attention weight is still NaN in the rows that must not see it.
        visible = causal & (real | (key == slots[:, None]))  # (B, T, reads)
        return positions, visible[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys and values (B, nh, T, hs) into their slots (start chose them, once for
        every layer); return the slots attention reads (B, nh, reads, hs; see start): any unused ones are
        hidden by the mask."""
        self.k[layer].index_copy_(2, self.slots, k)
        self.v[layer].index_copy_(2, self.slots, v)
        return self.k[layer][:, :, :self.reads], self.v[layer][:, :, :self.reads]


def rotary_angles(positions: torch.Tensor, head_size: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation of each position: (T, hs/2) for positions (T,), (B, 1, T, hs/2) for
    positions (B, T) (one row per sequence, as the KV cache gives them). Channel pair i turns at the
    frequency base^(-2i/hs): the first pairs by about a radian per position, the last hardly at all."""
    freqs = base ** -(torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size)
    angles = positions.float()[..., None] * freqs  # (..., T, hs/2), in fp32 at any autocast dtype
    if positions.dim() == 2:
        angles = angles[:, None]  # a head dimension, to broadcast over (B, nh, T, hs/2)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair of channels (i, i + hs/2) of x (B, nh, T, hs) by its position's angle: the dot
    product of a rotated query and key then depends only on how far apart their positions are."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.attention = cfg.attention
        self.dropout = cfg.dropout
        self.qk_norm = cfg.qk_norm
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.is_residual_projection = True
        self.resid_dropout = nn.Dropout(cfg.dropout)
        if cfg.value_table(layer) is not None:  # its own weight of a table another block shares
            self.ve_lambda = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, attn_mask: torch.Tensor | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None, ve: torch.Tensor | None = None) -> torch.Tensor:
        """attn_mask None: causal over x alone (training). Else booleans over the keys: (T, T) for a sliding
        window over x, (B, 1, T, S) over the cache's S slots. rotary: (cos, sin) of the tokens' positions, when
        the model encodes positions by rotation. ve: this block's value embeddings of the tokens (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        if ve is not None:  # value embeddings: a row of the token's own table joins its value
            v = v + (self.ve_lambda * ve).to(v.dtype)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.qk_norm:  # unit RMS per head: the attention logits cannot grow without bound
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)  # (B, nh, S, hs)
        dropout = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            if attn_mask is None:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, nh, T, T or S)
            if attn_mask is None:
                attn_mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~attn_mask, float("-inf"))
            att = F.dropout(F.softmax(att, dim=-1), p=dropout, training=self.training)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class ReLUSquared(nn.Module):
    """relu(x)^2: as cheap as ReLU, smooth at 0 in value, and learns faster than GELU in small-model runs."""

    def forward(self, x):
        return F.relu(x).square()


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        # GPT-2 used GELU's tanh approximation. The name stays `gelu` for either: it is not a parameter,
        # and the attribute name is what a reader of GPT-2 code looks for.
        self.gelu = nn.GELU(approximate="tanh") if cfg.mlp == "gelu" else ReLUSquared()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.is_residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, kv_cache: KVCache | None = None, attn_mask: torch.Tensor | None = None, rotary=None, ve=None):
        x = x + self.attn(self.ln_1(x), kv_cache, attn_mask, rotary, ve)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg.check()
        V = cfg.padded_vocab_size
        # Built in GPT-2's order (wte, wpe, blocks, ln_f): the order fixes each weight's random init.
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, cfg.n_embd)))
        if cfg.position == "learned":
            self.transformer.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.transformer.drop = nn.Dropout(cfg.dropout)
        self.transformer.h = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.transformer.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, V, bias=False)
        if cfg.tied_head:
            self.lm_head.weight = self.transformer.wte.weight  # tied: one matrix reads and writes tokens
        else:
            self.lm_head.is_output_head = True
        # The record-setting recipe's parts, built after GPT-2's so that they leave its init as it was.
        if cfg.value_embeddings:
            self.value_embeds = nn.ModuleList(nn.Embedding(V, cfg.n_embd) for _ in range(cfg.value_embeddings))
        if cfg.unet_skips:
            self.skip_weights = nn.Parameter(torch.ones(cfg.n_layer // 2))  # 1: each skip starts fully open
        if cfg.mtp_weight > 0:
            self.mtp_head = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.apply(self._init_weights)
        if cfg.mtp_weight > 0:  # zero: the token two ahead starts from the next token's logits, as one head
            nn.init.zeros_(self.mtp_head.weight)
        # The window forward attends over: the config's, or a smaller one that the trainer sets while it grows
        # the window (train.window_warmup_steps). Not a weight: a loaded model attends over the config's.
        self.window = cfg.attention_window

    def _init_weights(self, module: nn.Module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if getattr(module, "is_residual_projection", False):
                # Each block adds two projections into the residual stream; scale them so its
                # variance does not grow with depth (GPT-2 paper, section 2.3).
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            zero = self.config.zero_init_proj and (getattr(module, "is_residual_projection", False)
                                                   or getattr(module, "is_output_head", False))
            if zero:  # each block starts as the identity, and the first logits are uniform
                nn.init.zeros_(module.weight)
            else:
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                padding_mask: torch.Tensor | None = None, last_only: bool = False,
                positions: tuple[torch.Tensor, torch.Tensor] | None = None):
        """idx (B, T) token ids -> logits (B, T, vocab_size); with targets (B, T), (logits, mean cross-entropy).

        With targets and config.loss_chunk > 0 the logits are never materialized, and None is returned
        in their place. Targets of -1 are ignored. With a kv_cache, idx continues the cached tokens, and
        padding_mask (B, T) marks the real ones (False: left padding; default all real). last_only: the
        logits of the last position alone (B, 1, vocab_size), all that sampling needs. positions (rows, columns),
        two (N,) index tensors: the logits of those N positions alone (N, vocab_size), all that scoring a
        continuation needs (the head's matmul is most of a short model's forward). In training mode with
        config.mtp_weight > 0 the loss is the training objective (next token + mtp_weight x two ahead); in
        eval mode it is always the next-token cross-entropy.
        """
        B, T = idx.shape
        pos, attn_mask = self.positions_and_mask(idx, kv_cache, padding_mask)
        x, rotary = self.embed(idx, pos)
        x = self.run_blocks(x, self.token_values(idx), kv_cache, attn_mask, rotary)
        if kv_cache is not None:
            kv_cache.filled += T
        if last_only:
            x = x[:, -1:]
        elif positions is not None:
            x = x[positions]  # (N, C)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.classify(x)
        logits, loss = self.classify(x, targets)
        if self.training and self.config.mtp_weight > 0 and T > 1:
            loss = loss + self.config.mtp_weight * self.mtp_loss(x, targets)
        return logits, loss

    def positions_and_mask(self, idx: torch.Tensor, kv_cache: KVCache | None, padding_mask: torch.Tensor | None):
        """Each token's position id and the attention mask. Without a cache: positions (T,) from 0, and None
        (causal: the training path, SDPA's is_causal kernels) or a sliding window's (T, T). With one: positions
        (B, T) and a mask (B, 1, T, S) over its slots, from the cache (KVCache.start)."""
        B, T = idx.shape
        if kv_cache is None:
            if padding_mask is not None:
                raise ValueError("a padding_mask needs a kv_cache (which turns it into positions and a mask)")
            if T > self.config.block_size:
                raise ValueError(f"sequence of {T} tokens exceeds block_size {self.config.block_size}")
            pos = torch.arange(T, device=idx.device)  # (T,)
            return pos, self.sliding_window(pos, T)
        if not torch.compiler.is_compiling() and kv_cache.length + T > kv_cache.size:
            raise ValueError(f"sequence of {kv_cache.length + T} tokens exceeds the KV cache's "
                             f"{kv_cache.size} slots")
        if padding_mask is None:
            padding_mask = torch.ones(B, T, dtype=torch.bool, device=idx.device)
        return kv_cache.start(padding_mask, self.window)  # (B, T), (B, 1, T, S)

    def sliding_window(self, pos: torch.Tensor, T: int) -> torch.Tensor | None:
        """attention_window shorter than the sequence: each query sees itself and the window - 1 keys before it
        (T, T); else None, plain causal."""
        if not 0 < self.window < T:
            return None
        distance = pos[:, None] - pos  # (T, T): query minus key position
        return (distance >= 0) & (distance < self.window)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor):
        """Token embeddings (B, T, C), with learned position embeddings added; or, with rotary positions, the
        (cos, sin) that attention turns queries and keys by (else None)."""
        cfg = self.config
        x = self.transformer.wte(idx)  # (B, T, C)
        rotary = None
        if cfg.position == "learned":
            x = x + self.transformer.wpe(pos)
        else:
            rotary = rotary_angles(pos, cfg.n_embd // cfg.n_head, cfg.rope_base)
        return self.transformer.drop(x), rotary

    def token_values(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """Value embeddings: each table's rows of the tokens (B, T, C); none without them."""
        return [table(idx) for table in self.value_embeds] if self.config.value_embeddings else []

    def run_blocks(self, x: torch.Tensor, values: list[torch.Tensor], kv_cache: KVCache | None,
                   attn_mask: torch.Tensor | None, rotary) -> torch.Tensor:
        """The blocks in order, each given its value embeddings (if its layer has a table) and, in the last half,
        its U-net skip."""
        cfg = self.config
        skips = []  # U-net: the outputs of the first n_layer // 2 blocks
        n_skips = cfg.n_layer // 2 if cfg.unet_skips else 0
        for i, block in enumerate(self.transformer.h):
            if i >= cfg.n_layer - n_skips:
                x = self.unet_skip(x, skips, i)
            table = cfg.value_table(i)
            ve = values[table] if table is not None else None
            if cfg.grad_checkpointing and self.training and kv_cache is None:
                x = checkpoint(block, x, None, attn_mask, rotary, ve, use_reentrant=False)
            else:
                x = block(x, kv_cache, attn_mask, rotary, ve)
            if i < n_skips:
                skips.append(x)
        return x

    def unet_skip(self, x: torch.Tensor, skips: list[torch.Tensor], i: int) -> torch.Tensor:
        """Block i, of the last n_layer // 2, takes the output of its mirror among the first ones (the last block
        takes block 0's), times a learned scalar."""
        j = self.config.n_layer - 1 - i
        return x + self.skip_weights[j] * skips[j]

    def mtp_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Multi-token prediction: from the same hidden state, through a small projection and the same head, the
        token after the target too. Training only: evaluation's loss stays next-token."""
        ahead = F.pad(targets[:, 1:], (0, 1), value=-1)  # (B, T): the token two ahead; none after the last
        return self.classify(x + self.mtp_head(x), ahead)[1]

    def classify(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        """Final hidden states x (B, T, C) -> logits (B, T, vocab_size); with targets, (logits, mean
        cross-entropy), the logits None when config.loss_chunk > 0 (never materialized)."""
        V, cap = self.config.vocab_size, self.config.logit_softcap
        if targets is not None and self.config.loss_chunk > 0:
            return None, chunked_cross_entropy(x, self.lm_head.weight, targets, self.config.loss_chunk, V, cap)
        # The matmul runs on all padded_vocab_size columns (the fast shape); the padding is then cut off
        # (a view, no copy) so that the softmax, the loss and sampling see only real tokens.
        logits = self.lm_head(x)[..., :V]  # (B, T, V)
        if cap > 0:
            logits = softcap(logits, cap)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss
