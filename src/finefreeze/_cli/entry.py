"""The ``finefreeze`` console script (and ``python -m finefreeze``): signals are the command's from its first step.

Loading the command line (its parser, numpy) takes about 0.2 s. Ctrl-C or
SIGTERM then would end in Python's own traceback, or in death by the signal
with nothing said; here either ends as the command's interrupt does: one
line, exit 130 or 143, and nothing was written yet.
"""

from __future__ import annotations

import os
import sys

from finefreeze._files import atomic  # the standard library only

__all__ = ["main"]


def main() -> int:
    """Run ``finefreeze`` with the process's arguments; returns the exit code (``commands.main``'s)."""
    atomic.raise_on_interrupts()  # ``commands.main`` takes them over once it runs
    try:
        from finefreeze._cli.commands import main as command
    except KeyboardInterrupt as e:
        how = " by SIGTERM" if isinstance(e, atomic.Terminated) else ""
        print(f"finefreeze: interrupted{how} while it loaded; nothing was written", file=sys.stderr)
        sys.stderr.flush()
        os._exit(atomic.exit_code())
    return command()
