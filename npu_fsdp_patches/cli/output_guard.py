"""The CLI never ends in a traceback for an output it cannot write (docs/cli.md, exit codes).

A closed pipe (``| head``) ends quietly with 141, as a shell reports a command stopped by SIGPIPE; any
other failure to write stdout (a full disk, a closed or read-only descriptor) is one line on stderr
and exit code 2, argparse's usage code, never 1 ("a patch failed"); Ctrl-C is one line and 130.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

#: the exit code when stdout's reader went away (128 + SIGPIPE, as a shell reports it)
EXIT_BROKEN_PIPE = 141
#: stdout cannot be written, or an argument is unusable: argparse's usage code (report's too)
EXIT_USAGE_OR_IO = 2
#: stopped with Ctrl-C (128 + SIGINT, as a shell reports it)
EXIT_INTERRUPTED = 130


class _OutputError(Exception):
    """Writing the command's output to stdout failed; ``__cause__`` is the OSError."""


class _Guarded:
    """``sys.stdout`` or ``sys.stderr`` while a command runs. On stdout a failed write or flush raises
    :class:`_OutputError`, so guarded tells a failure to print apart from any other OSError of the
    command; on stderr (or a stream that is None: closed at start) it is dropped, as nothing could
    report it. A character the encoding lacks (a path's undecodable byte) is written escaped."""

    def __init__(self, stream, drop_errors: bool) -> None:
        self._stream, self._drop = stream, drop_errors

    def write(self, text: str) -> int:
        try:
            if self._stream is None:
                return len(text)
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(self._stream, "encoding", None) or "utf-8"
                return self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        except OSError as exc:
            if self._drop:
                return len(text)
            raise _OutputError() from exc

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as exc:
            if not self._drop:
                raise _OutputError() from exc

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _say(text: str) -> None:
    """One line on stderr, if there is a stderr that can take it."""
    try:
        if sys.stderr is not None:
            sys.stderr.write(f"npu-fsdp-patches: {text}\n")
            sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _silence(stream) -> None:
    """Point the stream's descriptor at devnull, so the interpreter's final flush of what is still
    buffered cannot fail again (the Python docs' recipe, signal module, "Note on SIGPIPE")."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):   # not a file (io.StringIO in a test): nothing flushes it
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def guarded(command: Callable[[], int]) -> int:
    """``command()``'s exit code; an output it cannot write, or Ctrl-C, gives one line and its code."""
    if sys.stdout is None:   # started with stdout closed (``>&-``): Python made no stream for it
        _say("cannot write to stdout: it is closed")
        return EXIT_USAGE_OR_IO
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Guarded(stdout, drop_errors=False), _Guarded(stderr, drop_errors=True)
    try:
        try:
            code = command()
        except SystemExit:   # argparse: --help, --version, a usage error; what it printed must get out
            sys.stdout.flush()
            raise
        sys.stdout.flush()   # inside the try: a closed pipe or a full disk fails here, not at exit
        return code
    except _OutputError as exc:
        _silence(stdout)
        if isinstance(exc.__cause__, BrokenPipeError):
            return EXIT_BROKEN_PIPE
        cause = exc.__cause__
        _say(f"cannot write to stdout: {cause.strerror or cause}")
        return EXIT_USAGE_OR_IO
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    finally:
        sys.stdout, sys.stderr = stdout, stderr
