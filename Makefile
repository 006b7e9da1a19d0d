# Set-up is two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# torch is pinned to the CPU build this machine carries; on another machine point pip at
# the CPU wheel index with e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP_TORCH_FLAGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
MODEL ?=
PYTEST_ARGS ?=

.PHONY: install model serve test lint bench clean ibverbs chaos

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 $(PIP_TORCH_FLAGS)
	$(BIN)/pip install --quiet -e '.[test,mooncake]'
	$(BIN)/python -c "from ember.engine.kernels import cpu_kernels; cpu_kernels()"  # C++ kernels, 0.5-2 min once per checkout
	touch $(STAMP)

install: $(STAMP)

# ember's bytecode, kept current: where PYTHONDONTWRITEBYTECODE is set (containers, CI) Python
# never writes it, and each process of every start would compile ember's modules again
model: install
	$(BIN)/python -m compileall -q ember
	$(BIN)/ember download $(MODEL)

serve: model
	$(BIN)/ember serve $(MODEL)

# Mooncake's Transfer Engine links libibverbs even for TCP; its test needs the library
ibverbs:
	@dpkg -s libibverbs1 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libibverbs1) \
		|| echo "libibverbs1 could not be installed: the Mooncake transport test will skip"

test: model ibverbs
	$(BIN)/ruff check ember tests benchmarks chaos
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# the fuzz and chaos families (a few minutes; loopback only), not part of `make test`
chaos: model
	$(BIN)/pip install --quiet -e '.[test,mooncake,chaos]'
	$(BIN)/python -m pytest -q -s -p no:cacheprovider chaos

lint: install
	$(BIN)/ruff check ember tests benchmarks chaos
	$(BIN)/ruff format --check ember tests benchmarks

bench: model
	$(BIN)/ember bench offline $(MODEL) --compare-hf

clean:
	rm -rf $(VENV) build *.egg-info
