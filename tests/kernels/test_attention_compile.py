"""The attention autotune sets compile for Hopper (sm_90) into kernels that can run well there.

No GPU is needed: ``kernels.aot`` compiles each (kernel, head dim, configuration) the autotuner may
try, in bf16 and causal as the model calls it, and reads the cubin's resource usage; the dK/dV kernels
again with a grouped-query (GQA) group of 8, whose loops walk several query heads. A configuration
that needs more than the 227 KB of shared memory a Hopper block can have would fail to launch (the
autotuner would drop it, silently narrowing the search); one that spills registers to local memory
or misses the wgmma tensor-core path would be slow. Compiled in fresh processes without
TRITON_INTERPRET (conftest sets it for the interpreter tests, and triton reads it at import).

The ~100 compiles (~1 s of CPU each) are what this file costs: its three compiling processes run at
once, so each one's start (importing torch and triton) and its pool's last, lone compile overlap the
others' work instead of leaving a core idle.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOPPER_SHARED_BYTES = 227 * 1024  # per block, opt-in dynamic shared memory on sm_90 (CUDA programming guide)
SMALL_GPU_SHARED_BYTES = 48 * 1024  # what any CUDA GPU gives a block without opting in


def start_compiling(cache: Path, args: list[str]) -> subprocess.Popen:
    """A fresh Python without TRITON_INTERPRET, compiling into ``cache`` (really compile; keep ~/.triton clean)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen]) -> list[list[str]]:
    """Each process's stdout lines, once all have ended (none is left running when one failed)."""
    done = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, done):
        assert p.returncode == 0, err[-2000:]
    return [out.splitlines() for out, _ in done]


GQA_GROUP = 8  # Llama 3 70B: 64 query heads over 8 kv heads
GQA_KINDS = ("dkdv", "dkdvq")  # the group changes only their loops (fwd, dQ: which k/v head a program reads)
# a 4-warp 128x128 forward at head dim 128 (spills) and 4 pipeline stages of 128-wide K and V tiles (> 227 KB)
BAD = ("import json; from dataclasses import asdict; from kernels.aot import compile_attention as c; "
       "print(json.dumps([asdict(c('fwd', 128, (128, 128, 4, 3))), asdict(c('fwd', 128, (64, 128, 8, 4)))]))")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(every autotune set's rows from ``python -m kernels.aot``, the two bad configurations' rows)."""
    aot = ["-m", "kernels.aot", "--arch", "90"]
    procs = [start_compiling(tmp_path_factory.mktemp("triton-cache"), args) for args in (
        aot + ["--head-dims", "64,80,128"],
        aot + ["--head-dims", "128", "--groups", str(GQA_GROUP), "--kinds", ",".join(GQA_KINDS)],
        ["-c", BAD])]
    lines = finish(procs)
    sets = [json.loads(line) for out in lines[:2] for line in out if line.startswith("{")]
    return sets, json.loads(lines[2][-1])


@pytest.fixture(scope="module")
def autotune_sets(compiled):
    return compiled[0]


def test_every_autotune_config_fits_hopper(autotune_sets):
    from kernels.attention_configs import SMALL_CONFIG, configs_for

    expected = {(kind, d, tuple(c), 1) for kind in ("fwd", "dkdv", "dq", "dkdvq") for d in (64, 80, 128)  # 80: padded
                for c in configs_for(kind, d)}
    # the group's loops at head dim 128, the one with the most registers per thread (64 had no spill either)
    expected |= {(kind, 128, tuple(c), GQA_GROUP) for kind in GQA_KINDS for c in configs_for(kind, 128)}
    assert {(r["kind"], r["head_dim"], tuple(r["config"]), r["group"]) for r in autotune_sets} == expected, \
        [r for r in autotune_sets if "error" in r]
    small = tuple(SMALL_CONFIG)
    for r in autotune_sets:
        where = f"{r['kind']} head_dim {r['head_dim']} config {r['config']} group {r['group']}"
        assert r["shared_bytes"] <= HOPPER_SHARED_BYTES, f"{where}: {r['shared_bytes']} B of shared memory"
        assert r["stack_bytes"] == 0, f"{where}: spills ({r['stack_bytes']} B of stack per thread)"
        assert r["registers"] <= 255
        if tuple(r["config"]) == small:  # the fallback for smaller GPUs: fits anywhere, still tensor cores
            assert r["shared_bytes"] <= SMALL_GPU_SHARED_BYTES and r["mma_sync"] + r["wgmma"] > 0, where
        elif r["kind"] == "dkdvq":  # its products have key rows (dK, dV) and query rows (dQ): a 32-row side,
            # needed at head dim 128 to keep registers, goes to mma.sync (wgmma takes 64 rows per warpgroup)
            assert r["wgmma"] > 0, where
            assert r["mma_sync"] == 0 or min(r["config"][:2]) < 64, where
        else:  # Hopper's asynchronous warpgroup MMA, not the sm_80 mma.sync path
            assert r["wgmma"] > 0 and r["mma_sync"] == 0, where


def test_the_checks_reject_bad_configs(compiled):
    """The measurements can tell: a 4-warp 128x128 forward at head dim 128 spills, and 4 pipeline stages of
    128-wide K and V tiles need more than 227 KB. (Guards against, e.g., a stack size that always reads 0.)
    Compiled with the autotune sets, in a process of its own (compile_attention called directly)."""
    from kernels.aot import compile_attention  # noqa: F401  (the module must import without a GPU)

    spilling, too_big = compiled[1]
    assert spilling["stack_bytes"] > 0
    assert too_big["shared_bytes"] > HOPPER_SHARED_BYTES
