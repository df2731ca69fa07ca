"""Shared pieces for tests that train: a small corpus, a small model, and reading a run's metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_corpus(folder: Path) -> Path:
    """A few hundred KB of English and Python from the interpreter's own documentation topics."""
    import pydoc_data.topics as topics

    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, text) in enumerate(sorted(topics.topics.items())):
        (folder / f"{i:03d}_{name}.txt").write_text(text)
    return folder


def run_tree(tmp_path_factory, name: str) -> tuple[Path, Path, Path]:
    """A module's folder of runs: (the folder, its corpus, its data cache)."""
    base = tmp_path_factory.mktemp(name)
    return base, write_corpus(base / "text"), base / "cache"


# for runs whose checkpoints nothing reads (layout parity): no save at train.steps, ~0.2 s a run at 4 ranks here
# (DCP's plan exchange and three barriers); train.save_every and train.exit_after still save
NO_FINAL_SAVE = {"train.save_at_end": "false"}


def small_overrides(corpus: Path, cache: Path, log_dir: Path, steps: int = 10, **extra) -> list[str]:
    """A 2-layer GPT that runs a step in well under a second on one core."""
    values = {
        "parallel.tp": 1, "parallel.pp": 1, "parallel.sequence_parallel": "false", "train.precision": "fp32",
        "zero.stage": 0,
        "model.layers": 2, "model.hidden": 64, "model.heads": 4, "model.seq_len": 32, "model.vocab_size": 512,
        "train.steps": steps, "train.global_batch": 8, "train.micro_batch": 2, "train.lr": "1.0e-3",
        "train.min_lr": "1.0e-4", "train.warmup_steps": 2, "train.eval_every": 0, "train.save_every": 0,
        "data.paths": f"[{corpus}]", "data.cache_dir": str(cache), "log.dir": str(log_dir), "log.every": 1,
        "log.peak_tflops": 1.0,
        # one thread: the suite's two workers share two cores, and at these sizes a second thread only waits
        # (measured: 20 steps of a 2-layer Llama, 0.35-0.48 s on one thread, 0.73-0.85 s on two, on a quiet machine)
        "launch.cpu_threads": 1,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def pretrain_cmd(overrides: list[str], nproc: int = 1) -> list[str]:
    args = [str(ROOT / "pretrain.py"), "--config", str(ROOT / "configs" / "tiny.yaml")]
    for o in overrides:
        args += ["--set", o]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(_port()), *args]


def _port() -> int:
    from tests.dist import free_port

    return free_port()


