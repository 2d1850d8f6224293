"""`gpt2train bench generate`: a tiny run writes its table and JSON; the bandwidth arithmetic; honest skips."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import missing, run_cli, run_here
from gpt2train.bench.generate import GenerateOptions, decode_bytes_per_step, run_generate_bench
from gpt2train.devices import find_device
from gpt2train.model import GPT, GPTConfig
from gpt2train.ranges import UsageError

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
ROW_KEYS = {"impl", "batch", "ttft_ms", "decode_tok_s", "bandwidth_gb_s", "bandwidth_util", "ttft_ms_all",
            "decode_tok_s_all", "path"}


def test_a_generate_bench_cut_short_keeps_the_batch_sizes_it_measured(tmp_path, monkeypatch):
    """The JSON was written at the end only: a GPU session's time limit during the last batch size lost all."""
    from gpt2train.bench import generate as bench

    timed = []

    def time_then_stop(model, prompts, new_tokens, decoder):
        timed.append(prompts.shape[0])
        if prompts.shape[0] == 4:
            raise KeyboardInterrupt
        return 0.01, 0.001 * new_tokens

    monkeypatch.setattr(bench, "time_ours", time_then_stop)
    options = GenerateOptions(model="gpt2-tiny", device="cpu", batch_sizes=[1, 2, 4], prompt_tokens=4,
                              new_tokens=6, repeats=1, compare_hf=False)
    with pytest.raises(KeyboardInterrupt):
        run_generate_bench(options, tmp_path / "g.json", progress=False)
    saved = json.loads((tmp_path / "g.json").read_text())
    assert saved["finished"] is False and [r["batch"] for r in saved["rows"]] == [1, 2]
    assert saved["markdown"].endswith("(unfinished: batch sizes were left to measure)")
    monkeypatch.setattr(bench, "time_ours", lambda model, prompts, new_tokens, decoder: (0.01, 0.001 * new_tokens))
    assert run_generate_bench(options, tmp_path / "g.json", progress=False)["finished"] is True
    assert json.loads((tmp_path / "g.json").read_text())["finished"] is True


@pytest.mark.slow
def test_bench_generate_command_writes_json(tmp_path, cpu_kind):
    out = tmp_path / "generate.json"
    result = run_cli("bench", "generate", "--model", "gpt2-tiny", "--device", "cpu", "--batch-sizes", "1,2",
                     "--prompt-tokens", "4", "--new-tokens", "6", "--repeats", "1", "--threads", "1",
                     "--out", str(out), cpu_bf16=cpu_kind)
    assert result.returncode == 0, result.stderr
    blocks = "" if cpu_kind else ", matmuls in row blocks"  # --dtype auto: bf16 where native, else fp32 in blocks
    assert "decode tok/s" in result.stdout and f"decode: eager, KV cache{blocks}, batch 2" in result.stdout
    data = json.loads(out.read_text())
    assert data["dtype"] == ("bfloat16" if cpu_kind else "float32")
    assert {"model", "device", "dtype", "new_tokens", "prompt_tokens", "repeats", "peak_bandwidth_gb_s", "date",
            "torch", "transformers_note", "rows", "speedup_vs_transformers", "markdown"} <= data.keys()
    impls = [(r["impl"], r["batch"]) for r in data["rows"]]
    ours = [("gpt2train", 1), ("gpt2train", 2)]
    if HAS_TRANSFORMERS:
        assert impls == [ours[0], ("transformers", 1), ours[1], ("transformers", 2)]
        assert set(data["speedup_vs_transformers"]) == {"1", "2"}
    else:
        assert impls == ours and "not installed" in data["transformers_note"]
    for row in data["rows"]:
        assert row.keys() == ROW_KEYS
        assert row["decode_tok_s"] > 0 and row["ttft_ms"] > 0
        assert row["bandwidth_util"] is None  # a CPU: no known peak
    assert data["peak_bandwidth_gb_s"] is None


