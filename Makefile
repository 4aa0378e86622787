# Two entry points for a fresh machine: `make demo` and `make test`.
# torch is installed first and alone, at the release constraints.txt names (the newest tested); everything
# else is installed under the same constraints, so that no resolver replaces it. attnlab itself needs
# torch >= TORCH_OLDEST (pyproject.toml); `make test-oldest` runs the numerical tests on that release.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_OLDEST := 2.8.0
OLDEST := .venv-oldest
# Data-dependent tests read $ATTNLAB_DATA_DIR (a folder of your own with tinyshakespeare/ and multi30k/);
# unset, recipes download into ~/.cache/attnlab and tests without the data skip, saying why.
AVX2   := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

.PHONY: setup setup-notebook notebooks demo test test-avx2 test-sanitize test-oldest test-tutorials test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	# attnlab's C++ kernels, built once (without a compiler: PyTorch's kernels, said here); -W: runpy's warning that
	# the package's own import already loaded the module (harmless: the library is loaded once either way)
	$(PY) -W ignore::RuntimeWarning:runpy -m attnlab._native
	# the bytecode pip writes for a regular install (an editable one has none): ~0.1 s of every command
	$(PY) -m compileall -q src
	touch $(STAMP)

# JupyterLab and ipywidgets (tqdm's progress bars as widgets) for the tutorials: `.venv/bin/jupyter lab docs/tutorials/`
setup-notebook: $(VENV)/.notebook

$(VENV)/.notebook: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,notebook]"
	touch $(VENV)/.notebook

# docs/tutorials/*.ipynb written from their .py with every output, by running each in a fresh kernel from the current
# code at the tests' tiny sizes (a few minutes); commit them after a tutorial or what it shows changes
notebooks: $(VENV)/.notebook
	$(PY) docs/tutorials/execute.py

demo: $(STAMP)
	$(VENV)/bin/attnlab demo

test: $(STAMP)
	$(PY) -m pytest -q

# the same suite as an AVX2-only CPU (no AVX-512, no native bf16) computes it: other kernels, other
# rounding, and dtype="auto" choosing fp32
# the numerical and dtype-choice tests only: what an ISA changes (kernels, rounding, auto's choice); the
# command-line, run-safety, browser and data tests do not depend on it and ran in `make test`
NUMERICS := tests/functional tests/backends tests/modules tests/nn tests/models tests/adapt tests/evaluation \
            tests/experiments tests/test_capability.py tests/test_runtime.py tests/test_generation.py tests/test_native.py \
            tests/test_native_decode.py tests/test_native_flash.py tests/test_native_train.py \
            tests/test_native_fuzz.py tests/training/test_recipe_dtype.py tests/training/test_losses.py tests/training/test_trainer.py
test-avx2: $(STAMP)
	$(AVX2) $(PY) -m pytest -q $(NUMERICS)

# the C++ kernels built with AddressSanitizer and UBSan (a build of their own: the flags key its folder), every
# report fatal, under their tests and the fuzz test; python is not instrumented, so ASan's runtime is preloaded
# (with libstdc++, whose exceptions ASan must intercept from the start)
SANITIZE := ATTNLAB_NATIVE_SANITIZE=address,undefined ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
            LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)"
test-sanitize: $(STAMP)
	$(SANITIZE) $(PY) -m attnlab._native --require
	$(SANITIZE) $(PY) -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_native_decode.py \
	    tests/test_native_flash.py tests/test_native_train.py tests/test_native_fuzz.py

# the numerical tests on the oldest torch attnlab supports, in a venv of its own: that torch first and alone
# (PyPI's Linux build carries CUDA's libraries: ~3 GB to fetch), then attnlab with it held
$(OLDEST)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python -m pip install --quiet torch==$(TORCH_OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet torch==$(TORCH_OLDEST) -e ".[dev]"
	$(OLDEST)/bin/python -W ignore::RuntimeWarning:runpy -m attnlab._native
	touch $@

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest -q $(NUMERICS)

# every notebook in docs/tutorials/, executed top to bottom at tiny sizes in a fresh kernel
test-tutorials: $(STAMP)
	$(PY) -m pytest -q -m tutorial tests/docs

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow or tutorial"

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) $(OLDEST) build *.egg-info src/*.egg-info
