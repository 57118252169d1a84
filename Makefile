# Set-up and the two everyday commands. A fresh machine needs only `make run` or `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test test-slow bench install
run: install
	$(BIN)/python launch.py $(ARGS)

# The suite within its 20 minutes on 2 cores: every test but those marked slow (the long
# learning and end-to-end runs), which `make test-slow` runs.
test: install
	$(BIN)/python -m pytest -m "not slow" $(ARGS)

test-slow: install
	$(BIN)/python -m pytest -m slow $(ARGS)

bench: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.runtime $(ARGS)

install: $(VENV)/.installed

# torch first, pinned: the CPU build that lies on this machine's disk; an unpinned torch
# would pull a several-GB CUDA build. On a GPU machine install your CUDA torch instead.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@
