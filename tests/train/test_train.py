"""End-to-end training: layout invariance over dp, exact resume, crash-safe saves, logs."""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from megazero.checkpoint import store as checkpoint
from megazero.checkpoint.unpickle import SafeFileSystemReader
from megazero.train.run import run
from tests.runs import ROOT, read_metrics, small_overrides, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("data")
    return write_corpus(base / "text"), base / "cache"


def losses(records):
    return [r["loss"] for r in records]


def _train(rank: int, world: int, overrides: list[str]) -> bool:
    run(str(ROOT / "configs" / "tiny.yaml"), overrides)
    return True


def test_dp2_reproduces_single_process(corpus, tmp_path):
    """Same global batch, dp=1 vs dp=2: fp32 losses agree to 1e-5 relative, step after step.

    Only the order of floating-point sums differs (the dp all-reduce adds two
    half-batch gradients), so the curves agree far below 1e-5. The ranks are forked (tests/dist.py): that
    pretrain.py's ranks under torchrun train as forked ones do, bit for bit, is tests/train/test_hostile_run.py's
    (its torchrun runs end with the forked run's losses).
    """
    from tests.dist import run_ranks

    text, cache = corpus
    one = small_overrides(text, cache, tmp_path / "dp1", steps=8)
    two = small_overrides(text, cache, tmp_path / "dp2", steps=8) + ["parallel.dp=2"]
    run(str(ROOT / "configs" / "tiny.yaml"), one)
    run_ranks(2, _train, two)
    a, b = read_metrics(tmp_path / "dp1"), read_metrics(tmp_path / "dp2")
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-5), (x["loss"], y["loss"])
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=1e-4), (x["grad_norm"], y["grad_norm"])
    assert losses(a)[-1] < losses(a)[0]
    # The trained weights agree too. Adam divides each gradient element by its own RMS, so an element
    # whose gradient is ~0 turns summation-order noise into an update of up to lr (1e-3) per step;
    # atol 1e-5 (1% of one step's largest update) still catches any real divergence.
    wa = checkpoint.read_model_state(checkpoint.latest_checkpoint(tmp_path / "dp1" / "checkpoints"))
    wb = checkpoint.read_model_state(checkpoint.latest_checkpoint(tmp_path / "dp2" / "checkpoints"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-5)


def test_resume_is_exact_and_logs_are_complete(corpus, tmp_path):
    """20 steps straight == 10 steps + resume + 10 steps, loss for loss (dropout on: RNG restored too)."""
    text, cache = corpus
    extra = {"model.dropout": 0.1, "train.eval_every": 5}
    straight = run(str(ROOT / "configs" / "tiny.yaml"),
                   small_overrides(text, cache, tmp_path / "straight", steps=20, **extra))
    split_dir = tmp_path / "split"
    # a 20-step run cut after 10 steps (as a time-limited job slot would), then resumed
    first = run(str(ROOT / "configs" / "tiny.yaml"),
                small_overrides(text, cache, split_dir, steps=20, **extra) + ["train.exit_after=10"])
    assert checkpoint.latest_checkpoint(split_dir / "checkpoints").name == "step_00000010"
    second = run(str(ROOT / "configs" / "tiny.yaml"),
                 small_overrides(text, cache, split_dir, steps=20, **extra) + ["train.resume=auto"])
    assert [r["step"] for r in second] == list(range(11, 21))
    assert losses(straight) == losses(first) + losses(second)
    assert [r.get("val_loss") for r in straight] == [r.get("val_loss") for r in first + second]
    records = read_metrics(split_dir)
    assert [r["step"] for r in records] == list(range(1, 21))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "params_gb", "grads_gb",
                "optimizer_gb"):
        assert all(isinstance(r[key], (int, float)) for r in records), key
    assert all("val_loss" in r for r in records if r["step"] % 5 == 0)

    # TensorBoard: read the event files back and find the scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(split_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "val/loss",
                "memory/params_gb", "memory/optimizer_gb"):
        assert tag in tags, (tag, tags)
    tb_loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(tb_loss) == list(range(1, 21))
    assert math.isclose(tb_loss[20], records[-1]["loss"], rel_tol=1e-6)