@pytest.mark.parametrize("args, says", [
    (["--model", "gpt3"], "argument --model: invalid choice: 'gpt3' (choose from 'gpt2', "),
    (["--batch-sizes", "1,x"], "'x' is not an integer"),
    (["--batch-sizes", "0"], "0 is out of range"),
    (["--prompt-tokens", "-1"], "-1 is out of range"),
    (["--new-tokens", "0"], "0 is out of range"),
    (["--repeats", "0"], "0 is out of range"),
    (["--threads", "-2"], "-2 is out of range"),
    (["--new-tokens", "200"], "exceed gpt2-tiny's block_size 128"),  # neither model has positions beyond it
    (["--llama-cpp", "--batch-sizes", "2,4"], "--llama-cpp times batch 1"),
])
@pytest.mark.slow
def test_bad_arguments_are_one_usage_line_before_any_work(tmp_path, args, says):
    out = tmp_path / "generate.json"
    r = run_here("bench", "generate", "--model", "gpt2-tiny", "--device", "cpu", "--no-hf", *args, "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("error:") and says in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_the_options_check_only_how_they_go_together():
    """Each option's own range is checked once, by its argparse type (the cases above); GenerateOptions checks
    what no single type can see, on construction, for the library's callers too."""
    with pytest.raises(UsageError, match="--prompt-tokens 100 \\+ --new-tokens 100 exceed gpt2-tiny's block_size 128"):
        GenerateOptions(model="gpt2-tiny", prompt_tokens=100, new_tokens=100)
    with pytest.raises(UsageError, match="--llama-cpp times batch 1"):
        GenerateOptions(model="gpt2-tiny", batch_sizes=[2], compare_llama_cpp=True)


def test_without_comparison_the_note_says_so(tmp_path):
    options = GenerateOptions(model="gpt2-tiny", device="cpu", batch_sizes=[1], prompt_tokens=2, new_tokens=3,
                              repeats=1, compile=False, compare_hf=False)
    result = run_generate_bench(options, tmp_path / "g.json", progress=False)
    assert [r["impl"] for r in result["rows"]] == ["gpt2train"]
    assert result["speedup_vs_transformers"] == {}
    assert "comparison not asked for" in result["markdown"]


def test_decode_bytes_count_weights_once_and_the_cache_read():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=70)  # padded vocab 128
    model = GPT(cfg)
    weights = (2 * (12 * 32 * 32 + 9 * 32) + 128 * 32) * 4  # fp32 matmul weights and biases, lm_head once
    assert decode_bytes_per_step(model, batch=1, cache_slots=0, element=4) == weights
    assert decode_bytes_per_step(model, batch=3, cache_slots=10, element=4) == weights + 2 * 2 * 3 * 10 * 32 * 4
    assert decode_bytes_per_step(model, batch=3, cache_slots=10, element=2) == (weights + 2 * 2 * 3 * 10 * 32 * 4) / 2


def test_the_bench_takes_a_dtype_for_both_and_one_for_transformers(tmp_path):
    """--dtype sets the weights' dtype of ours and transformers' alike; --hf-dtype transformers' alone."""
    options = GenerateOptions(model="gpt2-tiny", device="cpu", batch_sizes=[1], new_tokens=3, repeats=1,
                              dtype="bfloat16", hf_dtype="float32")
    result = run_generate_bench(options, tmp_path / "g.json", progress=False)
    assert result["dtype"] == "bfloat16" and result["hf_dtype"] == "float32"
    assert "bfloat16 (transformers float32)" in result["markdown"]


def test_gpus_in_the_table_know_their_bandwidth():
    assert find_device("H100").bandwidth == 3.35e12
    assert find_device("cpu").bandwidth is None


@pytest.mark.slow
def test_llama_cpp_decodes_the_same_weights_beside_ours_at_batch_1(tmp_path):
    if importlib.util.find_spec("llama_cpp") is None:
        missing("llama-cpp-python is missing", "`make setup-dev` builds it")
    out = tmp_path / "generate.json"
    r = run_cli("bench", "generate", "--model", "gpt2-tiny", "--device", "cpu", "--batch-sizes", "1,2", "--no-hf",
                "--llama-cpp", "--prompt-tokens", "4", "--new-tokens", "6", "--repeats", "1", "--threads", "1",
                "--dtype", "float32", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert [(row["impl"], row["batch"]) for row in data["rows"]] == [("gpt2train", 1), ("llama.cpp", 1),
                                                                    ("gpt2train", 2)]
    llama_row = data["rows"][1]
    assert llama_row["path"] == "f32 GGUF" and llama_row["decode_tok_s"] > 0 and llama_row["ttft_ms"] > 0
    assert set(data["speedup_vs_llama_cpp"]) == {"1"} and data["llama_cpp_python"] and data["llama_cpp_note"] is None
    assert "gpt2train / llama.cpp decode tok/s at batch 1:" in r.stdout
