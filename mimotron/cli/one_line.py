"""One-line failure reports for the file-writing commands (``export``, ``plot``).

A command that fails prints one line, ``mimotron <command>: <what went wrong>``, and
exits non-zero: 2 for a usage problem (a path that is not what it should be, an output
folder it cannot write), 1 for anything else. With the environment variable
``MIMOTRON_DEBUG=1`` (what ``--debug`` sets) the full traceback is printed first.
"""

from __future__ import annotations

import os
import sys
import traceback

DEBUG_ENV = "MIMOTRON_DEBUG"
EXIT_FAILED, EXIT_USAGE = 1, 2


def debug_enabled() -> bool:
    """Whether ``MIMOTRON_DEBUG`` asks for full tracebacks (any value but ``""``/``0``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report_error(command: str, exc: BaseException, code: int, show_type: bool = True) -> int:
    """Print ``exc`` as one line (the traceback first under ``MIMOTRON_DEBUG``); ``code``.

    Args:
        command: the subcommand, for the prefix.
        exc: the exception being handled.
        code: the exit code to return.
        show_type: prefix the exception's type, which is part of what an unexpected
            error says (``OSError: [Errno 28] No space left on device``); off for
            messages written for the user (``ValueError``, ``CheckpointError``).

    Returns:
        ``code``.
    """
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
    text = f"{type(exc).__name__}: {exc}" if show_type else str(exc)
    # Multi-line messages (a list of damaged files) still make one line.
    print(f"mimotron {command}: {' '.join(text.split())}", file=sys.stderr, flush=True)
    return code
