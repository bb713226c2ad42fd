# `make train` and `make test` are the two commands a new user runs; both set up .venv first.
# `make check` is the fast loop for a fork: lint, a 2-step pulse of every config, verify of every
# experiment, and the experiment contract (a few minutes).
# The Python that makes .venv: PYTHON=... if given, else the first 3.12+ that launch/find_python.sh finds.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TEST_STAMP := $(VENV)/.installed-test
TENSORBOARD_STAMP := $(VENV)/.installed-tensorboard
LOGDIR ?= runs

.PHONY: setup train test check docs test-slurm lint tensorboard clean FORCE

setup: $(STAMP)

# Re-installs only when the pins change, or when .venv's Python cannot serve: one older than 3.12
# (made before the move to jax 0.12), or a venv left half-made (no pip: its creation was interrupted).
VENV_USABLE := $(shell $(PY) -c 'import sys, pip; print(sys.version_info >= (3, 12))' 2>/dev/null)
$(STAMP): pyproject.toml constraints.txt $(if $(filter True,$(VENV_USABLE)),,FORCE)
	@if [ "$(VENV_USABLE)" != True ]; then \
	  python=$$(launch/find_python.sh) || exit 1; \
	  echo "making $(VENV) with $$python ($$($$python --version))"; \
	  $$python -m venv --clear $(VENV) || exit 1; \
	fi
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt .
	touch $(STAMP)

# What lint and `make check` add: pytest, ruff and the tests' small helpers (the `dev` extra).
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt '.[dev]'
	touch $(DEV_STAMP)

# What the whole suite adds: torch, transformers and lm-eval-harness, for the parity tests only (the
# `parity` extra; README says what it costs). Training never imports them.
$(TEST_STAMP): $(DEV_STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt '.[dev,parity]'
	touch $(TEST_STAMP)

train: $(STAMP)
	$(PY) main.py --config=configs/smoke_cpu.py --workdir=runs/smoke --cpu_devices=8

lint: $(DEV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The whole suite, tests/test_slurm.py included; pyproject's `-ra` lists every skip with its reason.
# TEST_WORKERS pytest-xdist workers, each taking whole test files (their module fixtures run once):
# many tests wait on the processes they start, so 2 keep 2 cores busy (1: one process, no xdist).
TEST_WORKERS ?= 2
test: lint $(TEST_STAMP)
	$(PY) -m pytest -q $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The docs: the reference pages written from the code (docs/generate.py), then MkDocs with --strict (a
# broken link or page fails) into site/. tests/test_docs.py builds them the same way.
docs: $(DEV_STAMP)
	$(PY) docs/generate.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

check: lint
	$(PY) -m pytest -q tests/test_configs.py tests/test_experiment_contract.py

# launch/slurm/train.sbatch on a real single-node SLURM (apt-get installs it when run as root).
# Where SLURM cannot run the tests are skipped, and -rs prints why.
test-slurm: $(DEV_STAMP)
	$(PY) -m pytest -q -rs tests/test_slurm.py

# The TensorBoard viewer (the `tensorboard` extra, installed on first use; CI never installs it) on
# every run under LOGDIR: `make tensorboard LOGDIR=runs/smoke`, then open http://localhost:6006.
$(TENSORBOARD_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt '.[tensorboard]'
	touch $(TENSORBOARD_STAMP)

tensorboard: $(TENSORBOARD_STAMP)
	$(VENV)/bin/tensorboard --logdir "$(LOGDIR)"

clean:
	rm -rf runs build *.egg-info
