# driftgate — every target bootstraps what it needs on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
MODEL   ?= $(or $(DRIFTGATE_HOME),$(HOME)/.cache/driftgate)/models/smollm2-135m-instruct
OUT     ?= out
DATA    ?= $(or $(DRIFTGATE_DATA),$(abspath ../shared/data))

.PHONY: setup model test test-fast demo bench lint clean

$(BIN)/driftgate: pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev,cluster]'
	touch $@

setup: $(BIN)/driftgate

$(MODEL)/model.safetensors: | $(BIN)/driftgate
	$(BIN)/driftgate import-model smollm2-135m --dest $(MODEL)

model: $(MODEL)/model.safetensors

test: setup model
	$(PYTHON) -m pytest -q --timeout=900 tests

test-fast: setup
	$(PYTHON) -m pytest -q -m "not real_model and not slow" tests

demo: setup model
	scripts/demo.sh $(MODEL) $(OUT) $(DATA)

bench: setup model
	mkdir -p bench/results
	$(BIN)/driftgate bench offline $(MODEL) --result-json bench/results/offline.json --plot bench/results/offline.png

lint: setup
	$(BIN)/ruff check engine quant calibration evals server bench tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache $(OUT)
