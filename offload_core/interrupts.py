"""Ctrl-C held back while a worker call changes its state (docs/architecture.md, section 9).

`deferred()` makes a section of main-thread code one step for SIGINT and SIGTERM: the outermost
section swaps their Python handlers for one that only records the signal, and on leaving puts
them back and raises what came (`signal.raise_signal`), so the engine's handler (or Python's
KeyboardInterrupt) runs right after the section. Blocking with `pthread_sigmask` would not do:
the kernel would hand SIGINT to another thread, whose C handler still trips the main thread's
Python handler. Off the main thread, or for a handler that is not a Python callable, it does nothing.
"""

from __future__ import annotations

# The C module under `signal`: the same calls without its wrappers, which turn a handler into
# an enum through a ValueError raised and caught each call (about 2 us, most of a section's cost).
import _signal as signal
import os
import sys
import threading

HELD = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name))
_depth = 0  # sections the main thread is in
_outer = None  # the frame that entered the outermost section, while one is open
_previous: dict = {}  # signal -> the handler the outermost section replaced, while replaced
_recorded: list = []  # signals that came during the outermost section, in order


def _inside(frame) -> bool:
    """Whether `frame` runs inside the open outermost section (its frame is on the stack)."""
    while frame is not None:
        if frame is _outer:
            return True
        frame = frame.f_back
    return False


def _record(signum, frame) -> None:
    if _outer is not None and _inside(frame):
        if signum not in _recorded:
            _recorded.append(signum)
        return
    # No live section holds it back (one's end was cut short): the handler it replaced, now.
    handler = _previous.get(signum, signal.default_int_handler if signum == signal.SIGINT else None)
    _release()
    if callable(handler) and handler is not _record:
        handler(signum, frame)


def _release() -> None:
    """Put the replaced handlers back, forget the section, and raise what came meanwhile."""
    global _depth, _outer
    _depth, _outer = 0, None
    recorded = list(_recorded)
    _recorded.clear()
    try:
        for sig, handler in list(_previous.items()):
            if signal.getsignal(sig) is _record:  # unless the section's code set another
                signal.signal(sig, handler)  # runs a signal that came just now with `_record`
            _previous.pop(sig, None)
    finally:
        for sig in recorded:
            signal.raise_signal(sig)  # to the handler put back, at once


def _after_fork_in_child() -> None:
    """A child forked inside a section (by another thread) gets the handlers back."""
    if _previous or _depth:
        _recorded.clear()
        _release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Deferred:
    """`deferred()`: holds no state of its own (the main thread's is this module's)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _depth, _outer
        if threading.current_thread() is not threading.main_thread():
            return
        caller = sys._getframe(1)
        if _depth:
            if _inside(caller):
                _depth += 1
                return
            _release()  # left by a section whose end was cut short
        _outer, _depth = caller, 1
        for sig in HELD:
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not _record:
                _previous[sig] = handler  # first: a handler put back must be known before it is replaced
                try:
                    # Runs a signal already pending first, with the old handler: that one
                    # raises here, before the section began.
                    signal.signal(sig, _record)
                except ValueError:  # not the main interpreter: no handler of ours
                    _previous.pop(sig, None)

    def __exit__(self, *exc: object) -> None:
        global _depth
        if threading.current_thread() is not threading.main_thread() or not _depth:
            return
        _depth -= 1
        if not _depth:
            _release()


_DEFERRED = _Deferred()


def deferred() -> _Deferred:
    """A context manager: inside it, a SIGINT (or SIGTERM) on the main thread waits for its end."""
    return _DEFERRED
