# The README's two commands: `make demo` and `make test`. Each creates .venv on first use.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
export PYTHONUNBUFFERED := 1
# Python keeps the .pyc of what it compiles (empty, as unset: Python writes them when the variable is empty).
# Machines that set PYTHONDONTWRITEBYTECODE=1 (these do) made every process compile nightloom's own modules again
# (~0.26 CPU-s a training rank, ~117 modules) and pytest rewrite every test module again in each worker (collecting
# tests/unit: 25 against 17.5 CPU-s with its cache). The library's .pyc come from `make venv` (below).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: demo test test-fast venv clean bench ui

# Rebuilt when the pins or this recipe change (an older venv then gets what the recipe now does, e.g. the .pyc).
# torch (and the uv installer) through pip, so pip's own config (find-links, index) picks the torch wheel;
# then uv installs the ~150 pinned dependencies in seconds (pip took ~3 min). Then all of site-packages is
# byte-compiled (~15-60 s on 2 cores): uv's --compile-bytecode compiles only what uv installed, so torch and its
# dependencies (sympy, networkx, ...) had no .pyc, and with PYTHONDONTWRITEBYTECODE=1 (common on CI machines and
# in images; set on these) Python never writes one: every process (each rank of each run) compiled them again on
# import, 3.6 instead of 1.75 CPU-s for `import torch`, and CI ran at half speed. A few files hold 3.12-only
# syntax (torch's py312_intrinsics.py) and can never compile under 3.11, hence `|| true`.
# (These notes sit above the rule: a comment inside a recipe is a shell line, and make echoes it.)
$(STAMP): pyproject.toml Makefile
	@echo "installing $(VENV) (torch, the pinned dependencies, byte-compiled; a few minutes on first use) ..."
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	@$(VENV)/bin/pip install -q --no-compile uv==0.13.9 torch==2.13.0
	@$(VENV)/bin/uv pip install -q --python $(VENV)/bin/python -e '.[dev]'
	@$(VENV)/bin/python -m compileall -qq -j 0 "$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	@$(VENV)/bin/nightloom run deployments/local-demo.yaml

# The Prefect UI on http://127.0.0.1:$(PORT): server, work pool, deployments and a worker; Ctrl-C stops them.
# `make ui PORT=4201` when 4200 is taken. Set here, not with ?=, so that a PORT in the environment is not taken.
PORT = 4200
ui: $(STAMP)
	@$(VENV)/bin/nightloom ui --port $(PORT)

# One pytest, three workers, one lane each (tests/conftest.py, pytest_xdist_make_scheduler): the tests that start only
# their own processes (tests/distributed, most of tests/xtuner); the unit tests and the in-process flows on local
# clusters (their own Prefect server in CI); and everything that shares the real services (the shared Prefect server
# and its worker, sshd, Slurm, the default rendezvous port), which keeps its serial order. Two lanes after a separate
# unit run used 1.05 of 2 cores (real-time windows, polling, start-ups); the third lane fills the idle core.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 3 --dist loadgroup tests

# The fast lane while editing: the unit tests but those marked slow (a process or a server started, a catalog swept;
# `make test` runs them), 100-117 s on 2 cores here (all of tests/unit: 196 s); `make test` before a commit.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 -m "not slow" tests/unit

bench: $(STAMP)
	for b in bench/*.py; do $(VENV)/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .nightloom
