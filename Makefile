# Two commands: `make demo` and `make test`. Each creates .venv on first use and installs the project.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)
# Everything pip and venv print goes here; the terminal gets one line per phase.
INSTALL_LOG := .rollback/install.log

# Quiet, offline Prefect with its home inside the work dir (see ../shared/FACTS.md).
export PREFECT_HOME := $(CURDIR)/.rollback/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_UI_ENABLED := false
export PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS := false
export PREFECT_LOGGING_LEVEL := WARNING
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 180
export GIT_PYTHON_REFRESH := quiet
# Prefect's first-run "collects anonymous usage data" notice is client-side: only DO_NOT_TRACK (or a CI
# environment) turns it off; PREFECT_SERVER_ANALYTICS_ENABLED is the server's. MLflow honours it too.
export DO_NOT_TRACK := true

.PHONY: demo test test-fast lint venv clean bench

venv: $(STAMP)

# `logged CMD...` runs a setup step into the log; on failure it shows the log's end and stops make.
$(STAMP):
	@command -v $(PY) >/dev/null || { echo "setup: need $(PY) on PATH (or: make PY=/path/to/python3.11)"; exit 1; }
	@mkdir -p $(dir $(INSTALL_LOG)) && : >$(INSTALL_LOG)
	@logged() { \
	    echo "\$$ $$*" >>$(INSTALL_LOG); \
	    "$$@" >>$(INSTALL_LOG) 2>&1 && return; \
	    echo "setup: failed: $$*"; echo "setup: the end of $(INSTALL_LOG):"; tail -n 25 $(INSTALL_LOG) | sed 's/^/    /'; \
	    exit 1; \
	}; \
	start=$$SECONDS; \
	if ! test -x $(BIN)/python; then echo "setup: creating $(VENV) with $(PY)"; logged $(PY) -m venv $(VENV); fi; \
	echo "setup: installing the project and its dependencies (log: $(INSTALL_LOG))"; \
	logged $(BIN)/python -m pip install --upgrade pip; \
	logged $(BIN)/python -m pip install -e '.[test]'; \
	rm -f $(VENV)/.installed-*; touch $@; \
	echo "setup: done in $$((SECONDS - start)) s"

demo: venv
	@mkdir -p $(PREFECT_HOME)
	@$(BIN)/python -m supervisor.demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The suite runs on WORKERS processes (pytest-xdist), a test file to a worker, so module fixtures are built once.
# (Not --dist loadgroup: with pytest 9.2 xdist 3.8 can no longer tag node ids with their group, and every test
# is then scheduled on its own.)
WORKERS ?= 2

test: lint
	@mkdir -p $(PREFECT_HOME)  # Prefect creates its home without parents, then warns on every start
	$(BIN)/pytest -q -n $(WORKERS) --dist loadfile --durations=25

# The inner loop: everything but the tests marked slow or e2e (real servers, flows, multi-process runs).
test-fast: lint
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/pytest -q -n $(WORKERS) --dist loadfile -m "not slow and not e2e"

bench: venv
	$(BIN)/rollback-supervisor bench checkpoint --params 100M --json benchmarks/results/checkpoint-100M.json

clean:
	rm -rf .rollback .pytest_cache
