"""A process whose output reader goes away (its scripts.run runner killed, a `| tee` stopped, a closed terminal)
goes on: its stdout's file descriptor is pointed at /dev/null. Without torch: scripts.run, whose --plan never imports
it, uses point_at_devnull too."""

import errno
import os
import sys


def point_at_devnull(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null (same fd): a later write, or the interpreter's last flush,
    cannot fail again on a stdout that is gone or full."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


class _OutputThatSurvivesItsReader:
    """A text stream whose writes outlive their reader: see survive_lost_output."""

    LOST = (errno.EPIPE, errno.EIO)  # a pipe with no reader; a terminal that was closed

    def __init__(self, stream):
        self._stream = stream

    def _lost(self, e: OSError) -> None:
        if e.errno not in self.LOST:
            raise e
        point_at_devnull(self._stream)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._lost(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._lost(e)
            self._stream.flush()  # the text it held goes to /dev/null

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_lost_output(stream):
    """``stream`` (a text file with a fileno), made to outlive its reader: a write that fails because nobody reads
    any more (EPIPE: a killed scripts.run runner or `| tee`; EIO: a closed terminal) points the file descriptor at
    /dev/null and the run goes on, where it would die on its next progress line (before it could save, even after
    the SIGTERM scripts.run's dying runner sends it). Any other write error (a full disk) still raises."""
    return _OutputThatSurvivesItsReader(stream)


def keep_running_without_output() -> None:
    """sys.stdout and sys.stderr (print0, tqdm, tracebacks) outlive their reader, for a long run's entry point. One
    that the process started without (its descriptor closed: `>&-`; Python then sets it to None, which print()
    skips but tqdm.write and .write() calls do not) writes to /dev/null."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            stream = open(os.devnull, "w", encoding="utf-8")
        if not isinstance(stream, _OutputThatSurvivesItsReader):
            setattr(sys, name, survive_lost_output(stream))
