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
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterable, Iterator

__all__ = [
    "Terminated",
    "UserError",
    "exit_code",
    "finished",
    "remove_stale",
    "atomic_path",
    "Staging",
    "refuse_overwrite",
    "deferred_interrupts",
    "interrupts_at_checks",
    "same_file",
    "catch_interrupts",
    "check_interrupt",
    "raise_on_interrupts",
    "interrupted",
]

_interrupted = 0  # the signal that interrupted the command (SIGINT or SIGTERM), else 0
_finished = False  # the command's outputs are in place: a signal now changes nothing


class Terminated(KeyboardInterrupt):
    """SIGTERM (what clusters and container runtimes send before they stop a job), handled like Ctrl-C."""


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


def interrupted() -> int:
    """The signal (``signal.SIGINT`` or ``SIGTERM``) that came while :func:`catch_interrupts` was active, else 0."""
    return _interrupted


def exit_code() -> int:
    """The exit status of an interrupted command: 143 after SIGTERM, 130 after Ctrl-C (128 + the signal)."""
    return 128 + int(_interrupted or signal.SIGINT)


def _raise() -> None:
    raise Terminated if _interrupted == signal.SIGTERM else KeyboardInterrupt


def check_interrupt() -> None:
    """Raise ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM) if a signal came, even one Python swallowed.

    Python raises ``KeyboardInterrupt`` wherever the program is; inside a
    weak-reference callback or a ``__del__`` it is printed and dropped. The
    flag set by :func:`catch_interrupts` survives that, and the places that
    matter (every training batch, before each output is written, before the
    outputs are renamed into place) call this.
    """
    if _interrupted and not _finished:
        _raise()


def finished() -> None:
    """Mark the command's outputs as complete and in place: a signal from now on is ignored.

    The command then exits 0, as it finished, never 130 or death by the signal.
    """
    global _finished
    _finished = True


def _on_signal(signum, frame):
    global _interrupted
    if _finished:
        return
    _interrupted = signum
    _raise()


def _heard() -> list[int]:  # SIGINT and SIGTERM; one the process was started ignoring (``cmd &``) stays ignored
    return [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]


def raise_on_interrupts() -> None:
    """Ctrl-C and SIGTERM raise ``KeyboardInterrupt`` (:class:`Terminated`) until :func:`catch_interrupts` runs."""
    if _main_thread():
        for s in _heard():
            signal.signal(s, _on_signal)


@contextlib.contextmanager
def catch_interrupts(own_process: bool = False) -> Iterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM set the flag of :func:`check_interrupt` and raise ``KeyboardInterrupt``.

    Args:
        own_process: the command is the whole process (the console script):
            on the way out both signals are ignored, so a signal during the
            interpreter's shutdown cannot turn the exit status into death by
            the signal.
    """
    global _interrupted, _finished
    _interrupted, _finished = 0, False
    if not _main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in _heard()}
    hook = sys.unraisablehook

    def quiet(unraisable):  # an interrupt that landed in a callback: the flag carries it, not a traceback
        if not issubclass(unraisable.exc_type, KeyboardInterrupt):
            hook(unraisable)

    sys.unraisablehook = quiet
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_IGN if own_process else handler)
        sys.unraisablehook = hook


@contextlib.contextmanager
def _handled_by(handler) -> Iterator[None]:
    """Ctrl-C and SIGTERM go to ``handler`` while the block runs (in the main thread; elsewhere unchanged)."""
    if not _main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in _heard()}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while the block runs; raise ``KeyboardInterrupt`` after it if one came."""
    got = []

    def hold(signum, frame):
        global _interrupted
        if not _finished:
            _interrupted = signum
            got.append(signum)

    with _handled_by(hold):
        yield
    if got and not _finished:
        _raise()


def _at_checks(signum, frame):
    global _interrupted
    if _finished:
        return
    again = bool(_interrupted)
    _interrupted = signum
    if again:
        _raise()


