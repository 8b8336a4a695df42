"""The one exception type a user should ever see from flaxlm.

Every problem a user can fix (a missing file, a setting out of range, a corpus too small) is
raised as `FlaxlmError` with a one-paragraph message that names the setting or file and says how
to fix it. The command-line entrypoints print that message alone, without a traceback, and exit
with the error's `exit_code`.
"""


class FlaxlmError(Exception):
    """A problem with the user's input or configuration, explained in its message."""

    exit_code = 2


# EX_UNAVAILABLE (sysexits.h): a peer is unavailable; nothing in this host's input is wrong, so
# a scheduler may retry the job as it stands.
PEER_EXIT_CODE = 69


class PeerError(FlaxlmError):
    """Another process of a multi-host run never came, is unreachable, died or stopped
    answering: the same command on every host starts (or resumes) the run again."""

    exit_code = PEER_EXIT_CODE
