# mimotron developer entry points. Every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test files run on this many worker processes (pytest-xdist), a whole file per worker so
# its module fixtures are built once. Two workers keep both cores of a 2-core machine
# busy; a third oversubscribed them (the multi-rank tests fork several ranks each) and
# was no faster (docs/testing.md has the measured figures).
TEST_WORKERS ?= 2

.PHONY: venv demo demo-llava demo-qwen test lint plan docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is installed first and pinned, so the project's `torch>=2.9` never pulls a CUDA build.
$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,tensorboard,wandb]"
	@touch $(STAMP)

venv: $(STAMP)

# The demo always trains from scratch: a previous demo run is moved aside, not lost
# (runs/digits/previous-<time>/), instead of being refused as a silent clobber.
demo: $(STAMP)
	$(VENV)/bin/mimotron train configs/digits.toml train.overwrite=true
	$(VENV)/bin/mimotron plot runs/digits

# The same task on the real path: LLaVA JSONL + PNG + WAV, Hugging Face model folders and
# a BPE tokenizer written under runs/digits_llava/assets (kept once complete), then
# trained as a user with real checkpoints would (configs/digits_llava.toml). Always from
# scratch: checkpoint.load=none, and the previous run is moved aside as for `demo`.
demo-llava: $(STAMP)
	$(PY) -m mimotron.demo.llava_assets runs/digits_llava/assets
	$(VENV)/bin/mimotron train configs/digits_llava.toml train.overwrite=true checkpoint.load=none
	$(VENV)/bin/mimotron plot runs/digits_llava

# One tiny Qwen2.5-VL folder (random weights, made locally) trained on digits of several
# sizes at native resolution (configs/digits_qwen.toml); from scratch as above.
demo-qwen: $(STAMP)
	$(PY) -m mimotron.demo.qwen_assets runs/digits_qwen/assets
	$(VENV)/bin/mimotron train configs/digits_qwen.toml train.overwrite=true checkpoint.load=none
	$(VENV)/bin/mimotron plot runs/digits_qwen

# Bytecode is compiled once and kept, even where PYTHONDONTWRITEBYTECODE is set (as in some
# containers): the suite starts a few hundred Python processes (launched ranks, spawned
# dry runs), each of which would otherwise compile every mimotron module it imports.
test: $(STAMP)
	$(PY) -m compileall -q mimotron tests benchmarks > /dev/null
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

plan: $(STAMP)
	$(VENV)/bin/mimotron plan configs/digits.toml

# docs/configuration.md's configuration table, generated from the config dataclasses' field docstrings.
docs: $(STAMP)
	$(PY) -m mimotron.config.docs docs/configuration.md

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
