"""Ctrl-C held back while a worker call changes its state (docs/architecture.md, section 9).

CPython raises KeyboardInterrupt only on the main thread, from the Python-level SIGINT
handler, run between two bytecodes. `deferred()` makes a section of main-thread code one step
for it: the outermost section swaps the handler for one that only records the signal, and on
leaving puts the handler back and, if a SIGINT came, raises it again (`signal.raise_signal`),
so the engine's own handler (or Python's, which raises KeyboardInterrupt) runs right after the
section, with the section's work whole. Blocking `pthread_sigmask` would not do: the kernel
then hands the process's SIGINT to another thread, whose C handler still trips the main
thread's Python handler.

Off the main thread, where no KeyboardInterrupt is raised, it does nothing; nor where the
handler is not a Python callable (ignored, the OS default, or installed from C), or cannot be
set (a subinterpreter). Sections nest: only the outermost swaps the handler. Other signals'
handlers still run inside a section.
"""

from __future__ import annotations

# The C module under `signal`: the same calls without its wrappers, which turn a handler into
# an enum through a ValueError raised and caught each call (about 2 us, most of a section's cost).
import _signal as signal
import threading

_depth = 0  # sections the main thread is in
_previous = None  # the handler the outermost section replaced, while it is replaced
_recorded = False  # a SIGINT came during the outermost section


def _record(signum, frame) -> None:
    global _recorded
    _recorded = True


class _Deferred:
    """`deferred()`: holds no state of its own (the main thread's is this module's)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _depth, _previous
        if threading.current_thread() is not threading.main_thread():
            return
        if _depth:
            _depth += 1
            return
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not _record:
            try:
                # Runs a SIGINT already pending first, with the old handler: that one raises
                # here, before the section, which then never began.
                signal.signal(signal.SIGINT, _record)
            except ValueError:  # not the main interpreter: no handler of ours
                pass
            else:
                _previous = handler
        _depth = 1

    def __exit__(self, *exc: object) -> None:
        global _depth, _previous, _recorded
        if threading.current_thread() is not threading.main_thread():
            return
        _depth -= 1
        previous = _previous
        if _depth or previous is None:
            return
        _previous = None
        try:
            if signal.getsignal(signal.SIGINT) is _record:  # unless the section's code set another
                signal.signal(signal.SIGINT, previous)  # runs a SIGINT that came just now with `_record`
        finally:
            if _recorded:
                _recorded = False
                signal.raise_signal(signal.SIGINT)  # to the handler put back, at once


_DEFERRED = _Deferred()


def deferred() -> _Deferred:
    """A context manager: inside it, a SIGINT on the main thread waits for its end."""
    return _DEFERRED
