# `make demo`: set up .venv/ (first run ~3 min, later runs skip) and run the main job.
# `make test`: set up .venv/ and run the whole test suite.
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= models/cedar-agent

.PHONY: setup demo test test-kernels clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/cedar demo --model $(MODEL)

test: setup
	$(PY) -m pytest -q -ra tests

test-kernels: setup
	$(PY) -m pytest -q -ra -m kernels tests

clean:
	rm -rf $(VENV) models/ .pytest_cache
