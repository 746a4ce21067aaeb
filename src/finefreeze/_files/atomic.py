"""Outputs that are never half-written: temporary names, ``os.replace``, no writes over inputs.

Every file a command writes is first written under a temporary name in the
directory it will live in, flushed to disk, then renamed into place with
``os.replace`` (atomic on POSIX and Windows). An interrupt or an error at any
moment leaves either the previous complete file or the new complete one, and
the temporary files are removed on the way out.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterable, Iterator

__all__ = [
    "UserError",
    "atomic_path",
    "Staging",
    "refuse_overwrite",
    "deferred_interrupts",
    "same_file",
    "catch_interrupts",
    "check_interrupt",
    "interrupted",
]

_interrupted = False


class UserError(Exception):
    """A mistake in a command line or its files (or an unusable output place): exit 2, one line."""


def same_file(a: str, b: str) -> bool:
    """Whether two paths name the same file (or would, once created)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def refuse_overwrite(outputs: Iterable[str], inputs: Iterable[str | None], command: str) -> None:
    """Raise :class:`UserError` when an output path is one of the command's inputs."""
    inputs = [i for i in inputs if i is not None and os.path.exists(i)]
    for out in outputs:
        for inp in inputs:
            if same_file(out, inp):
                raise UserError(f"{command} would write {out!r} over its own input {inp!r}; write the output elsewhere")


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def interrupted() -> bool:
    """Whether Ctrl-C came while :func:`catch_interrupts` was active."""
    return _interrupted


def check_interrupt() -> None:
    """Raise ``KeyboardInterrupt`` if Ctrl-C came, even one Python swallowed on the way.

    Python raises ``KeyboardInterrupt`` wherever the program is; inside a
    weak-reference callback or a ``__del__`` it is printed and dropped. The
    flag set by :func:`catch_interrupts` survives that, and the places that
    matter (every training batch, before each output is written, before the
    outputs are renamed into place) call this.
    """
    if _interrupted:
        raise KeyboardInterrupt


def _on_sigint(signum, frame):
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def catch_interrupts() -> Iterator[None]:
    """Ctrl-C (SIGINT) sets the flag of :func:`check_interrupt` and raises ``KeyboardInterrupt``."""
    global _interrupted
    _interrupted = False
    if not _main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    hook = sys.unraisablehook

    def quiet(unraisable):  # a Ctrl-C that landed in a callback: the flag carries it, not a traceback
        if not issubclass(unraisable.exc_type, KeyboardInterrupt):
            hook(unraisable)

    sys.unraisablehook = quiet
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) while the block runs; raise ``KeyboardInterrupt`` after it if one came."""
    if not _main_thread():
        yield
        return
    got = []

    def hold(signum, frame):
        global _interrupted
        _interrupted = True
        got.append(True)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if got:
        raise KeyboardInterrupt


@contextlib.contextmanager
def atomic_path(path: str, *, force: bool = False, flag: str = "--force") -> Iterator[str]:
    """A temporary path next to ``path``; renamed onto ``path`` if the block succeeds.

    Args:
        path: the file to write.
        force: replace an existing ``path`` (else :class:`UserError` naming ``flag``).
        flag: the option that allows replacing, for the message.

    Yields:
        The temporary path to write (same directory, same extension).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise UserError(f"{path!r} is a directory; give a file name")
    if os.path.exists(path) and not force:
        raise UserError(f"{path!r} exists; pass {flag} to replace it")
    folder, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"the folder of {path!r} does not exist")
    stem, ext = os.path.splitext(name)
    tmp = os.path.join(folder, f".{stem}.tmp-{os.getpid()}{ext}")
    try:
        yield tmp
        _fsync(tmp)
        check_interrupt()
        with deferred_interrupts():
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class Staging:
    """A hidden folder inside ``out`` where a run writes; :meth:`commit` renames its files into ``out``.

    Args:
        out: the output folder (created if missing; removed again on failure
            when this run created it and left it empty).
        names: every name a run may write in ``out`` (files or folders).
        force: allow replacing a previous run's files (else :class:`UserError`
            naming ``--force``).
        inputs: the command's input files; none of them may be replaced.
        marker: a name every complete run writes; a folder holding some of
            ``names`` but not the marker holds someone else's files, which
            are refused even with ``force``.
    """

    def __init__(
        self, out: str, names: Iterable[str], *, force: bool, inputs: Iterable[str | None], marker: str | None = None
    ):
        self.out = os.fspath(out)
        self.names = list(names)
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise UserError(f"--out {self.out!r} is a file, not a folder; choose a folder")
        used = [n for n in self.names if os.path.lexists(os.path.join(self.out, n))]
        refuse_overwrite([os.path.join(self.out, n) for n in used], inputs, "finetune")
        if used and marker is not None and marker not in used:
            # names like ours, but no run of ours wrote them: never replace them, not even with --force
            raise UserError(
                f"--out {self.out!r} holds {', '.join(used)} that no finefreeze run wrote (no {marker}); "
                "choose another --out"
            )
        if used and not force:
            raise UserError(
                f"--out {self.out!r} holds files of another run ({', '.join(used)}); "
                "pass --force to replace them, or choose another --out"
            )
        self.created = not os.path.exists(self.out)
        os.makedirs(self.out, exist_ok=True)
        self.dir = os.path.join(self.out, f".finefreeze-tmp-{os.getpid()}")
        os.mkdir(self.dir)
        self.committed = False

    def path(self, name: str) -> str:
        """Where to write ``name`` while the run is in progress."""
        return os.path.join(self.dir, name)

    def commit(self) -> None:
        """Move every written name into ``out`` (each rename atomic), drop stale ones of a previous run."""
        check_interrupt()
        with deferred_interrupts():
            trash = os.path.join(self.dir, ".replaced")
            os.mkdir(trash)
            for name in self.names:
                new, final = self.path(name), os.path.join(self.out, name)
                if os.path.isfile(new):
                    _fsync(new)
                if os.path.isdir(final) and not os.path.islink(final):
                    os.replace(final, os.path.join(trash, name))  # a folder cannot be replaced in one rename
                if os.path.lexists(new):
                    os.replace(new, final)
                elif os.path.lexists(final):
                    os.replace(final, os.path.join(trash, name))  # stale: a previous run wrote it, this one did not
            self.committed = True
            shutil.rmtree(self.dir, ignore_errors=True)

    def cleanup(self) -> None:
        """Remove the staging folder (and ``out`` if this run created it and it stayed empty)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.created:
            with contextlib.suppress(OSError):
                os.rmdir(self.out)

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
