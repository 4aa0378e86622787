# Two entry points for a fresh machine: `make demo` and `make test`.
# torch==2.13.0 is installed first and alone (the CPU wheel); everything else is
# installed with torch pinned so that no resolver pulls a CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= $(abspath ../shared/data)

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/attnlab demo

test: $(STAMP)
	ATTNLAB_DATA_DIR=$${ATTNLAB_DATA_DIR:-$(DATA)} $(PY) -m pytest -q

test-all: $(STAMP)
	ATTNLAB_DATA_DIR=$${ATTNLAB_DATA_DIR:-$(DATA)} $(PY) -m pytest -q -m "slow or not slow"

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