@contextlib.contextmanager
def interrupts_at_checks() -> Iterator[None]:
    """While the block runs, a first Ctrl-C or SIGTERM only sets the flag; :func:`check_interrupt` raises it.

    For a training loop that calls :func:`check_interrupt` at every batch's
    end: the interrupt then never lands inside the framework's own code in
    the middle of a step, where unwinding frees what the framework's
    threads still use (TensorFlow can then die of a corrupted heap instead
    of exiting 130 or 143). A second signal raises at once, for a step that
    never ends. The flag, if set, is raised when the block ends.
    """
    with _handled_by(_at_checks):
        yield
    check_interrupt()


def remove_stale(out: str) -> list[str]:
    """Remove the staging folders in ``out`` of runs that were killed (their process is gone).

    Only folders named ``.finefreeze-tmp-PID`` that hold the mark a staging
    folder writes first (naming the same PID), and whose PID no longer runs,
    are removed: never a file, a link, a folder of the user's that happens
    to have such a name, or the folder of a live process.

    Returns:
        The names removed.
    """
    removed = []
    for name in sorted(os.listdir(out)):
        m = re.fullmatch(r"\.finefreeze-tmp-(\d+)", name)
        path = os.path.join(out, name)
        if m is None or os.path.islink(path) or not os.path.isdir(path) or int(m.group(1)) == os.getpid():
            continue
        if _alive(int(m.group(1))) or not _ours(path, m.group(1)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


_MARK = ".finefreeze-staging"


def _ours(path: str, pid: str) -> bool:
    """Whether ``path`` holds the mark a staging folder of process ``pid`` writes first."""
    mark = os.path.join(path, _MARK)
    try:
        if os.path.islink(mark):
            return False
        with open(mark) as f:
            return f.read().strip() == pid
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def check_output(path: str, *, force: bool = False, flag: str = "--force") -> None:
    """Raise :class:`UserError` unless a command may write the file ``path`` (what :func:`atomic_path` refuses)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise UserError(f"{path!r} is a directory; give a file name")
    if os.path.exists(path) and not force:
        raise UserError(f"{path!r} exists; pass {flag} to replace it")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UserError(f"the folder of {path!r} does not exist")


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
    check_output(path, force=force, flag=flag)
    folder, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    tmp = os.path.join(folder, f".{stem}.tmp-{os.getpid()}{ext}")
    try:
        yield tmp
        _fsync(tmp)
        check_interrupt()
        with deferred_interrupts():
            os.replace(tmp, path)
            finished()
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
        self.check(self.out, self.names, force=force, inputs=inputs, marker=marker)
        self.created = not os.path.exists(self.out)
        self.dir = os.path.join(self.out, f".finefreeze-tmp-{os.getpid()}")
        self.committed = False
        try:  # a signal while the folders are made comes after them, and takes them away
            with deferred_interrupts():
                os.makedirs(self.out, exist_ok=True)
                #: staging folders of killed runs found in ``out`` and removed
                self.removed = remove_stale(self.out)
                os.mkdir(self.dir)
                with open(os.path.join(self.dir, _MARK), "w") as f:  # what remove_stale recognises as ours
                    f.write(f"{os.getpid()}\n")
        except KeyboardInterrupt:
            self.cleanup()
            raise

    @staticmethod
    def check(
        out: str, names: Iterable[str], *, force: bool, inputs: Iterable[str | None], marker: str | None = None
    ) -> None:
        """Raise :class:`UserError` if a run may not write ``names`` in ``out`` (what ``Staging`` refuses)."""
        if os.path.exists(out) and not os.path.isdir(out):
            raise UserError(f"--out {out!r} is a file, not a folder; choose a folder")
        used = [n for n in names if os.path.lexists(os.path.join(out, n))]
        refuse_overwrite([os.path.join(out, n) for n in used], inputs, "finetune")
        if used and marker is not None and marker not in used:
            # names like ours, but no run of ours wrote them: never replace them, not even with --force
            raise UserError(
                f"--out {out!r} holds {', '.join(used)} that no finefreeze run wrote (no {marker}); choose another --out"
            )
        if used and not force:
            raise UserError(
                f"--out {out!r} holds files of another run ({', '.join(used)}); "
                "pass --force to replace them, or choose another --out"
            )

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
            finished()
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
