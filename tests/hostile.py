"""Shared checks for the hostile-input suite (tests/test_hostile_*.py): an input error is one line, exit 2.

Most cases call a command's ``main(argv)`` in this process (pretrain.py's, megazero.interop.export's): no torch import
per case, so sixty cases cost seconds. Cases that need a process of their own (signals, launcher variables,
a hang) use :func:`run_process`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent


def pretrain_main(argv: Sequence[str]) -> int:
    """pretrain.py's main, in this process."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import pretrain

    return pretrain.main(list(argv))


def call(main: Callable[[list[str]], int], argv: Sequence[str], capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``main(argv)``; SystemExit (argparse) counts as its code."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(excinfo, *fragments: str) -> str:
    """A raised input error's text: one line holding every fragment."""
    text = str(excinfo.value)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return text


def assert_one_line(code: int, err: str, *fragments: str, exit_code: int = 2) -> str:
    """The documented exit code, and stderr is one line ``error: ...`` holding every fragment, no traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == exit_code, (code, err[-3000:])
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert line.startswith("error"), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def run_process(argv: Sequence[str], env: dict | None = None, timeout: float = 120,
                cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A command in its own process, torchrun's and Slurm's variables cleared unless ``env`` sets them."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith("SLURM_")}
    base["OMP_NUM_THREADS"] = "1"
    base.update(env or {})
    return subprocess.run(list(argv), capture_output=True, text=True, cwd=cwd, env=base, timeout=timeout)


class Hung(Exception):
    """The body was still running when :func:`watchdog` fired (not an OSError: no handler may mistake it)."""


@contextmanager
def watchdog(seconds: int) -> Iterator[None]:
    """Raise :class:`Hung` in this (the main) thread after ``seconds``, even inside a blocking ``open()``
    (PEP 475): a case that used to hang fails instead of hanging the suite."""
    def fire(signum, frame):
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