def run_pretrain(overrides: list[str], nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(pretrain_cmd(overrides, nproc), capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def latest_checkpoint(log_dir: Path) -> Path:
    """The checkpoint a run in ``log_dir`` wrote last."""
    from megazero.checkpoint import store

    return store.latest_checkpoint(log_dir / "checkpoints")


def run_layouts(config: str, overrides, base: Path, layouts) -> None:
    """Each ``(name, extra)`` layout trained in ``base / name`` (``overrides(log_dir, extra)`` gives its sets):
    one spawn of the ranks runs every layout of its size."""
    from megazero.train.run import run

    for name, extra in layouts:
        run(config, overrides(base / name, extra))


def run_saved_and_resumed(config: str, overrides, saved: tuple[Path, list], resumed: tuple[Path, list],
                          stop: int) -> None:
    """A run (in ``saved[0]``, with ``saved[1]``) that saves at step ``stop`` and exits, then one (in
    ``resumed[0]``, with ``resumed[1]``: another layout) that continues from that checkpoint."""
    from megazero.train.run import run

    run(config, overrides(saved[0], list(saved[1]) + [f"train.save_every={stop}", f"train.exit_after={stop}"]))
    run(config, overrides(resumed[0], list(resumed[1]) + [f"train.resume={latest_checkpoint(saved[0])}"]))


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_curves_match(name: str, want: list[dict], got: list[dict], keys: tuple = ("loss", "grad_norm"),
                        rel: float = 1e-5) -> None:
    """A layout's logged steps against its reference's: the same steps, and each of ``keys`` within ``rel`` of
    the reference's value (fp32 layouts sum the same gradients in another order: ~1e-6)."""
    assert len(got) == len(want) and got, (name, len(got), len(want))
    for a, b in zip(want, got):
        assert b["step"] == a["step"], (name, a["step"], b["step"])
        for k in keys:
            assert abs(a[k] - b[k]) <= rel * abs(a[k]), (name, a["step"], k, a[k], b[k])


def assert_resume_exact(whole: Path, resumed: Path, saved: int, steps: int) -> None:
    """A run stopped at step ``saved`` and resumed at its own layout (``resumed``: its log.dir, or the stopped
    run's when it continued there) against the uninterrupted run: every
    logged step after ``saved`` with the same loss and gradient norm, bit for bit, and the last checkpoints'
    stored tensors (the weights, every optimizer state, the buffers, each rank's own) equal bit for bit."""
    import torch

    from megazero.checkpoint import store

    want = [r for r in read_metrics(whole) if "loss" in r]
    got = [r for r in read_metrics(resumed) if "loss" in r and r["step"] > saved]  # the resumed run's steps
    assert [r["step"] for r in got] == list(range(saved + 1, steps + 1)), [r["step"] for r in got]
    for a, b in zip(want[saved:], got):
        assert (a["step"], a["loss"], a["grad_norm"]) == (b["step"], b["loss"], b["grad_norm"]), (a, b)
    ends = [store.checkpoint_dir(Path(d) / "checkpoints", steps) for d in (whole, resumed)]
    kinds = [store.stored_tensors(e) for e in ends]
    assert set(kinds[0]) == set(kinds[1]), sorted(set(kinds[0]) ^ set(kinds[1]))[:5]
    tensors = []
    for end, kind in zip(ends, kinds):
        state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in kind.items()}
        store.load(end, state)
        tensors.append(state)
    for k, t in tensors[0].items():
        assert torch.equal(t, tensors[1][k]), (k, (t - tensors[1][k]).abs().max().item())


def executor_for(model, grid, microbatches):
    """The executor and 1F1B schedule the trainer would use for one bare model at pp = 1, fp32, on the CPU
    (from ``megazero.engine.build``): what tests need to drive ``megazero.engine.step.train_step`` without a
    whole engine."""
    import torch

    from megazero.engine.build import make_executor, make_schedules

    b, s = microbatches[0].shape[0], microbatches[0].shape[1] - 1
    executor = make_executor([model], grid, torch.device("cpu"), b, s, model.embed.tokens.weight.shape[1], "fp32",
                             len(microbatches) * b * s)
    return executor, make_schedules("1f1b", grid, len(microbatches))[0]


def steps_recording_gradients(model, grid, make, vocab: int, seq_len: int, steps: int, lr: float):
    """``steps`` unclipped steps of one bare model on two microbatches of random tokens each, through the ZeRO
    optimizer ``make()`` builds (after the recording hooks, so they see each gradient before ZeRO's hooks take
    it); returns the optimizer and, per step, each parameter's gradient summed over the microbatches (what a
    reference optimizer written in the test steps from)."""
    import torch

    from megazero.engine.step import train_step

    grads: list[dict] = []

    def record(p, name):
        grads[-1][name] = grads[-1].get(name, 0) + p.grad.detach().clone()

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: record(p, name))
    zero = make()
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grads.append({})
        mbs = [torch.randint(0, vocab, (2, seq_len + 1), generator=gen) for _ in range(2)]
        result = train_step(zero, *executor_for(model, grid, mbs), mbs, lr, 0.0)  # max_norm 0: unclipped
        assert not result.skipped
    return zero, grads


def engine_for(cfg, grid, is_builder: bool = True):
    """The data and the engine a run of ``cfg`` (resolved: megazero.config.resolve) would train with on this CPU rank, without
    the loop: ``(data, megazero.engine.build.Engine)``. Collective: every rank of the grid calls it."""
    import torch

    from megazero.engine.build import build_engine
    from megazero.train.rank_data import load_data_everywhere

    data = load_data_everywhere(cfg, grid, is_builder)
    return data, build_engine(cfg, grid, torch.device("cpu"))
