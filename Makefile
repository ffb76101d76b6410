# The two commands of the README. Each makes .venv/ when missing and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.nbddp-installed

.PHONY: demo test test-fast test-e2e test-browser test-colab bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0 -e '.[dev]'
	@# pip writes bytecode file by file on one core; compileall writes it on every core (a third of the install
	@# on 2 cores). What does not compile on this Python (torch's test helpers for 3.12) pip skips silently too.
	$(PY) -m compileall -q -j 0 $(VENV)/lib >$(VENV)/compileall.log 2>&1 || true
	$(PY) -m ipykernel install --prefix $(VENV) --name python3 >/dev/null
	@# matplotlib builds its font cache on first import by running fc-list: once here, not inside a fast-lane
	@# test that starts no process (tests/lanes.py would count it), as it did on a fresh machine.
	$(PY) -c 'import matplotlib.font_manager' >/dev/null 2>&1 || true
	touch $@

demo: $(STAMP)  ## train the embedded tiny model on 2 processes (CPU/gloo without GPUs)
	$(VENV)/bin/nbddp run notebooks/quickstart.ipynb --nproc 2

# Two lanes, kept honest by tests/lanes.py: a test that starts a process (torchrun, a kernel, a subprocess
# running nbddp) is marked e2e, one that starts none is not. The fast lane runs first, so a quick failure shows early.
test: test-fast test-e2e  ## the full test suite, as CI runs it

# Bytecode for nbddp written once before the tests: every launch starts Python processes that import it, and
# where PYTHONDONTWRITEBYTECODE is set (as on CI) each would compile it again.
test-fast: $(STAMP)  ## the tests that start no process (a few minutes), on two workers
	$(PY) -m compileall -q src
	$(PY) -m pytest -q -n 2 -m 'not e2e and not browser and not colab'

test-e2e: $(STAMP)  ## the tests that start processes: torchrun on 2 gloo ranks, kernels, the nbddp CLI
	$(PY) -m compileall -q src
	$(PY) -m pytest -q -n 2 --dist loadgroup -m 'e2e and not browser and not colab'

# Chromium comes from the system's packages (never a browser download): installed with apt where this can.
CHROMIUM_HINT := no chromium: install your system's package (Debian/Ubuntu: apt-get install -y chromium) and run make test-browser again

test-browser: $(STAMP)  ## JupyterLab in headless Chromium: a 2000-step %%ddp_train, a failure, the stop button, a kept job
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } \
		|| { echo "$(CHROMIUM_HINT)"; exit 1; }
	$(PY) -m pip install -q jupyterlab playwright
	$(PY) -m pytest -q -m browser tests/browser

test-colab: $(STAMP)  ## %%ddp_train in a kernel on Colab's IPython 7.34 (installed aside in build/ipython7)
	$(PY) -m pytest -q -m colab tests

bench: $(STAMP)  ## CPU benchmarks; results land in benchmarks/results/
	$(PY) benchmarks/convert_speed.py
	$(PY) benchmarks/cpu_overheads.py

clean:
	rm -rf nbddp_runs .pytest_cache
