"""Compile the attention kernels for a GPU that is not here, and read what they would use on it.

Triton compiles for any NVIDIA target without a device (``triton.compile`` with a ``GPUTarget``);
the cubin it produces tells, before any GPU run, whether a block configuration fits the shared
memory of the target, spills registers to local memory, and lowers ``tl.dot`` to Hopper's
asynchronous warpgroup MMA (``wgmma``) or to the older ``mma.sync``. That is how the autotune
sets in ``kernels.attention_configs`` were chosen, and how the tests keep them valid.

    python -m megazero.kernels.aot [--arch 90] [--head-dims 64,128] [--groups 1,4] [--docs] [--all]

prints one line per (group, kernel, head dim, configuration); ``--all`` adds the wider grid the sets were
picked from; ``--groups``, grouped-query (GQA) group sizes: compile-time constants of the kernels. Needs
triton and no ``TRITON_INTERPRET=1`` (the interpreter has nothing to compile).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import megazero.kernels.flash_attention as FA
from megazero.kernels.attention_configs import configs_for

# Shared memory one block may use (dynamic, opt-in) on sm_90: 227 KB (CUDA C Programming Guide, "Compute
# Capabilities", technical specifications per compute capability).
HOPPER_SHARED_BYTES = 227 * 1024
_DKDV_POINTERS = ("Q", "K", "V", "DO", "DK", "DV", "DQ_ACC", "LSE", "DELTA", "VISITS", "QD", "KD")  # dkdv, dkdvq
_POINTERS = {"fwd": ("Q", "K", "V", "O", "LSE", "VISITS", "QD", "KD"), "dkdv": _DKDV_POINTERS,
             "dkdvq": _DKDV_POINTERS, "dq": ("Q", "K", "V", "DO", "DQ", "LSE", "DELTA", "VISITS", "QD", "KD")}
_SCALARS = {"fwd": ("qk_scale",), "dkdv": ("qk_scale", "sm_scale"), "dq": ("qk_scale", "sm_scale"),
            "dkdvq": ("qk_scale", "sm_scale")}
_FLAGS = ("GROUP", "HEAD_DIM", "CAUSAL", "PRECISION", "COUNT_VISITS", "ATOMIC_DQ", "DOCS", "BLOCK_M", "BLOCK_N",
          "BLOCK_D")


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel needs per block on the target."""
    kind: str
    head_dim: int
    config: tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, num_warps, num_stages
    group: int  # query heads per key/value head (GQA)
    docs: bool  # the document-masked variant (DOCS)
    causal: bool  # the causal variant (the model's; a ring's blocks after the first are not causal)
    shared_bytes: int  # dynamic shared memory
    registers: int  # per thread
    stack_bytes: int  # per thread; > 0 means spilled registers
    wgmma: int  # wgmma.mma_async instructions in the PTX (Hopper tensor cores)
    mma_sync: int  # mma.sync instructions (pre-Hopper tensor-core path)


def _signature(kind: str, dtype: str) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as the launcher's arguments specialise: the head-dim strides are 1
    (the model's q, k, v views are contiguous along head_dim), every other stride and every pointer 16-aligned."""
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(FA._KERNELS[kind].arg_names):
        if name in _POINTERS[kind]:
            sig[name] = ("*fp32" if name in ("LSE", "DELTA", "DQ_ACC") else "*i32" if name in ("QD", "KD")
                         else f"*{dtype}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _SCALARS[kind]:
            sig[name] = "fp32"
        elif name in _FLAGS:
            sig[name] = "constexpr"
        elif name in ("H", "N_CTX"):
            sig[name] = "i32"
        elif name.endswith("d"):  # a stride along head_dim
            sig[name], constexprs[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"triton ships no cuobjdump at {path}")
    return path


def compile_attention(kind: str, head_dim: int, config: tuple[int, int, int, int], causal: bool = True,
                      dtype: str = "bf16", arch: int = 90, group: int = 1, docs: bool = False) -> Resources:
    """Compile one attention kernel ("fwd" | "dkdv" | "dq" | "dkdvq") for sm_<arch> and read its resource usage.

    group: query heads per key/value head (GQA, a compile-time constant of the kernels; 1: multi-head).
    docs: with the document mask (the DOCS variant, compiled apart)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if FA._interpreting():
        raise RuntimeError("kernels.aot compiles real kernels: unset TRITON_INTERPRET")
    block_m, block_n, warps, stages = config
    sig, constexprs, attrs = _signature(kind, dtype)
    constexprs.update(GROUP=group, HEAD_DIM=head_dim, CAUSAL=causal, PRECISION="ieee", COUNT_VISITS=False, DOCS=docs,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=FA.block_d(head_dim))
    if "ATOMIC_DQ" in sig:
        constexprs["ATOMIC_DQ"] = kind == "dkdvq"
    src = ASTSource(FA._KERNELS[kind], signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found, f"unexpected cuobjdump output: {usage[-300:]}"
    ptx = compiled.asm["ptx"]
    return Resources(kind, head_dim, tuple(config), group, docs, causal, compiled.metadata.shared,
                     int(found.group(1)),
                     int(found.group(2)), ptx.count("wgmma.mma_async"), ptx.count("mma.sync"))


def candidates(kind: str, head_dim: int, wide: bool, docs: bool = False) -> list[tuple[int, int, int, int]]:
    """The autotune set for (kind, head_dim, docs), or with ``wide`` the grid it was chosen from."""
    if not wide:
        return list(configs_for(kind, head_dim, docs))
    return [(m, n, w, s) for m, n in itertools.product((32, 64, 128), repeat=2) if m * n >= 64 * 32
            for w in (4, 8) for s in (2, 3, 4)]


def describe(job: tuple[str, int, tuple[int, int, int, int], int, int, bool, bool]) -> dict:
    """One job (kind, head dim, config, arch, group, docs, causal) compiled: its Resources as a dict, or its
    error."""
    kind, d, config, arch, group, docs, causal = job
    try:
        return asdict(compile_attention(kind, d, config, causal=causal, arch=arch, group=group, docs=docs))
    except Exception as err:  # noqa: BLE001 -- one configuration failing must not end the table
        return {"kind": kind, "head_dim": d, "config": config, "group": group, "docs": docs, "causal": causal,
                "error": (str(err).splitlines() or [type(err).__name__])[0][:200]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--all", action="store_true", help="the wider grid, not only the autotune sets")
    parser.add_argument("--kinds", default="fwd,dkdv,dq,dkdvq")
    parser.add_argument("--groups", default="1", help="GQA group sizes (query heads per kv head), e.g. 1,4")
    parser.add_argument("--docs", action="store_true", help="the document-masked variants instead")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel")
    args = parser.parse_args()
    import json
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(kind, d, config, args.arch, g, args.docs, True) for g in (int(x) for x in args.groups.split(","))
            for kind in args.kinds.split(",") for d in (int(x) for x in args.head_dims.split(","))
            for config in candidates(kind, d, args.all, args.docs)]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row in pool.map(describe, jobs):  # in order
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
