"""The project's one input error, :class:`UserError`, defined on the lowest floor so that every floor can raise it.

The kernels refuse a ``kernels.*`` value they cannot run (no CUDA, a head dim past the Triton kernel's) with
it; ``megazero.errors`` re-exports it beside the other ways a run ends, and the CLI prints its one line and
exits 2. Nothing here imports torch, so loading a config that names it stays light.
"""


class UserError(Exception):
    """A bad config value, a missing file, a corrupt dataset: anything the user can fix.

    The message is one line that names the key or path, the bad value and what
    would be valid. The CLI prints it and exits with code 2, without a traceback.
    """
