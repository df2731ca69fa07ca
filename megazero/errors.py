"""Errors meant for the person running megazero, not for a debugger, and the ways a run stops early.

The one-line form of a bad value (:func:`invalid`) and how an untrusted value is echoed in it (:func:`shown`)
live here, below every module that raises them, so config, rules and data import them without a circle.

pretrain.py prints each as one line, without a traceback, and exits with its code:

=====  ==========================================================================
code   meaning
=====  ==========================================================================
0      the run finished (or stopped at ``train.exit_after``, saved)
2      an input error (:class:`UserError`): config, data, checkpoint, environment
3      the loss or the gradients went non-finite (:class:`NonFiniteStop`), or the loss spiked
       (:class:`LossSpikeStop`); not saved
4      a collective did not complete within ``launch.timeout_minutes`` (:class:`CollectiveTimeout`)
128+N  stopped by signal N (SIGTERM 143, SIGINT 130, SIGUSR1 138) after saving (:class:`Preempted`)
=====  ==========================================================================
"""
from __future__ import annotations

from typing import Any, Iterator

from megazero.kernels.errors import UserError  # noqa: F401 (defined on the lowest floor: the kernels raise it too)

SHOWN_CHARS = 60  # values echoed in messages are cut to about this many characters


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, never walking more of the value than it shows.

    Error messages echo untrusted values: a 100 MB string, a list of a million items or a 5000-digit
    integer must neither flood the terminal nor take time (``repr`` of an int past 4300 digits raises).
    """
    out: list[str] = []
    budget = [limit]
    for piece in _pieces(value, budget):
        out.append(piece)
        if budget[0] <= 0:
            return "".join(out)[:limit] + "..."
    return "".join(out)


def shown_name(text: str, limit: int = 200) -> str:
    """A file name or ``--set`` key for a message: as given when short and printable, else ``shown``."""
    return text if len(text) <= limit and text.isprintable() else shown(text, limit)


def _pieces(value: Any, budget: list[int]) -> Iterator[str]:
    """repr fragments of ``value``, lazily, charging each against ``budget``."""
    if isinstance(value, (list, tuple, dict)):
        is_dict = isinstance(value, dict)
        opening, closing = ("{", "}") if is_dict else ("[", "]") if isinstance(value, list) else ("(", ")")
        budget[0] -= 1
        yield opening
        for i, item in enumerate(value.items() if is_dict else value):
            if budget[0] <= 0:
                return
            if i:
                budget[0] -= 2
                yield ", "
            if is_dict:
                yield from _pieces(item[0], budget)
                budget[0] -= 2
                yield ": "
                item = item[1]
            yield from _pieces(item, budget)
        budget[0] -= 1
        yield closing
        return
    if isinstance(value, str):
        text = repr(value[:budget[0] + 1])
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * budget[0]:
        text = f"<an integer of {len(str(abs(value))) if value.bit_length() < 14000 else 'thousands of'} digits>"
    else:
        text = repr(value)
    budget[0] -= len(text)
    yield text


def invalid(source: str | None, key: str, value: Any, valid: str) -> UserError:
    """One line: where (a file, ``--set``; None: not known here), the key, the value (cut short: values are
    untrusted and may be huge), what is valid."""
    where = f"{source}: " if source else ""
    return UserError(f"{where}{key}={shown(value)} is invalid; {valid}")


class RunStopped(Exception):
    """A run that ends before train.steps for a reason it reports in one line, with its own exit code."""

    exit_code = 1
    is_error = True  # printed as "error: ..." (else as a notice on stdout)


class NonFiniteStop(RunStopped):
    """The loss or a gradient went non-finite (or too many updates in a row were skipped): the run stops
    before anything is saved, so the last good checkpoint stays the latest."""

    exit_code = 3


class LossSpikeStop(RunStopped):
    """A loss far above the recent ones (train.on_spike) that the run does not, or cannot, roll back from:
    it stops before saving, as for a non-finite loss."""

    exit_code = 3


class CollectiveTimeout(RunStopped):
    """A collective waited past launch.timeout_minutes: some rank stopped taking part."""

    exit_code = 4


class Preempted(RunStopped):
    """A stop signal: the step finished, a checkpoint was saved, and the run exits 128 + the signal."""

    is_error = False

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
