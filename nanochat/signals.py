"""
Ctrl-C and SIGTERM as a request to stop, which the training loop and the evaluations poll: a run stops within
seconds at any time (an evaluation included) and saves its checkpoint on the way out, instead of dying mid-step.
"""

import signal

from nanochat.distributed import all_reduce_max


class Interrupted(Exception):
    """A stop was requested (Ctrl-C or SIGTERM) while a long operation polled stop_point()."""


_stop_signal = None


def install_stop_handlers():
    """Ctrl-C and SIGTERM set the stop request instead of killing the process."""
    def request_stop(signum, frame):
        global _stop_signal
        if _stop_signal is None:
            print(f"received signal {signum}: stopping at the next step or evaluation batch", flush=True)
        _stop_signal = signum
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def stop_requested():
    return _stop_signal is not None


def stop_agreed(device):
    """Whether any rank was asked to stop (a collective: every rank must call it at the same point)."""
    return all_reduce_max(float(stop_requested()), device) > 0


def stop_point(device=None):
    """Raise Interrupted when a stop was requested. With a device, every rank must call it equally often:
    the ranks agree (a signal reaches them at slightly different times); without one, this rank alone."""
    if (stop_agreed(device) if device is not None else stop_requested()):
        raise Interrupted()
