"""Errors meant for the person running megazero, not for a debugger, and the ways a run stops early.

pretrain.py prints each as one line, without a traceback, and exits with its code:

=====  ==========================================================================
code   meaning
=====  ==========================================================================
0      the run finished (or stopped at ``train.exit_after``, saved)
2      an input error (:class:`UserError`): config, data, checkpoint, environment
3      the loss or the gradients went non-finite (:class:`NonFiniteStop`); not saved
4      a collective did not complete within ``launch.timeout_minutes`` (:class:`CollectiveTimeout`)
128+N  stopped by signal N (SIGTERM 143, SIGINT 130, SIGUSR1 138) after saving (:class:`Preempted`)
=====  ==========================================================================
"""


class UserError(Exception):
    """A bad config value, a missing file, a corrupt dataset: anything the user can fix.

    The message is one line that names the key or path, the bad value and what
    would be valid. The CLI prints it and exits with code 2, without a traceback.
    """


class RunStopped(Exception):
    """A run that ends before train.steps for a reason it reports in one line, with its own exit code."""

    exit_code = 1
    is_error = True  # printed as "error: ..." (else as a notice on stdout)


class NonFiniteStop(RunStopped):
    """The loss or a gradient went non-finite (or too many updates in a row were skipped): the run stops
    before anything is saved, so the last good checkpoint stays the latest."""

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
