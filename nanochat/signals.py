"""
Ctrl-C, SIGTERM and a STOP file as a stop request, which the training loop and the evaluations poll: once its start-up
is done a run stops within seconds at any time (an evaluation included) and saves its checkpoint instead of dying
mid-step (during the start-up a signal ends it at once: nothing was trained yet, nothing saved is touched). The file
serves where a signal cannot end the run cleanly: torchrun, once signalled itself, exits 1 whatever its workers did.
"""

import os
import signal
import contextlib

from nanochat.distributed import all_reduce_max


class Interrupted(Exception):
    """A stop was requested (Ctrl-C, SIGTERM or the STOP file) while a long operation polled stop_point()."""


_stop_signal, _stop_file, _announced = None, None, False


def install_stop_handlers(stop_file=None):
    """Ctrl-C and SIGTERM request a stop; so does creating stop_file, which the first poll that finds it removes."""
    global _stop_file
    def request_stop(signum, frame):  # SIGTERM is said when the run sees it (torchrun's, to a rank whose peer died: no)
        global _stop_signal, _announced
        if signum == signal.SIGINT and _stop_signal is not None:  # Ctrl-C again: now (saved checkpoints are whole)
            os.write(2, b"Ctrl-C again: stopping now, without saving\n")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        _stop_signal = _stop_signal or signum
        if signum == signal.SIGINT and not _announced:  # at once: a step (the first compiles) may take minutes
            os.write(2, b"received Ctrl-C: stopping after this step or evaluation batch, with a save (Ctrl-C again: now)\n")
            _announced = True
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    _stop_file = stop_file


def stop_requested():
    global _stop_signal, _announced
    if _stop_signal is None and _stop_file is not None and os.path.exists(_stop_file):
        with contextlib.suppress(FileNotFoundError):  # another rank may have removed it first
            os.remove(_stop_file)  # a resume must not stop at once
        print(f"found {_stop_file}: stopping at the next step or evaluation batch", flush=True)
        _stop_signal = _announced = "STOP file"
    if _stop_signal is not None and not _announced:
        print(f"received signal {_stop_signal}: stopping at the next step or evaluation batch", flush=True)
        _announced = True
    return _stop_signal is not None


def stop_agreed(device):
    """Whether any rank was asked to stop (a collective: every rank must call it at the same point)."""
    return all_reduce_max(float(stop_requested()), device) > 0


def stop_point(device=None):
    """Raise Interrupted when a stop was requested. With a device, every rank must call it equally often:
    the ranks agree (a signal reaches them at slightly different times); without one, this rank alone."""
    if (stop_agreed(device) if device is not None else stop_requested()):
        raise Interrupted()
