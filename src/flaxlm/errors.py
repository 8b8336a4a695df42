"""The one exception type a user should ever see from flaxlm.

Every problem a user can fix (a missing file, a setting out of range, a corpus too small) is
raised as `FlaxlmError` with a one-paragraph message that names the setting or file and says how
to fix it. The command-line entrypoints print that message alone, without a traceback.
"""


class FlaxlmError(Exception):
    """A problem with the user's input or configuration, explained in its message."""
