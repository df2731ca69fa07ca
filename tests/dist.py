"""Run a function on N gloo ranks on CPU: the one way distributed tests start processes.

Ranks are forked from a forkserver that has imported torch and the project once (``PRELOAD``), so a rank
starts in ~40 ms instead of the ~3 s a spawned interpreter pays to import torch on a 2-core machine. The
forkserver itself never runs an op or starts a process group: each rank's gloo, threads and RNG are its
own, and each reseeds torch's and numpy's generators. A rank takes the caller's environment and working
directory as they are when it starts (the forkserver's are from when it began), so a test that sets either
before ``run_ranks`` still sees it; what the preloaded modules read at import (TRITON_INTERPRET, set by
tests/conftest.py before anything imports triton) is the forkserver's.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
import socket
import sys
import traceback
from typing import Any, Callable

# imported once, in the forkserver: what nearly every rank function needs (an import that fails is skipped).
# A training run's own lazy imports are here too: torch.distributed.checkpoint (DTensor, sympy) and torch._dynamo
# cost a rank ~2 s of CPU on a 2-core machine, and the trainer, its checkpoint writer and TensorBoard's protos
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo", "numpy", "pytest",
           "megazero.train.run", "megazero.train.trainer", "megazero.train.run_dir", "megazero.train.events",
           "megazero.checkpoint.store", "megazero.plan.stage_plan", "megazero.interop.hf_import",
           "megazero.data.preprocess", "megazero.engine.build", "megazero.engine.step", "megazero.models.build",
           "megazero.parallel.topology", "tests.runs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """The forkserver context, its server running with this process's sys.path (Python 3.11's forkserver does not
    apply the path it is handed, so the preloaded project would come from wherever its working directory is)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read only when the server starts
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        multiprocessing.forkserver.ensure_running()  # a no-op while it runs
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def _entry(rank: int, world: int, port: int, env: dict, cwd: str, fn: Callable, args: tuple, queue) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    try:
        os.chdir(cwd)
        import torch
        import torch.distributed as dist

        torch.seed()  # a fork shares the server's generator state: unseeded draws differ per rank, as spawned ones did
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)  # the caller's (start_ranks)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        if dist.is_initialized():
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, False, traceback.format_exc()))


class Ranks:
    """Ranks started by ``start_ranks``, running while the caller does other work."""

    def __init__(self, world: int, procs: list, queue, timeout: float, store: Any):
        self.world, self.procs, self.queue, self.timeout = world, procs, queue, timeout
        self.store = store  # the ranks' rendezvous, served from this process until they finish

    def results(self) -> list[Any]:
        """Wait for every rank; its fn's results ordered by rank. A failure on any rank raises with that rank's
        traceback."""
        results: dict[int, Any] = {}
        try:
            for _ in range(self.world):
                rank, ok, value = self.queue.get(timeout=self.timeout)
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = value
        finally:
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        return [results[r] for r in range(self.world)]


def start_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Ranks:
    """Start fn(rank, world, *args) on `world` gloo ranks and return at once: a one-process run (world 1) beside
    a spawn of several uses the core that process would leave idle. Call ``results()`` to wait for them."""
    import torch.distributed as dist

    ctx = _context()
    queue = ctx.Queue()
    # the rendezvous store listens here, on a port the kernel gives it and it keeps: a port found free and then
    # bound by rank 0 could meanwhile be taken by another spawn (EADDRINUSE, seen with two workers spawning)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_entry, args=(r, world, store.port, env, cwd, fn, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    return Ranks(world, procs, queue, timeout, store)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run fn(rank, world, *args) on `world` gloo ranks; return the results ordered by rank.

    fn must be importable (module level) and its results picklable. A failure on
    any rank raises with that rank's traceback.
    """
    return start_ranks(world, fn, *args, timeout=timeout).results()
