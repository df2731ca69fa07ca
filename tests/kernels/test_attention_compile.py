"""The attention autotune sets compile for Hopper (sm_90) into kernels that can run well there.

No GPU is needed: ``kernels.aot`` compiles each (kernel, head dim, configuration) the autotuner may
try, in bf16 and causal as the model calls it, and reads the cubin's resource usage; not causal (a ring's
blocks after its first) and the document-masked variants, both ways, per head-dim class; the dK/dV kernels again with a grouped-query (GQA) group of 8, whose
loops walk several query heads. A configuration that needs more than the 227 KB of shared memory a Hopper
block can have would fail to launch (the autotuner would drop it, silently narrowing the search); one that
spills registers to local memory or misses the wgmma tensor-core path would be slow.

The ~160 compiles take ~4 minutes of CPU, and their result depends only on the kernels' sources, the
configurations and the Triton release: ``kernels/aot_sm90.json`` stores it under a key hashed from exactly
those (``kernels.aot_check``). When the key matches, the stored rows are checked; when it does not (an
edited kernel, another Triton) every job is compiled here, in a fresh process without TRITON_INTERPRET
(conftest sets it for the interpreter tests, and triton reads it at import), and the test says how to
store the new report. Either way the rows checked are the compiler's for these exact sources.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.kernels.aot_check import BAD, GQA_GROUP, GQA_KINDS, suite_jobs, stored_rows

ROOT = Path(__file__).resolve().parents[2]
HOPPER_SHARED_BYTES = 227 * 1024  # per block, opt-in dynamic shared memory on sm_90 (CUDA programming guide)
SMALL_GPU_SHARED_BYTES = 48 * 1024  # what any CUDA GPU gives a block without opting in


def _compile_now(tmp: Path) -> list[dict]:
    """Every job compiled in a fresh Python without TRITON_INTERPRET, into its own cache (keep ~/.triton clean)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp)
    proc = subprocess.run([sys.executable, "-m", "kernels.aot_check", "--print"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(every autotune set's rows, the two bad configurations' rows), stored or compiled now."""
    jobs = suite_jobs()
    rows = stored_rows(jobs)
    if rows is None:
        rows = _compile_now(tmp_path_factory.mktemp("triton-cache"))
        print("kernels/aot_sm90.json is stale: python -m megazero.kernels.aot_check --write stores these rows")
    assert len(rows) == len(jobs)
    return rows[:-len(BAD)], rows[-len(BAD):]


@pytest.fixture(scope="module")
def autotune_sets(compiled):
    return compiled[0]


def test_every_autotune_config_fits_hopper(autotune_sets):
    from megazero.kernels.attention_configs import SMALL_CONFIG, SMALL_DOC_CONFIG, configs_for

    kinds = ("fwd", "dkdv", "dq", "dkdvq")
    expected = {(kind, d, tuple(c), 1, False, True) for kind in kinds for d in (64, 80, 128)  # 80: padded
                for c in configs_for(kind, d)}
    # not causal, as a ring's blocks after its first run, one head dim per class
    expected |= {(kind, d, tuple(c), 1, False, False) for kind in kinds for d in (64, 128) for c in configs_for(kind, d)}
    # the document-masked variants (their key-run scan adds registers), both ways, one head dim per class
    expected |= {(kind, d, tuple(c), 1, True, causal) for kind in kinds for d in (64, 128) for causal in (True, False)
                 for c in configs_for(kind, d, docs=True)}
    # the group's loops at head dim 128, the one with the most registers per thread (64 had no spill either),
    # with and without documents
    expected |= {(kind, 128, tuple(c), GQA_GROUP, docs, True) for kind in GQA_KINDS for docs in (False, True)
                 for c in configs_for(kind, 128, docs)}
    assert {(r["kind"], r["head_dim"], tuple(r["config"]), r["group"], r["docs"], r["causal"])
            for r in autotune_sets} == expected, [r for r in autotune_sets if "error" in r]
    small = tuple(SMALL_CONFIG)
    for r in autotune_sets:
        where = (f"{r['kind']} head_dim {r['head_dim']} config {r['config']} group {r['group']} docs {r['docs']} "
                 f"causal {r['causal']}")
        assert r["shared_bytes"] <= HOPPER_SHARED_BYTES, f"{where}: {r['shared_bytes']} B of shared memory"
        assert r["stack_bytes"] == 0, f"{where}: spills ({r['stack_bytes']} B of stack per thread)"
        assert r["registers"] <= 255
        if tuple(r["config"]) == (tuple(SMALL_DOC_CONFIG) if r["docs"] else small):  # the fallback for smaller
            # GPUs: fits anywhere, still tensor cores
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
    Compiled (or stored) with the autotune sets."""
    from megazero.kernels.aot import compile_attention  # noqa: F401  (the module must import without a GPU)

    spilling, too_big = compiled[1]
    assert spilling["stack_bytes"] > 0
    assert too_big["shared_bytes"] > HOPPER_SHARED_BYTES
