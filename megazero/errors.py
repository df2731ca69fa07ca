"""Errors meant for the person running megazero, not for a debugger."""


class UserError(Exception):
    """A bad config value, a missing file, a corrupt dataset: anything the user can fix.

    The message is one line that names the key or path, the bad value and what
    would be valid. The CLI prints it and exits with code 2, without a traceback.
    """
