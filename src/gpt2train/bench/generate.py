"""Generation speed: time to first token, decode tokens/s and memory-bandwidth use, against transformers.

For each batch size, our `generate_ids` (KV cache, batched, the decode step compiled or not) and
transformers' `GPT2LMHeadModel.generate` run one after the other on the same weights (random, of a preset's
shape; exported with hf.export_hf and loaded offline), greedy, with `new_tokens` new tokens after a prompt
of `prompt_tokens` random ids. Repeats alternate the two; the median of the repeats is reported.

- time to first token: the prompt's forward (the prefill) and the first token's choice.
- decode tokens/s: the tokens after the first, over the time after the first (all rows counted).
- bandwidth: a decode step must read every weight once, and the keys and values its attention reads
  (the tokens so far; ours compiled, the whole preallocated cache); bytes per step x steps per
  second, against the device's peak bandwidth (devices.py; unknown for a CPU).

Without transformers installed, our rows alone are measured and the comparison says why it is missing.
With `compare_llama_cpp`, llama.cpp (through llama-cpp-python) decodes the same weights from an f32 GGUF file
(gguf_export.py) at batch 1, the one sequence its Python binding runs, alternating with ours the same way.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gpt2train.counting import kv_cache_elements, matmul_parameter_count
from gpt2train.devices import describe
from gpt2train.distributed import resolve_device
from gpt2train.files import write_json_atomic
from gpt2train.generation import Decoder, generate_ids
from gpt2train.gguf_export import export_gguf
from gpt2train.hf import export_hf
from gpt2train.model import GPT, preset_config
from gpt2train.ranges import UsageError
from gpt2train.runtime import resolve_dtype
from gpt2train.units import format_utc


@dataclass
class GenerateOptions:
    model: str = "gpt2"
    device: str = "auto"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    prompt_tokens: int = 8
    new_tokens: int = 256
    repeats: int = 2
    compile: bool | str = "auto"
    compare_hf: bool = True
    threads: int = 0  # CPU threads for torch (0: torch's choice)
    dtype: str = "auto"  # the weights' dtype, ours and transformers' (auto: as `sample`, runtime.resolve_dtype)
    hf_dtype: str = ""  # transformers' alone ("": the same as ours)
    compare_llama_cpp: bool = False  # llama.cpp on the same weights (an f32 GGUF file), batch 1

    def __post_init__(self):
        """UsageError, in one line, before any work, for what one option's argparse type cannot see: how the
        options go together. Each option's own range is checked once, by its type in cli/bench.py."""
        if self.compare_llama_cpp and 1 not in self.batch_sizes:
            raise UsageError("--llama-cpp times batch 1 (llama-cpp-python decodes one sequence): add 1 to --batch-sizes")
        check_context(self.model, self.prompt_tokens, self.new_tokens)


@dataclass
class Row:
    impl: str  # "gpt2train", "transformers" or "llama.cpp"
    batch: int
    ttft_ms: float  # median over repeats
    decode_tok_s: float
    bandwidth_gb_s: float
    bandwidth_util: float | None  # of the device's peak; None where the peak is unknown
    ttft_ms_all: list[float]
    decode_tok_s_all: list[float]
    path: str = ""  # how ours decoded ("decode: eager, KV cache, batch 8")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ours(model: GPT, prompts: torch.Tensor, new_tokens: int, decoder: Decoder) -> tuple[float, float]:
    """(seconds to the first token, seconds for the rest) of one greedy generation."""
    device = prompts.device
    sync(device)
    start = time.perf_counter()
    steps = generate_ids(model, prompts.tolist(), new_tokens, temperature=0, decoder=decoder)
    next(steps)
    sync(device)
    first = time.perf_counter()
    for _ in steps:
        pass
    sync(device)
    return first - start, time.perf_counter() - first


def time_hf(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """The same for transformers' generate: the first token is timed apart (a generate of one token)."""
    device = prompts.device
    kwargs = dict(attention_mask=torch.ones_like(prompts), do_sample=False, pad_token_id=0, eos_token_id=None)
    sync(device)
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kwargs)
    sync(device)
    first = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    sync(device)
    assert out.size(1) == prompts.size(1) + new_tokens
    return first, time.perf_counter() - start - first


def time_llama_cpp(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """The same for llama.cpp: one greedy generation of a sequence, its prompt evaluated afresh."""
    llm.reset()  # else the binding reuses the cached prompt and skips the prefill
    start = time.perf_counter()
    steps = llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True)
    next(steps)
    first = time.perf_counter()
    for _ in range(new_tokens - 1):
        next(steps)
    return first - start, time.perf_counter() - first


