"""How much memory a training step needs, predicted from the config: `gpt2train memory` and `gpt2train plan`.

`estimate_memory(cfg)` adds up what a step keeps alive, component by component, from the model's
actual ops (see docs/benchmarks.md, "Memory estimator", for the derivation), and predicts the peak by
walking the step's phases: forward, the loss's backward, each block's backward, the optimizer step.
It is arithmetic only, so `gpt2train plan` can call it in a loop. The tests measure steps on the CPU
(tests/tensor_memory.py), which is how the estimator is checked without a GPU; `memory --find-batch`
measures on CUDA instead (bench/find_batch.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from gpt2train.config import Config, batch_stages, data_sources
from gpt2train.counting import layer_parameter_count, matmul_parameter_count, parameter_count
from gpt2train.model import GPTConfig
from gpt2train.runtime import batch_problem, resolve_compile, resolve_dtype
from gpt2train.tokenizer import GPT2_VOCAB_SIZE
from gpt2train.training.optim import muon_parameter_count, uses_fused_adamw
from gpt2train.units import format_bytes

FP32 = 4
INT64 = 8


# --- activations -----------------------------------------------------------------------------------
def block_activation_bytes(m: GPTConfig, B: int, T: int, act: int) -> int:
    """Bytes one block's forward leaves saved for backward (no checkpointing).

    act is the bytes of the compute dtype (4 fp32, 2 under bf16/fp16 autocast). The residual stream
    stays fp32 under autocast (the embeddings are fp32 and x + bf16 promotes), and LayerNorm runs in
    fp32; matmul inputs are saved in the compute dtype.
    """
    C, nh = m.n_embd, m.n_head
    BTC, BT = B * T * C, B * T
    total = 2 * BTC * FP32  # the residual stream, saved by ln_1 and by ln_2
    total += 2 * 2 * BT * FP32  # each LayerNorm's mean and 1/std per row
    total += 2 * BTC * act  # ln_1 and ln_2 outputs, the inputs of c_attn and c_fc
    total += 4 * BTC * act * 2  # c_fc output (GELU's input) and GELU's output (c_proj's input), 4C wide
    total += BTC * act  # attention output, the input of attn.c_proj
    if m.attention == "sdpa":
        total += 3 * BTC * act  # q, k, v: views of the c_attn output, saved by SDPA
        total += B * nh * T * FP32  # SDPA's log-sum-exp per query, fp32; the (T, T) scores are never stored
    else:
        total += 3 * BTC * act  # q, k^T, v copied to contiguous (B*nh, T, hs) by the batched matmuls
        scores = B * nh * T * T
        total += scores * FP32  # softmax output, fp32 (autocast runs softmax in fp32)
        if act != FP32:
            total += scores * act  # ... cast back to the compute dtype for att @ v
        total += T * T  # the causal mask, bool
    if m.dropout > 0:
        total += 2 * BTC  # bool masks of the two residual dropouts
        if m.attention == "naive":
            total += B * nh * T * T
    return total


def top_activation_bytes(m: GPTConfig, B: int, T: int, act: int) -> int:
    """Bytes saved outside the blocks, logits excluded: token/position ids, final LayerNorm, targets."""
    BT, C = B * T, m.n_embd
    total = BT * INT64 + T * INT64  # ids kept by the two embeddings' backward
    total += B * T * C * FP32 + 2 * BT * FP32  # ln_f input (the last block's output) and its statistics
    # ln_f output: the lm_head's input in the compute dtype; the fused classifier (chunked loss) keeps none
    total += 0 if m.loss_chunk > 0 else B * T * C * act
    total += BT * INT64  # targets, kept by cross-entropy
    if m.dropout > 0:
        total += B * T * C  # the embedding dropout's mask
    return total


def logits_bytes(m: GPTConfig, B: int, T: int, act: int) -> tuple[int, int]:
    """(kept after forward, peak) bytes of the logits and loss buffers.

    Full loss: the (B*T, V) logits in the compute dtype (the caller holds them) and log_softmax's fp32
    output are kept; the loss's backward adds the fp32 gradients of both, 4 + 4 bytes per logit.
    Chunked loss (the fused classifier): the gradients of the hidden states and of the weight, fp32, are
    made in forward and kept for backward, which scales them into new tensors (twice that at its peak).
    In forward one chunk's fp32 log-probabilities (turned into their gradient in place) and one chunk's
    weight-gradient product exist on top; under autocast also the chunk's logits and gradient in the
    compute dtype, and a cast of the weight.
    """
    V, C = m.padded_vocab_size, m.n_embd
    if m.loss_chunk <= 0:
        kept = B * T * V * (act + FP32)
        return kept, kept + 2 * B * T * V * FP32
    rows = min(m.loss_chunk, B * T)
    kept = B * T * C * FP32 + V * C * FP32
    casts = 2 * rows * V * act + V * C * act if act != FP32 else 0
    forward_peak = kept + rows * V * FP32 + casts + V * C * FP32
    return kept, max(forward_peak, 2 * kept)


# --- the estimate ------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    breakdown: dict[str, int]  # bytes per component (what each one holds at its largest)
    total_bytes: int  # predicted peak of a steady-state training step (optimizer states exist)
    peak_phase: str  # where in the step the peak falls
    saved_after_forward: int  # activations + logits kept when the forward ends (what backward will use)
    micro_batch: int
    seq_len: int
    world_size: int
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        width = max(len(k) for k in self.breakdown) + 2
        lines = [f"memory per device: micro_batch {self.micro_batch} x seq_len {self.seq_len}, "
                 f"world size {self.world_size}", f"{'component':<{width}} {'size':>11}"]
        lines += [f"{name:<{width}} {format_bytes(n):>11}" for name, n in self.breakdown.items()]
        lines.append(f"{'predicted peak':<{width}} {format_bytes(self.total_bytes):>11}  ({self.peak_phase}; "
                     "not the sum: gradients appear as activations are freed)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def resolve_model(cfg: Config) -> tuple[GPTConfig, list[str]]:
    """The model config with vocab_size filled in as the trainer does (from the data's meta.json), else
    GPT-2's 50257."""
    notes = []
    data_vocab = None
    meta = Path(data_sources(cfg.data)[0][0]) / "meta.json"  # data.dir, or a mixture's first source (one tokenizer)
    if cfg.model.vocab_size <= 0:
        if meta.is_file():
            data_vocab = int(json.loads(meta.read_text())["vocab_size"])
        else:
            notes.append(f"model.vocab_size = 0 and {meta} not found: assumed GPT-2's {GPT2_VOCAB_SIZE}")
    vocab = cfg.model.vocab_size if cfg.model.vocab_size > 0 else data_vocab or GPT2_VOCAB_SIZE
    return dataclasses.replace(cfg.model, vocab_size=vocab), notes


def compute_bytes(dtype: str, device_type: str) -> int:
    """Bytes per element of the compute dtype, as the trainer resolves train.dtype (a planned GPU has bf16)."""
    return resolve_dtype(dtype, device_type, bf16_supported=True).itemsize


def optimizer_state_bytes(cfg: Config, m: GPTConfig, shards: int = 1) -> int:
    """AdamW keeps exp_avg and exp_avg_sq, fp32, per parameter; Muon one fp32 momentum buffer per matrix it
    manages (train.optimizer = muon: the blocks' weight matrices), AdamW's two for the rest."""
    P = parameter_count(m)
    M = muon_parameter_count(m) if cfg.train.optimizer == "muon" else 0
    return math.ceil((2 * (P - M) + M) * FP32 / shards)


def estimate_memory(cfg: Config, world_size: int = 1, *, micro_batch: int | None = None,
                    device_type: str | None = None) -> MemoryEstimate:
    """Predicted per-device memory of one training step of cfg.

    micro_batch overrides cfg.train.micro_batch (for searches); device_type ("cuda", "cpu") defaults to
    cfg.train.device, with "auto" read as cuda: the estimate is for planning GPU runs.
    """
    m, notes = resolve_model(cfg)
    B = micro_batch if micro_batch is not None else cfg.train.micro_batch
    T = cfg.train.seq_len or m.block_size
    if B < 1 or T < 1:
        raise ValueError(f"micro_batch {B} and seq_len {T} must be positive")
    if T > m.block_size:
        raise ValueError(f"train.seq_len = {T} exceeds model.block_size = {m.block_size}")
    if device_type is None:
        device_type = cfg.train.device.split(":")[0]
        device_type = "cuda" if device_type == "auto" else device_type
    act = compute_bytes(cfg.train.dtype, device_type)
    held = held_bytes(cfg, m, B, T, act, world_size, device_type)
    # With gradient accumulation the gradients are zeroed once per optimizer step, so from the second
    # micro-batch on all of them exist through forward and backward.
    most = max((mult for _, mult in batch_stages(cfg.train)), default=1)  # train.batch_schedule's largest step
    accumulating = max(cfg.train.total_batch_tokens, B * T * world_size) * most > B * T * world_size
    phases = phase_bytes(m, B, T, act, held, accumulating)
    peak = max(phases, key=phases.get)
    notes += estimate_notes(cfg, B, T, world_size, device_type, accumulating)
    return MemoryEstimate(breakdown=held.breakdown(), total_bytes=int(phases[peak]),
                          peak_phase="backward through the blocks" if peak.startswith("backward of block") else peak,
                          saved_after_forward=held.activations + held.logits_kept,
                          micro_batch=B, seq_len=T, world_size=world_size, notes=notes)


@dataclass
class HeldBytes:
    """What one training step holds on one device, component by component, each at its largest."""
    params: int
    grads: int
    optimizer: int
    copies: int  # autocast's compute-dtype copies of the matmul weights (0 in fp32)
    block: int  # one block's saved activations
    saved_block: int  # what a block keeps for backward: its activations, or its input under checkpointing
    activations: int  # all blocks' and the top's
    logits_kept: int
    logits_peak: int
    distributed: dict[str, int]  # DDP's gradient buckets or FSDP's gathered weights, by name (none on one device)
    step_temp: int  # the optimizer step's temporaries
    average: int  # train.average_last's mean of the weights
    shards: int  # how many ways FSDP splits parameters, gradients and optimizer states (1 without it)

    def breakdown(self) -> dict[str, int]:
        rows = {"parameters": self.params, "gradients": self.grads, "optimizer states": self.optimizer}
        if self.copies:
            rows["autocast weight copies"] = self.copies
        rows["activations"] = self.activations
        rows["logits and loss"] = self.logits_peak
        rows.update(self.distributed)
        if self.step_temp:
            rows["optimizer step temporaries"] = self.step_temp
        if self.average:
            rows["weight average"] = self.average
        return rows


def held_bytes(cfg: Config, m: GPTConfig, B: int, T: int, act: int, world_size: int, device_type: str) -> HeldBytes:
    """The components of one step of m on a (B, T) micro-batch with compute dtype of act bytes."""
    fsdp = world_size > 1 and cfg.train.distributed == "fsdp"
    shards = world_size if fsdp else 1
    L = m.n_layer
    P = parameter_count(m)
    copies = matmul_parameter_count(m) * act if act != FP32 else 0
    block = block_activation_bytes(m, B, T, act)
    saved_block = B * T * m.n_embd * FP32 if m.grad_checkpointing else block  # checkpointing keeps the input
    logits_kept, logits_peak = logits_bytes(m, B, T, act)
    distributed = {}
    if world_size > 1 and not fsdp:
        distributed["DDP gradient buckets"] = P * FP32  # a second copy of the gradients
    if fsdp:
        # FSDP gathers the full weights of a block while it runs and prefetches the next one, in the compute
        # dtype (its MixedPrecisionPolicy: bf16 for a bf16 run); the root (embeddings, final LayerNorm)
        # stays gathered through forward and backward.
        root = P - L * layer_parameter_count(m)
        distributed["FSDP gathered weights"] = (2 * layer_parameter_count(m) + root) * act
    return HeldBytes(
        params=math.ceil(P * FP32 / shards), grads=math.ceil(P * FP32 / shards),
        optimizer=optimizer_state_bytes(cfg, m, shards), copies=copies, block=block, saved_block=saved_block,
        activations=L * saved_block + top_activation_bytes(m, B, T, act),
        logits_kept=logits_kept, logits_peak=logits_peak, distributed=distributed,
        # The optimizer step: fused AdamW works in place; the foreach path makes a temporary per state.
        step_temp=0 if uses_fused_adamw(device_type) else math.ceil(P * FP32 / shards),
        # train.average_last's float32 mean of the weights (training/averaging.py), sharded like them under FSDP.
        average=math.ceil(P * FP32 / shards) if cfg.train.average_last > 0 else 0,
        shards=shards)


def phase_bytes(m: GPTConfig, B: int, T: int, act: int, held: HeldBytes, accumulating: bool) -> dict[str, int]:
    """Bytes alive in each phase of the step: the loss's backward, the blocks' backward, the optimizer step."""
    L = m.n_layer
    base = held.params + held.optimizer + sum(held.distributed.values()) + held.average
    held_grads = held.grads if accumulating else 0
    phases = {"loss backward": base + held.copies + held.activations + held.logits_peak + held_grads}
    # The caller still holds the logits through backward and the optimizer step (the trainer's
    # `_, loss = model(x, y)` keeps them until the next forward).
    held_logits = B * T * m.padded_vocab_size * act if m.loss_chunk <= 0 else 0
    # Backward of block i: the blocks above it have freed their activations and made their gradients; the
    # blocks below still hold theirs; of the top only the token ids are left. Checkpointing rebuilds
    # block i's activations first. Its peak is at the GELU: the gradient arriving from above (C wide) and
    # the GELU's output and input gradients (4C each, its saved output already freed), when of block i's
    # own gradients only the MLP output projection's (4C x C, a third) exists.
    copies_per_layer = (held.copies - m.padded_vocab_size * m.n_embd * act) // L if held.copies else 0
    layer_grads = math.ceil(layer_parameter_count(m) * FP32 / held.shards)
    head_grads = held.grads - L * layer_grads  # embeddings and final LayerNorm
    ids = (2 * B * T + T) * INT64
    recompute = held.block if m.grad_checkpointing else 0
    work = 5 * B * T * m.n_embd * FP32
    # Linear in i, so the peak over the blocks is at one end: two phases stand for all L (a generated
    # n_layer of 2**31 once made a dict of 2**31 phases).
    for i in sorted({L - 1, 0}, reverse=True):
        made = held.grads if accumulating else head_grads + (L - 1 - i) * layer_grads + layer_grads // 3
        phases[f"backward of block {i}"] = (base + (i + 1) * (copies_per_layer + held.saved_block) + ids
                                            + held_logits + recompute + work + made)
    phases["optimizer step"] = base + held.grads + held.step_temp + held_logits
    return phases


def estimate_notes(cfg: Config, B: int, T: int, world_size: int, device_type: str, accumulating: bool) -> list[str]:
    """What a reader of the estimate should know: a shape `train` refuses, accumulation, torch.compile."""
    notes = []
    compiled = resolve_compile(cfg.train.compile, device_type)
    problem = batch_problem(cfg.train.total_batch_tokens, B, T, world_size)
    if problem:  # the estimate stands, but `train` (and `plan`) refuse this shape
        notes.append(f"`train` refuses this on {world_size} rank{'s' if world_size > 1 else ''}: {problem}")
    if accumulating:
        notes.append("gradient accumulation: the gradients are held through every micro-batch's forward and backward")
    if compiled:
        notes.append("torch.compile usually saves fewer activations than eager (it recomputes cheap "
                     "pointwise ops), so this eager estimate is on the high side")
    return notes


def suggest_micro_batch(cfg: Config, budget_bytes: int, world_size: int = 1, *, device_type: str = "cuda",
                        limit: int = 4096) -> int:
    """The largest micro_batch whose estimated peak fits in budget_bytes (0 if not even 1 fits)."""
    def fits(b: int) -> bool:
        return estimate_memory(cfg, world_size, micro_batch=b, device_type=device_type).total_bytes <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def accumulation_for(cfg: Config, micro_batch: int, world_size: int = 1) -> tuple[int, int]:
    """(micro_batch, accumulation steps) reaching train.total_batch_tokens exactly.

    The micro-batch is lowered, if needed, to the largest one that divides the target evenly.
    """
    T = cfg.train.seq_len or cfg.model.block_size
    target = cfg.train.total_batch_tokens
    if target <= 0:
        return micro_batch, 1
    for b in range(micro_batch, 0, -1):
        if target % (b * T * world_size) == 0:
            return b, target // (b * T * world_size)
    raise ValueError(f"train.total_batch_tokens = {target} is not a multiple of seq_len x world size = "
                     f"{T * world_size}; pick a multiple of it")
