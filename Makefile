# The two commands of the README. Each makes .venv/ when missing and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.nbddp-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m ipykernel install --prefix $(VENV) --name python3 >/dev/null
	touch $@

demo: $(STAMP)  ## train the embedded tiny model on 2 processes (CPU/gloo without GPUs)
	$(VENV)/bin/nbddp run notebooks/quickstart.ipynb --nproc 2

test: $(STAMP)  ## the full test suite, as CI runs it
	$(PY) -m pytest -q

bench: $(STAMP)  ## CPU benchmarks; results land in benchmarks/results/
	$(PY) benchmarks/convert_speed.py
	$(PY) benchmarks/cpu_overheads.py

clean:
	rm -rf nbddp_runs .pytest_cache