def test_lr_schedule_is_layout_free_function_of_step():
    from megazero.train.lr_schedule import lr_at

    lrs = [lr_at(s, 1.0, 0.1, 10, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))            # warmup rises
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))             # cosine falls
    assert lr_at(100, 1.0, 0.1, 10, 100) == pytest.approx(0.1)
    assert lr_at(55, 1.0, 0.1, 10, 100) == pytest.approx(0.55)          # half way: mean of lr and min_lr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_measured_cpu_peak_takes_a_fraction_of_a_second(dtype):
    """MFU on a CPU divides by a measured matmul. A CPU without bf16 units emulates bf16 ~60x slower than fp32:
    a fixed 1024^3 product, 13 times, made every bf16 run's start wait ~35 s on a 2-core EPYC. The 2 s bound is
    ~6x the 0.3 s budget (a busy machine's slack), and far under the 35 s."""
    from megazero.train.metrics import measure_cpu_tflops

    t0 = time.perf_counter()
    tflops = measure_cpu_tflops(dtype)
    seconds = time.perf_counter() - t0
    assert seconds < 2.0, seconds
    assert 1e-5 < tflops < 1e3, tflops  # a real figure: above 10 MFLOP/s, below any CPU's peak


_SLOW_SAVE = """
import sys, torch
sys.path.insert(0, {root!r})
from megazero.checkpoint import store as checkpoint
state = {{f"model/w{{i}}": torch.full((1024, 1024), float(i)) for i in range(400)}}
print("saving", flush=True)
checkpoint.save({ckpt!r}, 2, state, {{"consumed_samples": 0}}, keep_last=5)
"""


def test_steps_skipped_for_fp16_overflow_do_not_advance_the_lr_schedule(corpus, tmp_path):
    """As in Megatron-LM and DeepSpeed, the schedule counts the updates made: the loss scale starts at 2^16,
    and with init_std 1 the first steps overflow and are skipped; the warmup must wait for them."""
    from megazero.train.lr_schedule import lr_at

    text, cache = corpus
    records = run(str(ROOT / "configs" / "tiny.yaml"),
                  small_overrides(text, cache, tmp_path / "fp16", steps=6,
                                  **{"train.precision": "fp16", "model.init_std": 1.0, "train.warmup_steps": 4}))
    skipped = [r["skipped"] for r in records]
    assert skipped[0] == 1 and 0 in skipped, skipped  # some skipped, some made
    for i, r in enumerate(records):
        updates = i - sum(skipped[:i])
        assert r["lr"] == pytest.approx(lr_at(updates, 1e-3, 1e-4, 4, 6), rel=1e-12), (i, skipped)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_latest(tmp_path):
    ckpt = tmp_path / "checkpoints"
    good = {"model/w": torch.arange(6.0).reshape(2, 3)}
    checkpoint.save(ckpt, 1, good, {"consumed_samples": 8}, keep_last=5)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_SAVE.format(root=str(ROOT), ckpt=str(ckpt))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saving"
    tmp_dir = ckpt / "step_00000002.tmp"
    deadline = time.time() + 60
    while not any(tmp_dir.glob("*.distcp")) and time.time() < deadline:  # 1.6 GB of writes under way
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert tmp_dir.exists() and not (ckpt / "step_00000002").exists()
    latest = checkpoint.latest_checkpoint(ckpt)
    assert latest.name == "step_00000001"
    loaded = {"model/w": torch.zeros(2, 3)}
    meta = checkpoint.load(latest, loaded)
    assert torch.equal(loaded["model/w"], good["model/w"]) and meta["consumed_samples"] == 8
    # the next save clears the debris and commits
    checkpoint.save(ckpt, 3, good, {"consumed_samples": 24}, keep_last=5)
    assert not tmp_dir.exists() and checkpoint.latest_checkpoint(ckpt).name == "step_00000003"


def test_a_resave_killed_between_its_renames_keeps_the_step(tmp_path):
    """Re-saving step N renames step_N aside, then the new copy in: a kill between the two leaves no step_N,
    but two complete copies. The step is still found (the new copy first), and the next save restores it."""
    ckpt = tmp_path / "c"
    for s in (1, 2):
        checkpoint.save(ckpt, s, {"model/w": torch.full((2,), float(s))}, {"consumed_samples": s}, keep_last=5)
    os.rename(ckpt / "step_00000002", ckpt / "step_00000002.old.tmp")  # killed after the first rename
    assert checkpoint.latest_checkpoint(ckpt).name == "step_00000002.old.tmp"
    new = checkpoint.save(tmp_path / "other", 2, {"model/w": torch.full((2,), 7.0)}, {"consumed_samples": 2},
                          keep_last=5)
    os.rename(new, ckpt / "step_00000002.tmp")  # the new copy, complete, not yet renamed
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step_00000001", "step_00000002.tmp"]
    checkpoint.save(ckpt, 3, {"model/w": torch.zeros(2)}, {"consumed_samples": 3}, keep_last=5)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000001", "step_00000002", "step_00000003"]
    loaded = {"model/w": torch.zeros(2)}
    checkpoint.load(ckpt / "step_00000002", loaded)
    assert torch.equal(loaded["model/w"], torch.full((2,), 7.0))


