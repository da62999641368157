# Every target here works on a fresh machine: it installs what it needs first.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml native/Cargo.toml native/Cargo.lock native/pyproject.toml native/src/*.rs | sha1sum | cut -c1-12)

export TWOPHASE_STACK_DIR ?= $(CURDIR)/.stack
# Downloads and builds (jars, helm, SecantusDB) are shared by every clone on the machine.
export TWOPHASE_CACHE_DIR ?= $(HOME)/.cache/twophase

.PHONY: help venv stack-up stack-down stack-status test test-fast lint demo demo-cdc bench chaos helm clean config-doc

help:
	@echo "make demo         set everything up and run the main pipeline end to end"
	@echo "make demo-cdc     Debezium change streams of 4 tables replicated exactly, through a kill"
	@echo "make test         set everything up and run the whole test suite"
	@echo "make stack-up     start Kafka, PostgreSQL, SecantusDB, Apicurio and MinIO on 127.0.0.1"
	@echo "make stack-down   stop what stack-up started"
	@echo "make stack-status show what is running and where its logs are"
	@echo "make lint         ruff and mypy --strict"
	@echo "make bench        benchmarks -> bench/results/latest.json"
	@echo "make chaos        fault injection on the real stack -> chaos/results/latest.json"
	@echo "make config-doc   regenerate docs/config.md from the config models"

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@# The compiled JSON -> COPY encoder (Rust, via maturin; crates from crates.io). Optional for
	@# the product, which falls back to Python without it; the tests compare the two paths.
	$(PY) -m pip install --quiet ./native
	@rm -f $(VENV)/.installed-*; touch $@

venv: $(STAMP)

# The broker also listens for the chaos run's per-process Toxiproxy links (chaos/README.md;
# inert otherwise), so `make test`'s short chaos run can cut a participant from Kafka.
stack-up: venv
	@TWOPHASE_KAFKA_EXTRA_LISTENERS="$${TWOPHASE_KAFKA_EXTRA_LISTENERS-$$($(PY) -m chaos.run --print-listeners)}" \
		bash stack/stack.sh up

stack-down:
	@bash stack/stack.sh down

stack-status:
	@bash stack/stack.sh status

helm:
	@bash stack/helm.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The suite needs Kafka Connect too (the Debezium smoke test): stack-up starts it for `test`.
test: export TWOPHASE_STACK_CONNECT ?= 1
test: venv stack-up helm
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_ARGS)

# The pure state machines and the simulator only: no services needed.
test-fast: venv
	$(PY) -m pytest tests/unit tests/sim tests/contract $(PYTEST_ARGS)

# The main pipeline (generated orders, a participant killed mid-transaction), then the PySpark
# order-totals job feeding a pipeline and the coordinated foreachBatch writer with a driver kill.
demo: venv stack-up
	$(PY) -m harness.demo
	$(PY) -m harness.spark_demo

# Change data capture: Debezium on Kafka Connect -> one pipeline -> PostgreSQL replica tables.
demo-cdc: export TWOPHASE_STACK_CONNECT = 1
demo-cdc: venv stack-up
	$(PY) -m harness.cdc_demo

# docs/config.md, every pipeline option, generated from the config models.
config-doc: venv
	$(PY) -m twophase.cli.configdoc --write

bench: venv stack-up
	$(PY) -m bench.run

chaos: venv stack-up
	$(PY) -m chaos.run

clean: stack-down
	rm -rf $(VENV) $(TWOPHASE_STACK_DIR)
