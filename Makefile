# Two-command set-up: `make demo` and `make test` each build .venv from scratch when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvdb-installed
VLLM_STAMP := $(VENV)/.kvdb-vllm-installed
VLLM    := 0.32.0
TORCH   := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-fast bench install install-vllm clean native

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml setup.py native/kvdb_native.c native/build.py
	@# the CPU build of torch first: an unpinned torch requirement pulls a multi-GB CUDA build
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q setuptools wheel cffi
	$(BIN)/pip install -q --no-build-isolation -e '.[dev]'
	@# the Mooncake Transfer Engine needs the verbs libraries even for TCP; optional elsewhere
	-@if command -v apt-get >/dev/null 2>&1 && ! (ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q librdmacm.so.1); then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo 'sudo -n' ); \
		($$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1 librdmacm1) >/dev/null 2>&1 || true; fi
	-$(BIN)/pip install -q 'mooncake-transfer-engine-non-cuda>=0.3.13' || echo 'kvdb: Mooncake Transfer Engine not installed; replication uses plain TCP'
	-@$(BIN)/python -c 'from kvdb.replication.transport import mooncake_import_error as e; r = e(); print("kvdb: Mooncake Transfer Engine unusable (" + r + "); replication uses plain TCP, its tests skip") if r else None'
	touch $(STAMP)

# vLLM's CPU build, for the connector (kvdb/integrations/vllm) and its tests: about 2.5 min and
# 2.6 GB on top of the rest; `make demo` does not need it
$(VLLM_STAMP): $(STAMP) tools/install_vllm.py
	$(BIN)/pip install -q packaging
	$(BIN)/python tools/install_vllm.py $(VLLM)
	touch $(VLLM_STAMP)

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

native: $(STAMP)
	$(BIN)/pip install -q --no-build-isolation -e . --no-deps

demo: $(STAMP)
	$(BIN)/kvdb demo

test: $(VLLM_STAMP)
	KVDB_REQUIRE_VLLM=1 HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# the fast lane: everything but the tests marked slow (soaks, crash sweeps, multi-process
# replication) or vllm (a real vLLM); `make test` still runs all of them
test-fast: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest -q -m "not slow and not vllm" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvdb bench datapath
	$(BIN)/kvdb bench keys

clean:
	rm -rf $(VENV) build *.egg-info kvdb/_native*.so
