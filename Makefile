# `make train` and `make test` are the two commands a new user runs; both set up .venv first.
# `make check` is the fast loop for a fork: lint, a 2-step pulse of every config, verify of every
# experiment, and the experiment contract (a few minutes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TENSORBOARD_STAMP := $(VENV)/.installed-tensorboard
LOGDIR ?= runs

.PHONY: setup train test check test-slurm lint tensorboard clean

setup: $(STAMP)

# Re-installs only when the pins change. A venv left half-made (no pip: its creation was interrupted)
# is made again.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) main.py --config=configs/smoke_cpu.py --workdir=runs/smoke --cpu_devices=8

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The whole suite, tests/test_slurm.py included; pyproject's `-ra` lists every skip with its reason.
test: lint
	$(PY) -m pytest -q

check: lint
	$(PY) -m pytest -q tests/test_configs.py tests/test_experiment_contract.py

# launch/slurm/train.sbatch on a real single-node SLURM (apt-get installs it when run as root).
# Where SLURM cannot run the tests are skipped, and -rs prints why.
test-slurm: $(STAMP)
	$(PY) -m pytest -q -rs tests/test_slurm.py

# The TensorBoard viewer (the `tensorboard` extra, installed on first use; CI never installs it) on
# every run under LOGDIR: `make tensorboard LOGDIR=runs/smoke`, then open http://localhost:6006.
$(TENSORBOARD_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt '.[dev,tensorboard]'
	touch $(TENSORBOARD_STAMP)

tensorboard: $(TENSORBOARD_STAMP)
	$(VENV)/bin/tensorboard --logdir "$(LOGDIR)"

clean:
	rm -rf runs build *.egg-info
