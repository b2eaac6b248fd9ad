# Two commands: `make demo` and `make test`. Each creates .venv on first use and installs the project.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)

# Quiet, offline Prefect with its home inside the work dir (see ../shared/FACTS.md).
export PREFECT_HOME := $(CURDIR)/.rollback/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_UI_ENABLED := false
export PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS := false
export PREFECT_LOGGING_LEVEL := WARNING
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 180
export GIT_PYTHON_REFRESH := quiet

.PHONY: demo test lint venv clean bench

venv: $(STAMP)

$(STAMP):
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m supervisor.demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	@mkdir -p $(PREFECT_HOME)  # Prefect creates its home without parents, then warns on every start
	$(BIN)/pytest -q

bench: venv
	$(BIN)/rollback-supervisor bench checkpoint --params 100M --json benchmarks/results/checkpoint-100M.json

clean:
	rm -rf .rollback .pytest_cache
