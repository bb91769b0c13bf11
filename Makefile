# The two commands a newcomer runs on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs exactly what it needs (pinned by constraints.txt).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
# llama-cpp-python builds llama.cpp from source: portable CPU build, no tests or examples
# (about 8 minutes on 2 cores the first time; pip's wheel cache makes later installs fast).
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
# Numba keeps compiled kernels in its default place (__pycache__ beside the sources), the same one a
# direct `.venv/bin/moe-replay` call uses: `make demo` leaves the next command fast.

DEMO_TRACE := $(VENV)/work/demo-trace
# The synthetic trace has no engine metrics to fit a cost model on: the demo assumes a manual one
# (phone-class flash, roughly what the real Qwen run implies) and its report says it is an assumption.
DEMO_COST  := --flash-mib-s 2400 --compute-ms 110

.PHONY: demo test lint bench clean chromium screenshots

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip

# The editable install leaves the project's own modules to be byte-compiled on first import, which a
# shell with PYTHONDONTWRITEBYTECODE=1 never keeps (~0.1 s of every run): compiled here once, as pip
# does for an installed package (a changed module is recompiled in memory until the next install).
COMPILE := $(PY) -m compileall -q replay traces engine_bridge >/dev/null

$(VENV)/.core: pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) -e .
	$(COMPILE)
	touch $@

$(VENV)/.dev: pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) -e '.[dev,capture,hf,cluster]'
	$(COMPILE)
	touch $@ $(VENV)/.core

# libCacheSim's binding pulls boto3, whose pins fight constraints.txt: installed unconstrained.
$(VENV)/.bench: pyproject.toml $(VENV)/.dev
	$(PY) -m pip install --disable-pip-version-check -q libcachesim==0.3.5
	touch $@

## demo: synthetic default trace -> report under reports/demo/
demo: $(VENV)/.core
	mkdir -p $(VENV)/work
	$(VENV)/bin/moe-replay synth $(DEMO_TRACE) --force
	$(VENV)/bin/moe-replay report $(DEMO_TRACE) -o reports/demo --force $(DEMO_COST)
	@echo "The report: reports/demo/index.html (or index.md). The CLI: .venv/bin/moe-replay --help (or 'source .venv/bin/activate', then moe-replay)."

# llama.cpp's own convert_hf_to_gguf.py ships in the llama-cpp-python source distribution: the
# cross-engine test (tests/test_compare_engines.py) converts tiny transformers checkpoints with it.
# Downloaded once from PyPI; if that fails the test says so and skips ('-': the rest still runs).
LLAMA_SDIST := $(VENV)/work/llama_cpp_python-0.3.36.tar.gz
$(LLAMA_SDIST): | $(VENV)/bin/python
	mkdir -p $(VENV)/work
	-$(PY) -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: -d $(VENV)/work llama-cpp-python==0.3.36

# Headless Chromium for the report's screenshot tests (tests/test_report_browser.py): installed with
# apt-get when it is missing and we are root. '-': where that is not possible (not root, no apt, no
# network) the rest of the suite still runs and those tests skip, saying why.
chromium:
	-@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "chromium is not installed (needs root and apt-get): the report screenshot tests will skip"

## screenshots: the demo report in headless Chromium at 1400 px -> reports/screenshots/ (first screen, whole page)
screenshots: demo chromium
	$(PY) -m tests.browser reports/demo reports/screenshots

## test: the whole suite (unit, property, end-to-end on ../shared/data, capture through llama.cpp and transformers, Ray, notebooks)
test: $(VENV)/.dev $(LLAMA_SDIST) chromium
	$(VENV)/bin/python -m pytest -q --durations=15

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .

bench: $(VENV)/.bench
	$(VENV)/bin/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The notebooks (notebooks/README.md): JupyterLab installed into .venv on first use.
.PHONY: notebooks notebooks-regen
$(VENV)/.notebooks: pyproject.toml constraints.txt $(VENV)/.core
	$(PIP) -e '.[notebooks]'
	touch $@

## notebooks: install JupyterLab into .venv and open notebooks/ in it (Ctrl-C stops the server)
notebooks: $(VENV)/.notebooks
	@echo "Opening JupyterLab on notebooks/ (later, without make: .venv/bin/jupyter lab notebooks/)."
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

## notebooks-regen: rerun every notebook and rewrite it with its outputs (tests/test_notebooks.py checks they are current)
notebooks-regen: $(VENV)/.notebooks
	$(PY) -m notebooks.regen