def decode_bytes_per_step(model: GPT, batch: int, cache_slots: float, element: int) -> float:
    """Bytes a decode step reads at least: each matmul weight once, plus `cache_slots` keys and values per
    row and layer, `element` bytes each."""
    cfg = model.config
    weights = matmul_parameter_count(cfg) * element
    kv = kv_cache_elements(cfg, batch, cache_slots) * element
    return weights + kv


def load_hf_copy(model: GPT, device: torch.device, dtype: torch.dtype = torch.float32):
    """transformers' GPT2LMHeadModel with our weights, built offline; (model, None) or (None, why not)."""
    try:
        import transformers
        from transformers import GPT2LMHeadModel
    except ImportError:
        return None, "transformers is not installed (pip install transformers): no comparison"
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        export_hf(model, folder)
        hf = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True)
    return hf.to(device=device, dtype=dtype).eval(), None


def load_llama_cpp_copy(model: GPT, n_ctx: int, device: torch.device):
    """llama.cpp's model of our weights, read into memory from an f32 GGUF file; (model, None) or (None, why not)."""
    if device.type != "cpu":
        return None, "llama.cpp is timed on the CPU only (its binding here is a CPU build): no llama.cpp row"
    try:
        import llama_cpp
    except ImportError:
        return None, "llama-cpp-python is not installed (`make setup-dev` builds it): no llama.cpp row"
    with tempfile.TemporaryDirectory() as folder:
        path = export_gguf(model, Path(folder) / "model.gguf", {"kind": "gpt2"})
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=torch.get_num_threads(), use_mmap=False,
                              seed=0, verbose=False)
    return llm, None


def check_context(model: str, prompt_tokens: int, new_tokens: int) -> None:
    """UsageError unless a prompt and its new tokens fit the preset's positions (neither our model nor
    transformers' has any beyond block_size). `bench generate` and `bench serve` both check this."""
    block = preset_config(model).block_size
    if prompt_tokens + new_tokens > block:
        raise UsageError(f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} exceed {model}'s block_size "
                         f"{block}")


def run_generate_bench(options: GenerateOptions, out: Path | None = None, progress: bool = True) -> dict:
    if options.threads:
        torch.set_num_threads(options.threads)
    device = resolve_device(options.device)
    torch.manual_seed(0)
    model = GPT(preset_config(options.model)).to(device).eval()  # random weights: the same cost as trained ones
    dtype = resolve_dtype(options.dtype, device.type)
    hf_dtype = resolve_dtype(options.hf_dtype, device.type) if options.hf_dtype else dtype
    hf, hf_note = load_hf_copy(model, device, hf_dtype) if options.compare_hf else (None, "comparison not asked for")
    llm, llama_note = (load_llama_cpp_copy(model, options.prompt_tokens + options.new_tokens, device)
                       if options.compare_llama_cpp else (None, None))
    model.to(dtype)
    peak = describe(device).bandwidth
    cfg = model.config
    rows: list[Row] = []
    for i, batch in enumerate(options.batch_sizes):
        prompts = torch.randint(0, cfg.vocab_size, (batch, options.prompt_tokens), device=device)
        decoder = Decoder(model, options.compile)
        time_ours(model, prompts, 4, decoder)  # warm up: compilation, allocator, oneDNN's kernel choice
        llama = llm if batch == 1 else None
        if hf is not None:
            time_hf(hf, prompts, 4)
        if llama is not None:
            time_llama_cpp(llama, prompts[0].tolist(), 4)
        ours, theirs, llamas = [], [], []
        for _ in range(options.repeats):  # alternate, so that a busy moment of the machine hits each
            ours.append(time_ours(model, prompts, options.new_tokens, decoder))
            if hf is not None:
                theirs.append(time_hf(hf, prompts, options.new_tokens))
            if llama is not None:
                llamas.append(time_llama_cpp(llama, prompts[0].tolist(), options.new_tokens))
        slots = decoder.cache_size(min(cfg.block_size, options.prompt_tokens + options.new_tokens - 1))
        mean_context = options.prompt_tokens + options.new_tokens / 2
        ours_reads = slots if decoder.compiled is not None else mean_context  # an eager step reads the used slots
        rows.append(summarize("gpt2train", batch, ours, options, model, ours_reads, peak, decoder.describe(batch),
                              dtype.itemsize))
        first_row = len(rows) - 1
        if theirs:
            rows.append(summarize("transformers", batch, theirs, options, model, mean_context, peak,
                                  element=hf_dtype.itemsize))
        if llamas:
            rows.append(summarize("llama.cpp", batch, llamas, options, model, mean_context, peak, "f32 GGUF", 4))
        if progress:
            for row in rows[first_row:]:
                print(f"  batch {batch}: {row.impl} {row.decode_tok_s:,.1f} tok/s", flush=True)
        if i < len(options.batch_sizes) - 1:  # a bench cut short (a GPU session's time limit) keeps these rows
            write_result(result_of(rows, options, device, dtype, hf_dtype, peak, hf_note, llama_note, False), out)
    result = result_of(rows, options, device, dtype, hf_dtype, peak, hf_note, llama_note, True)
    write_result(result, out)
    return result


