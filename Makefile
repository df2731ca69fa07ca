# `make pretrain` and `make test` each do all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
NPROC  ?= 8
# CPU-only machines get the CPU build of torch (the "+cpu" release) from pip's configured index, never a
# multi-GB CUDA build; docs/operations.md, "Set-up without a GPU", says what to do where that index has none.
TORCH_CPU_VERSION ?= 2.13.0
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup pretrain test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(BIN)/pip install -q torch triton
else
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==$(TORCH_CPU_VERSION)+cpu" || \
	  { echo "make: pip's configured index has no CPU build torch==$(TORCH_CPU_VERSION)+cpu;" \
	         "see docs/operations.md, Set-up without a GPU" >&2; exit 1; }
endif
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

pretrain: $(STAMP)
	@# the config checked for this world size first: a mistake is one line and exit 2, not torchrun's report
	$(BIN)/python pretrain.py --config $(CONFIG) --dry-run --set parallel.world_size=$(NPROC) > /dev/null
	@# a second `make pretrain` continues the run where it stopped, or says it is finished
	$(BIN)/torchrun --standalone --nproc-per-node $(NPROC) pretrain.py --config $(CONFIG) --set train.resume=auto

# the whole suite over 2 workers, a test file each at a time (--dist loadfile: a module's runs, made once by its
# fixture, are not made again on the other worker); one thread per worker, as test-fast
test: $(STAMP)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE \
	  $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

# the inner loop: every test that starts no other process (tests/conftest.py marks the rest `spawns`), over 2
# workers with one thread each (an idle OpenMP pool spinning beside the other worker would halve both)
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE \
	  $(BIN)/python -m pytest -q -n 2 -m "not spawns" --durations=10 tests

clean:
	rm -rf $(VENV) runs .cache
