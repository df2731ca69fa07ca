# `make pretrain` and `make test` each do all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
NPROC  ?= 8
# CPU-only machines get a CPU build of torch: a local wheel if pip can see one, else PyTorch's CPU index.
TORCH_CPU_VERSION ?= 2.13.0
TORCH_CPU_INDEX   ?= https://download.pytorch.org/whl/cpu
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup pretrain test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(BIN)/pip install -q torch triton
else
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  { $(BIN)/pip install -q --no-index --no-deps "torch==$(TORCH_CPU_VERSION)" 2>/dev/null && \
	    $(BIN)/pip install -q "torch==$(TORCH_CPU_VERSION)"; } || \
	  $(BIN)/pip install -q torch --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple
endif
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

pretrain: $(STAMP)
	@# the config checked for this world size first: a mistake is one line and exit 2, not torchrun's report
	$(BIN)/python pretrain.py --config $(CONFIG) --dry-run --set parallel.world_size=$(NPROC) > /dev/null
	$(BIN)/torchrun --standalone --nproc-per-node $(NPROC) pretrain.py --config $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs .cache
