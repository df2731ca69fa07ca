"""The sm_90 compile check of the attention kernels: the jobs the test suite compiles, and their stored report.

tests/kernels/test_attention_compile.py checks that every configuration the autotuner may try compiles for
Hopper into a kernel that fits its shared memory, spills nothing and uses its tensor cores (``kernels.aot``).
Compiling the ~160 jobs takes ~4 minutes of CPU. Their result depends only on the kernels' sources, the
configurations, this check and the Triton release (its bundled ptxas and cuobjdump), so it is stored in
``aot_sm90.json`` under a key hashed from exactly those; the test reads the stored rows when the key matches
and compiles afresh when it does not (an edited kernel, another Triton). After editing a kernel:

    python -m megazero.kernels.aot_check --write     # compile every job, store the report under the new key

``python -m megazero.kernels.aot_check`` says whether the stored report is current.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from megazero.kernels.attention_configs import configs_for

HERE = Path(__file__).resolve().parent
REPORT = HERE / "aot_sm90.json"
# what the compiled kernels and their reading depend on, besides the Triton release
SOURCES = ("flash_attention.py", "flash_backward.py", "flash_blocks.py", "attention_configs.py", "aot.py",
           "aot_check.py")
ARCH = 90
KINDS = ("fwd", "dkdv", "dq", "dkdvq")
HEAD_DIMS = (64, 80, 128)  # 80: padded to 128 inside the kernels
DOC_HEAD_DIMS = (64, 128)  # the document-masked variants, one per head-dim class
GQA_GROUP = 8  # Llama 3 70B: 64 query heads over 8 kv heads
GQA_KINDS = ("dkdv", "dkdvq")  # the group changes only their loops (fwd, dQ: which k/v head a program reads)
# a 4-warp 128x128 forward at head dim 128 (spills) and 4 pipeline stages of 128-wide K and V tiles (> 227 KB):
# the check must be able to tell
BAD = (("fwd", 128, (128, 128, 4, 3), ARCH, 1, False, True), ("fwd", 128, (64, 128, 8, 4), ARCH, 1, False, True))
# Triton's settings that change the code it generates, read from the environment of the compiling process
TRITON_SETTINGS = ("TRITON_DEFAULT_FP_FUSION", "TRITON_PTXAS_PATH", "TRITON_CUOBJDUMP_PATH")

Job = tuple  # (kind, head_dim, (BLOCK_M, BLOCK_N, warps, stages), arch, group, docs, causal)


def suite_jobs() -> list[Job]:
    """Every autotune configuration at each head dim, causal as the model calls it, and not causal per head-dim
    class (a ring's blocks after its first); the document-masked variants per head-dim class, both ways and
    grouped-query; the grouped-query loops at head dim 128 (the most registers per thread); then the two bad
    configurations."""
    jobs = [(k, d, c, ARCH, 1, False, True) for k in KINDS for d in HEAD_DIMS for c in configs_for(k, d)]
    jobs += [(k, d, c, ARCH, 1, False, False) for k in KINDS for d in DOC_HEAD_DIMS for c in configs_for(k, d)]
    jobs += [(k, d, c, ARCH, 1, True, causal) for causal in (True, False) for k in KINDS for d in DOC_HEAD_DIMS
             for c in configs_for(k, d, docs=True)]
    jobs += [(k, 128, c, ARCH, GQA_GROUP, docs, True) for docs in (False, True) for k in GQA_KINDS
             for c in configs_for(k, 128, docs)]
    return jobs + list(BAD)


def triton_version() -> str:
    """The installed Triton's release (``triton`` or ``pytorch-triton``'s distribution, the same module)."""
    for dist in ("triton", "pytorch-triton"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def suite_key(jobs: list[Job]) -> str:
    """sha256 of the Triton release and the settings that change its code, the sources the result depends on
    and the job list."""
    settings = " ".join(f"{k}={os.environ.get(k, '')}" for k in TRITON_SETTINGS)
    h = hashlib.sha256(f"triton {triton_version()} {settings}\n".encode())
    for name in SOURCES:
        h.update(name.encode() + b"\n" + (HERE / name).read_bytes())
    h.update(json.dumps(jobs).encode())
    return h.hexdigest()


def stored_rows(jobs: list[Job]) -> list[dict] | None:
    """The stored report's rows when it was compiled under these jobs' key, else None."""
    if not REPORT.is_file():
        return None
    report = json.loads(REPORT.read_text())
    return report["rows"] if report.get("key") == suite_key(jobs) else None


def compile_rows(jobs: list[Job], workers: int) -> list[dict]:
    """Each job compiled (``kernels.aot.describe``), in order, ``workers`` at a time."""
    from concurrent.futures import ProcessPoolExecutor

    from megazero.kernels.aot import describe

    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(describe, jobs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="compile every job and store the report")
    parser.add_argument("--print", action="store_true", help="compile every job and print its rows as JSON lines")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel")
    args = parser.parse_args()
    jobs = suite_jobs()
    if args.write or args.print:
        rows = compile_rows(jobs, args.jobs)
        if args.print:
            for row in rows:
                print(json.dumps(row), flush=True)
        if args.write:
            REPORT.write_text(json.dumps({"key": suite_key(jobs), "triton": triton_version(),
                                          "rows": rows}, indent=0) + "\n")
            print(f"{REPORT}: {len(rows)} compiled jobs")
        return 0
    current = stored_rows(jobs) is not None
    print(f"{REPORT}: {'current' if current else 'stale or missing: python -m megazero.kernels.aot_check --write'}")
    return 0 if current else 1


if __name__ == "__main__":
    sys.exit(main())
