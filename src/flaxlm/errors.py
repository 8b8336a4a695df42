"""The one exception type a user should ever see from flaxlm.

Every problem a user can fix (a missing file, a setting out of range, a corpus too small) is
raised as `FlaxlmError` with a one-paragraph message that names the setting or file and says how
to fix it. The command-line entrypoints print that message alone, without a traceback, and exit
with the error's `exit_code`. Beside it, the checks that turn what the operating system or
PyYAML says about a user's file or folder into such a message.
"""

import os
import tempfile


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


def writable_dir(path: str, setting: str, advice: str) -> str:
    """`path` as an absolute directory, created if missing, checked writable by creating a file
    in it; otherwise a FlaxlmError naming `setting` and giving `advice`."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise FlaxlmError(f"{setting}={path} is not a directory flaxlm can write to "
                          f"({err.strerror or err}). {advice}") from None
    return path


def causes(err: BaseException | None):
    """`err` and the exceptions it was raised from or while handling, nearest first: where a
    library wraps what went wrong (XLA's compiler, a file system) in errors of its own."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def first_line(err: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut at `limit` characters (its type's name if
    it has none): enough to say what went wrong in a one-line warning or a paragraph."""
    lines = str(err).strip().splitlines()
    return lines[0][:limit] if lines else type(err).__name__


def yaml_error_text(err: Exception) -> str:
    """Where a YAML file is broken and why, in one line (PyYAML spreads it over four: the
    file, what it was reading, the problem and its position, 0-based lines made 1-based)."""
    problem_mark = getattr(err, "problem_mark", None)
    if problem_mark is None:
        return " ".join(str(err).split())
    text = (f"{problem_mark.name}, line {problem_mark.line + 1}, column "
            f"{problem_mark.column + 1}: {err.problem}")
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and context_mark is not None:
        text += (f" ({context} that starts at line {context_mark.line + 1}, column "
                 f"{context_mark.column + 1})")
    elif context:
        text += f" ({context})"
    return text
