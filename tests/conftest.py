import os
import sys
from pathlib import Path

# Triton decides interpreted vs compiled when a function is decorated (its own tl.* at `import triton`
# included), so the mode must be set before anything imports triton. The kernel tests run Triton on CPU
# tensors through the interpreter; real runs pick kernels with kernels.* = auto | fused | triton | torch (adam).
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# What starts another process: gloo ranks (tests/dist.py), torchrun or pretrain.py as a child. A test in a module
# that calls one of these is marked `spawns`; `make test-fast` runs the rest (`-m "not spawns"`) for the inner
# loop, `make test` everything.
SPAWNING = ("run_ranks(", "start_ranks(", "run_pretrain(", "pretrain_cmd(", "subprocess.", "Popen(",
            "torch.distributed.run", "mp.spawn(", "multiprocessing")


def pytest_configure(config):
    config.addinivalue_line("markers", "spawns: starts other processes (gloo ranks, torchrun, pretrain.py)")


def pytest_collection_modifyitems(config, items):
    import pytest

    texts: dict[str, bool] = {}
    for item in items:
        path = str(item.fspath)
        if path not in texts:
            source = Path(path).read_text()
            texts[path] = any(s in source for s in SPAWNING)
        if texts[path]:
            item.add_marker(pytest.mark.spawns)
    # the modules that start processes (the long ones) first, each module's tests kept together and in order:
    # over `-n 2 --dist loadfile` the many short modules then fill the end, where one long module alone would
    # leave the other worker idle
    items.sort(key=lambda item: not texts[str(item.fspath)])


def pytest_collection_finish(session):
    """Every test module imported: none may have left a folder of the tree on sys.path, where it would shadow an
    installed distribution for the whole process (bench/kernels.py hid Hugging Face's ``kernels`` from
    transformers, failing every HF test that ran after it in the same worker)."""
    folders = [Path(p).resolve() for p in sys.path if p and Path(p).is_dir()]
    inside = [str(p) for p in folders if p.parent == ROOT and not p.name.startswith(".")]  # not .venv
    assert not inside, f"a test module put a folder of the tree on sys.path: {inside}"
