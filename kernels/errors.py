"""The kernels' own error: a kernel asked for (``kernels.adam``, ``kernels.attention``) that cannot run here.

The kernels sit on the lowest floor and import nothing from the packages above them, so they raise this
instead of megazero's ``UserError``. Its message is already the one line a user reads (the key, the value,
what is valid here); the run's entry point turns it into a ``UserError`` (exit code 2) with
``megazero.errors.as_user_error``. A ``ValueError``, as a kernel library's bad argument is.
"""


class KernelChoiceError(ValueError):
    """A ``kernels.*`` value that names no implementation, or one this machine or model cannot run."""
