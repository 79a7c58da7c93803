# `make demo`: set up .venv/ (first run ~3 min, later runs skip) and run the main job.
# `make test`: set up .venv/ and run the whole test suite.
# `make peers` (opt-in, never in CI or `make demo`): install vLLM's CPU build and llama.cpp's server
# into .peers/ for `cedar bench engine`.
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= models/cedar-agent

.PHONY: setup demo test test-kernels peers clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m cedar.cli demo --model $(MODEL)

test: setup
	$(PY) -m pytest -q -ra tests

test-kernels: setup
	$(PY) -m pytest -q -ra -m kernels tests

peers:
	@bash scripts/setup_peers.sh

# NOTE: only what setup and the tests build; models/ holds the committed, shipped model and
# whatever `cedar init-model` / `cedar train` wrote there: never removed here.
clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