def test_keep_last_and_metadata_is_never_unpickled_freely(tmp_path):
    import pickle

    ckpt = tmp_path / "c"
    for s in range(1, 5):
        checkpoint.save(ckpt, s, {"model/w": torch.ones(2)}, {"consumed_samples": s}, keep_last=2, run_id="r")
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step_00000003", "step_00000004"]
    # a run rolled back to step 2 writes step 3 again: "latest" and keep_last go by the order of writing
    checkpoint.save(ckpt, 3, {"model/w": torch.zeros(2)}, {"consumed_samples": 3}, keep_last=1, run_id="r")
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step_00000003"]
    fresh = {"model/w": torch.ones(2)}
    checkpoint.load(checkpoint.latest_checkpoint(ckpt), fresh)
    assert torch.equal(fresh["model/w"], torch.zeros(2))  # the new step 3, not the old one

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    latest = checkpoint.latest_checkpoint(ckpt)
    (latest / ".metadata").write_bytes(pickle.dumps(Evil()))
    from megazero.errors import UserError

    with pytest.raises(UserError, match="not allowed"):
        checkpoint.load(latest, {"model/w": torch.zeros(2)})


def test_a_damaged_checkpoint_is_an_input_error(tmp_path):
    """A shard cut short or gone (a full disk, a partial copy): one line naming the checkpoint, not a trace."""
    from megazero.errors import UserError

    ckpt = checkpoint.save(tmp_path / "c", 1, {"model/w": torch.arange(4096.0)}, {"consumed_samples": 1}, keep_last=1)
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    for read in (lambda: checkpoint.load(ckpt, {"model/w": torch.zeros(4096)}),
                 lambda: checkpoint.read_model_state(ckpt)):
        with pytest.raises(UserError, match=rf"checkpoint {ckpt}: unreadable \("):
            read()
    shard.unlink()
    with pytest.raises(UserError, match=r"unreadable \(FileNotFoundError"):
        checkpoint.load(ckpt, {"model/w": torch.zeros(4096)})


