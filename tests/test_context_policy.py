"""The one context policy, as docs/model.md ("Past the context") states it: the statement is in one place, the
other docs point to it, and what it says the exports do at the limit is what llama.cpp and transformers do.
(Each of our surfaces has its own test, named there: sample, the engine, the API through the openai package,
the playground in Chromium.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, missing
from gpt2train.model import GPT, GPTConfig

CONTEXT = 32
SECTION = "\n## Past the context\n"


def policy() -> str:
    """docs/model.md's section on the context, up to the next section."""
    doc = (REPO / "docs" / "model.md").read_text()
    assert doc.count(SECTION) == 1
    return doc.split(SECTION, 1)[1].split("\n## ", 1)[0]


def row(surface: str) -> str:
    """The policy table's row for a surface (its first cell names it)."""
    rows = [line for line in policy().splitlines() if line.startswith("| ") and surface in line.split(" | ")[0]]
    assert len(rows) == 1, f"no single row for {surface!r}"
    return rows[0]


def test_the_policy_is_said_once_and_the_other_docs_point_to_it():
    for surface in ("gpt2train sample", "the API", "the playground", "llama.cpp", "transformers"):
        row(surface)
    assert row("the API").count("the window slides") == 1 and "prompt_tokens_cropped" in row("the API")
    for doc in ("README.md", "docs/serving.md", "docs/export.md"):
        assert "model.md#past-the-context" in (REPO / doc).read_text(), doc
    for doc in ("README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))):
        text = (REPO / doc).read_text()
        assert doc == "docs/model.md" or SECTION not in text, f"{doc} states the policy a second time"


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=CONTEXT, vocab_size=50257)).eval()


LLAMA = """
import sys
from llama_cpp import Llama
prompt, new = int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=sys.argv[1], n_ctx={context}, n_threads=2, seed=0, verbose=False)
done = llm.create_completion([13] * prompt, max_tokens=new, temperature=0)
print(done["usage"]["completion_tokens"])
"""


@pytest.mark.slow
def test_llama_cpp_aborts_past_the_context_as_the_policy_says(tmp_path):
    """In a process of its own: llama.cpp's assertion aborts the process, pytest's with it."""
    pytest.importorskip("gguf")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        missing("llama-cpp-python (it compiles llama.cpp) is missing")
    from gpt2train.gguf_export import export_gguf

    export_gguf(tiny_gpt(), tmp_path / "m.gguf", {"kind": "gpt2"})
    said = re.search(r"`(GGML_ASSERT\([^`]*\) failed)`", row("llama.cpp")).group(1)

    def run(prompt: int, new: int) -> subprocess.CompletedProcess:
        code = LLAMA.format(context=CONTEXT)
        # No backtrace after the assertion's message: ggml forks a child to attach gdb, and where gdb is installed
        # the two once waited on each other for good (the suite hung here, 2026-11-29).
        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
        return subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.gguf"), str(prompt), str(new)],
                              capture_output=True, text=True, timeout=120, env=env)

    within = run(5, CONTEXT - 5)
    assert within.returncode == 0 and within.stdout.split() == [str(CONTEXT - 5)], within.stderr[-2000:]
    for prompt, new in ((5, CONTEXT), (CONTEXT + 8, 1)):  # generation past the context; a prompt longer than it
        past = run(prompt, new)
        assert past.returncode == -6 and said in past.stderr, (prompt, new, past.returncode, past.stderr[-2000:])


def test_transformers_raises_past_the_context_as_the_policy_says(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from gpt2train.hf import export_hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    export_hf(tiny_gpt(), tmp_path, tokenizer_spec={"kind": "gpt2"})
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True).eval()
    said = re.search(r"`(IndexError: [^`]*)`", row("transformers")).group(1)

    def generate(prompt: int, new: int) -> torch.Tensor:
        with torch.no_grad():
            return hf.generate(torch.full((1, prompt), 13), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=50256)

    assert generate(5, CONTEXT - 5).size(1) == CONTEXT
    # The last new token is never fed back: a position past the context is first read one token later.
    for prompt, new in ((5, CONTEXT - 3), (CONTEXT + 8, 1)):
        with pytest.raises(IndexError) as e:
            generate(prompt, new)
        assert f"IndexError: {e.value}" == said