def result_of(rows: list[Row], options: GenerateOptions, device: torch.device, dtype, hf_dtype, peak,
              hf_note: str, llama_note: str | None, finished: bool) -> dict:
    """The bench's result over the rows measured so far; `finished` False while batch sizes are left."""
    result = {
        "model": options.model,
        "device": describe(device).name if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})",
        "dtype": str(dtype).removeprefix("torch."),
        "hf_dtype": str(hf_dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": options.new_tokens,
        "repeats": options.repeats,
        "peak_bandwidth_gb_s": peak / 1e9 if peak else None,
        "date": format_utc(time.time()),
        "torch": torch.__version__,
        "transformers_note": hf_note,
        "llama_cpp_note": llama_note,
        "llama_cpp_python": version_of("llama_cpp_python") if options.compare_llama_cpp else None,
        "rows": [asdict(r) for r in rows],
        "speedup_vs_transformers": speedups(rows),
        "speedup_vs_llama_cpp": speedups(rows, "llama.cpp"),
        "finished": finished,
    }
    result["markdown"] = markdown(result) + ("" if finished else "\n(unfinished: batch sizes were left to measure)")
    return result


def version_of(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def write_result(result: dict, out: str | Path | None) -> None:
    """A bench's result as JSON at `out` (its folder made), when one is given."""
    if out is not None:
        write_json_atomic(out, result)


def summarize(impl: str, batch: int, timings: list[tuple[float, float]], options: GenerateOptions, model: GPT,
              cache_slots: float, peak: float | None, path: str = "", element: int = 4) -> Row:
    ttfts = [first * 1e3 for first, _ in timings]
    rates = [batch * (options.new_tokens - 1) / rest for _, rest in timings]
    rate = statistics.median(rates)
    bandwidth = decode_bytes_per_step(model, batch, cache_slots, element) * rate / batch
    return Row(impl, batch, statistics.median(ttfts), rate, bandwidth / 1e9, bandwidth / peak if peak else None,
               ttfts, rates, path)


def speedups(rows: list[Row], other: str = "transformers") -> dict[str, float]:
    """Our decode tokens/s over the other implementation's, by batch size."""
    theirs = {r.batch: r.decode_tok_s for r in rows if r.impl == other}
    return {str(r.batch): r.decode_tok_s / theirs[r.batch] for r in rows if r.impl == "gpt2train" and r.batch in theirs}


def markdown(result: dict) -> str:
    dtypes = result["dtype"] + (f" (transformers {result['hf_dtype']})" if result["hf_dtype"] != result["dtype"] else "")
    lines = [f"{result['model']} on {result['device']}, {dtypes}, {result['threads']} threads: "
             f"{result['new_tokens']} new tokens after {result['prompt_tokens']}, greedy, median of "
             f"{result['repeats']}",
             "",
             "| impl | batch | first token (ms) | decode tok/s | bandwidth GB/s | of peak | vs transformers |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        util = f"{r['bandwidth_util']:.0%}" if r["bandwidth_util"] is not None else "unknown"
        ratio = result["speedup_vs_transformers"].get(str(r["batch"])) if r["impl"] == "gpt2train" else None
        lines.append(f"| {r['impl']} | {r['batch']} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:,.1f} | "
                     f"{r['bandwidth_gb_s']:.1f} | {util} | {f'{ratio:.2f}x' if ratio else ''} |")
    paths = sorted({r["path"] for r in result["rows"] if r["path"]})
    lines += [""] + paths
    if result["transformers_note"]:
        lines.append(result["transformers_note"])
    for batch, ratio in result["speedup_vs_llama_cpp"].items():
        lines.append(f"gpt2train / llama.cpp decode tok/s at batch {batch}: {ratio:.2f}x "
                     f"(llama-cpp-python {result['llama_cpp_python']}, an f32 GGUF file)")
    if result["llama_cpp_note"]:
        lines.append(result["llama_cpp_note"])
    return "\n".join(lines)