def test_resume_after_a_crash_a_roll_back_and_a_changed_setting(corpus, tmp_path):
    """What long jobs meet. A crash after the last checkpoint: the resume redoes the steps after it, and
    metrics.jsonl and TensorBoard hold each step once. A roll-back to an older checkpoint: "latest" is then
    the checkpoint written last, not the highest step. A changed setting: dropout may change on a resume,
    the architecture may not (model.heads keeps every shape, so only that check can catch it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megazero.errors import UserError

    text, cache = corpus
    run_dir, config = tmp_path / "run", str(ROOT / "configs" / "tiny.yaml")
    ckpts = run_dir / "checkpoints"

    def train(steps: int, *extra: str) -> list[dict]:
        return run(config, small_overrides(text, cache, run_dir, steps=steps, **{"train.save_every": 2,
                                                                                 "train.keep_last": 3}) + list(extra))

    first = train(6)
    shutil.rmtree(ckpts / "step_00000006")  # the job died before step 6 was committed
    # a resumed job starts later than the one it resumes: TensorBoard orders event files by name, whose
    # whole-second timestamp ties within one second and then falls back to a per-process counter compared as
    # text ("10" < "9"), which a long test session reaches; a real resume is another process, seconds later
    time.sleep(1.05)
    second = train(6, "train.resume=auto", "model.dropout=0.1")
    assert [r["step"] for r in second] == [5, 6]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert losses(records) == losses(first[:4]) + losses(second)
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]

    train(4, f"train.resume={ckpts / 'step_00000002'}")  # rolled back: writes step 4 again
    assert [p.name for p in checkpoint.list_checkpoints(ckpts)] == ["step_00000002", "step_00000006",
                                                                     "step_00000004"]
    assert checkpoint.latest_checkpoint(ckpts).name == "step_00000004"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 5))

    assert train(4, "train.resume=auto", "log.pipeline_trace=true") == []  # a requeued finished job: nothing to do

    with pytest.raises(UserError, match="holds an earlier run's checkpoints"):
        train(2)  # a fresh run in the same log.dir: refused, the earlier run's checkpoints are not its to delete
    assert checkpoint.latest_checkpoint(ckpts).name == "step_00000004"
    train(2, "log.overwrite=true")  # allowed: its checkpoints replace the old ones, its logs too
    assert [p.name for p in checkpoint.list_checkpoints(ckpts)] == ["step_00000002"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]

    with pytest.raises(UserError, match=r"model\.heads is 4 there and 2 here"):
        train(6, "train.resume=auto", "model.heads=2")


def test_an_fp32_resume_of_a_bf16_checkpoint_takes_the_fp32_master_weights(corpus, tmp_path):
    """In an fp32 run the master weights are the parameters themselves: a resume must fill them from the
    checkpoint's fp32 masters, not from its bf16 model copy (stages 0 and 3 keep their buffers apart)."""
    import torch.distributed.checkpoint as dcp

    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.train.trainer import Trainer
    from megazero.parallel.topology import Grid
    from megazero.parallel.dims import ParallelDims

    text, cache = corpus
    config = str(ROOT / "configs" / "tiny.yaml")
    run(config, small_overrides(text, cache, tmp_path / "bf16", steps=3, **{"train.precision": "bf16"}))
    ckpt = checkpoint.latest_checkpoint(tmp_path / "bf16" / "checkpoints")
    stored = checkpoint.stored_tensors(ckpt)
    masters = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in stored.items()
               if k.endswith("/master")}
    dcp.load(masters, storage_reader=SafeFileSystemReader(str(ckpt)), no_dist=True)
    for stage in (0, 3):
        cfg = resolve(load_config(config, small_overrides(text, cache, tmp_path / f"fp32-{stage}", steps=3,
                                                          **{"zero.stage": stage})), 1, "cpu")
        trainer = Trainer(cfg, Grid.build(ParallelDims(tp=1, pp=1, dp=1), "cpu"), torch.device("cpu"))
        trainer.load(ckpt)
        for name, value in trainer.zero.full_parameters().items():
            master = masters[f"optim/{name}/master"]
            assert value.dtype == torch.float32 and torch.equal(value, master), (stage, name)
        assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())  # bf16 rounding shows


def test_export_of_a_trained_checkpoint_gives_megazero_logits(corpus, tmp_path):
    """`python -m megazero.export CKPT OUT` on a real run; HF GPT-2 logits equal megazero's within 1e-4."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import GPT2LMHeadModel

    from megazero.config.load import load_config
    from megazero.models.build import build_gpt

    text, cache = corpus
    overrides = small_overrides(text, cache, tmp_path / "run", steps=3, **{"model.bias": "false"})
    run(str(ROOT / "configs" / "tiny.yaml"), overrides)
    ckpt = checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints")
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "megazero.export", str(ckpt), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), overrides)
    model = build_gpt(cfg.model, seed=0)
    state = checkpoint.read_model_state(ckpt)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[n])
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)[..., : cfg.model.vocab_size]
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    bad = subprocess.run([sys.executable, "-m", "megazero.export", str(tmp_path / "nope"), str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1


def test_bf16_follows_fp32_with_fp32_master_weights(corpus, tmp_path):
    """bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per product); over a 2-layer model and
    6 steps the loss stays within 2e-2 relative of fp32. Parameters are bf16, the master copy fp32."""
    text, cache = corpus
    fp32 = run(str(ROOT / "configs" / "tiny.yaml"), small_overrides(text, cache, tmp_path / "fp32", steps=6))
    bf16 = run(str(ROOT / "configs" / "tiny.yaml"),
               small_overrides(text, cache, tmp_path / "bf16", steps=6, **{"train.precision": "bf16"}))
    for a, b in zip(losses(fp32), losses(bf16)):
        assert math.isclose(a, b, rel_tol=2e-2), (a, b)
    assert losses(bf16)[-1] < losses(bf16)[0]
    stored = checkpoint.stored_tensors(checkpoint.latest_checkpoint(tmp_path / "bf16" / "checkpoints"))
    assert all(v.properties.dtype == torch.bfloat16 for k, v in stored.items() if k.startswith("model/"))
    masters = [v for k, v in stored.items() if k.endswith("/master")]
    assert masters and all(v.properties.dtype == torch.float32 for v in masters)


def test_async_saves_equal_synchronous_saves(corpus, tmp_path):
    """train.async_save=true: the loop goes on while checkpoints are written, yet every checkpoint holds the
    state of its own step (the parameters kept changing after each save returned) and the losses are the
    synchronous run's, bit for bit."""
    text, cache = corpus
    runs = {}
    for mode in ("false", "true"):
        log = tmp_path / f"async-{mode}"
        run(str(ROOT / "configs" / "tiny.yaml"),
            small_overrides(text, cache, log, steps=6, **{"train.save_every": 2, "train.keep_last": 3,
                                                          "train.async_save": mode}))
        runs[mode] = log
    assert losses(read_metrics(runs["true"])) == losses(read_metrics(runs["false"]))
    sync, background = (checkpoint.list_checkpoints(runs[m] / "checkpoints") for m in ("false", "true"))
    assert [p.name for p in background] == [p.name for p in sync] == ["step_00000002", "step_00000004",
                                                                      "step_00000006"]
    for a, b in zip(sync, background):
        wa, wb = checkpoint.read_model_state(a), checkpoint.read_model_state(b)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), a.name
    two, six = (checkpoint.read_model_state(p) for p in (background[0], background[2]))
    assert any(not torch.equal(two[k], six[k]) for k in two)  # the saves are of different states


