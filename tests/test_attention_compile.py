"""The attention autotune sets compile for Hopper (sm_90) into kernels that can run well there.

No GPU is needed: ``kernels.aot`` compiles each (kernel, head dim, configuration) the autotuner may
try, in bf16 and causal as the model calls it, and reads the cubin's resource usage; the dK/dV kernels
again with a grouped-query (GQA) group of 8, whose loops walk several query heads. A configuration
that needs more than the 227 KB of shared memory a Hopper block can have would fail to launch (the
autotuner would drop it, silently narrowing the search); one that spills registers to local memory
or misses the wgmma tensor-core path would be slow. Compiled in a fresh process without
TRITON_INTERPRET (conftest sets it for the interpreter tests, and triton reads it at import).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOPPER_SHARED_BYTES = 227 * 1024  # per block, opt-in dynamic shared memory on sm_90 (CUDA programming guide)
SMALL_GPU_SHARED_BYTES = 48 * 1024  # what any CUDA GPU gives a block without opting in


def compile_for_hopper(tmp_path, *args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile; keep ~/.triton clean
    proc = subprocess.run([sys.executable, "-m", "kernels.aot", "--arch", "90", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


GQA_GROUP = 8  # Llama 3 70B: 64 query heads over 8 kv heads
GQA_KINDS = ("dkdv", "dkdvq")  # the group changes only their loops (fwd, dQ: which k/v head a program reads)


@pytest.fixture(scope="module")
def autotune_sets(tmp_path_factory):
    cache = tmp_path_factory.mktemp("triton-cache")
    return (compile_for_hopper(cache, "--head-dims", "64,80,128")
            + compile_for_hopper(cache, "--head-dims", "128", "--groups", str(GQA_GROUP),
                                 "--kinds", ",".join(GQA_KINDS)))


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


def test_the_checks_reject_bad_configs(tmp_path):
    """The measurements can tell: a 4-warp 128x128 forward at head dim 128 spills, and 4 pipeline stages of
    128-wide K and V tiles need more than 227 KB. (Guards against, e.g., a stack size that always reads 0.)"""
    from kernels.aot import compile_attention  # noqa: F401  (the module must import without a GPU)

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = ("import json; from dataclasses import asdict; from kernels.aot import compile_attention as c; "
            "print(json.dumps([asdict(c('fwd', 128, (128, 128, 4, 3))), asdict(c('fwd', 128, (64, 128, 8, 4)))]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spilling, too_big = json.loads(proc.stdout.splitlines()[-1])
    assert spilling["stack_bytes"] > 0
    assert too_big["shared_bytes"] > HOPPER_SHARED_BYTES