def test_a_run_computes_on_its_cpu_threads_and_gives_the_callers_back(corpus, tmp_path, monkeypatch):
    """launch.cpu_threads is the run's intra-op thread count (0: the node's cores over its ranks); a run started
    in-process leaves the caller's count as it was, so what runs after it is not oversubscribed."""
    from megazero.train import trainer

    seen = []
    monkeypatch.setattr(trainer.Trainer, "fit", lambda self, start: seen.append(torch.get_num_threads()) or [])
    text, cache = corpus
    before = torch.get_num_threads()
    for threads, folder in ((3, "three"), (0, "auto")):
        run(str(ROOT / "configs" / "tiny.yaml"),
            small_overrides(text, cache, tmp_path / folder, steps=1) + [f"launch.cpu_threads={threads}"])
        assert torch.get_num_threads() == before
    assert seen == [3, max(1, os.cpu_count() or 1)]  # one process: all of this node's cores


def test_save_at_end_false_writes_no_end_checkpoint_but_exit_after_and_save_every_still_save(corpus, tmp_path,
                                                                                           capsys):
    """train.save_at_end=false (benchmarks, layout-parity runs nothing resumes): the run that reaches train.steps
    writes no checkpoint; save_every's saves and each job of train.exit_after are written as before, the last
    job's at train.steps too, so a chain of jobs resumed with train.resume=auto sees the run finished (without
    that save the third job trained steps 3-4 again). train.resume=auto without exit_after is refused: a restart
    of the finished run would train its last steps again."""
    from megazero.errors import UserError

    def checkpoints(log):
        folder = log / "checkpoints"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    off = {"train.save_at_end": "false"}
    run(str(ROOT / "configs" / "tiny.yaml"), small_overrides(*corpus, tmp_path / "end", steps=4, **off))
    assert checkpoints(tmp_path / "end") == [] and len(read_metrics(tmp_path / "end")) == 4
    run(str(ROOT / "configs" / "tiny.yaml"), small_overrides(*corpus, tmp_path / "every", steps=4,
                                                             **{**off, "train.save_every": 3}))
    assert checkpoints(tmp_path / "every") == ["step_00000003"]
    chain = {**off, "train.exit_after": 2, "train.resume": "auto"}
    for saved in (["step_00000002"], ["step_00000002", "step_00000004"], ["step_00000002", "step_00000004"]):
        capsys.readouterr()
        run(str(ROOT / "configs" / "tiny.yaml"), small_overrides(*corpus, tmp_path / "exit", steps=4, **chain))
        assert checkpoints(tmp_path / "exit") == saved
    assert "is finished (step 4 of train.steps=4)" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "exit")] == [1, 2, 3, 4]
    with pytest.raises(UserError, match="train.save_at_end"):
        run(str(ROOT / "configs" / "tiny.yaml"), small_overrides(*corpus, tmp_path / "auto", steps=4,
                                                                 **{**off, "train.resume": "auto"}))
    run(str(ROOT / "configs" / "tiny.yaml"), small_overrides(*corpus, tmp_path / "default", steps=4))
    assert checkpoints(tmp_path / "default") == ["step_00000004"]
