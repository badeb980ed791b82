"""
Hang diagnostics: every rank keeps a record (step, phase, when it began or last made progress, the last collective
named). A daemon thread reports a phase that outlasts --dist-timeout without progress (each common.Progress update,
e.g. an evaluation's batch, is progress): the record and every thread's stack, to stderr and
<report_dir>/rank<R>.txt; at twice the timeout it exits 1 so that torchrun stops the others (a gloo collective may
wait forever). A failure that ends a rank is one short line from the first rank to report it, the traceback in the
rank's file; a timed-out collective gets the hang report. On NCCL, enable_flight_recorder() makes PyTorch dump each
group's last collectives on a timeout; `torchfrtrace <report_dir> -j` names the one where the ranks diverged.
"""

import os
import sys
import time
import threading
import traceback
import contextlib
import faulthandler


def enable_flight_recorder(report_dir):
    """Must run before the NCCL process group is created; variables the user set are kept."""
    os.makedirs(report_dir, exist_ok=True)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(report_dir, "nccl_trace_rank_"))


_current = None  # this process's Watchdog


def keep_alive():
    """A long loop made progress (common.Progress): its phase is not hung, however long it has run."""
    if _current is not None:
        _current.since = time.time()


class Watchdog:
    """One rank's record, and the thread reporting a phase outlasting `timeout_s` (None: the record only, e.g. in one
    process, where nothing can wait on another rank)."""

    def __init__(self, rank, timeout_s, report_dir, poll_s=None):
        self.rank, self.timeout_s, self.report_dir = rank, timeout_s, report_dir
        self.step, self.phase_name, self.since, self.last_collective = None, "start-up", time.time(), "none yet"
        self._reported = None  # the (step, phase, since) already reported
        self._stop = threading.Event()
        global _current
        _current = self
        # the first rank of this run to fail creates it and prints the run's one line; one left by an earlier run
        # under the same id is removed at start, once per node. torchrun's default --rdzv-id is "none": the store's
        # address tells apart runs at the same time
        run = "_".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
        self.failed_marker = os.path.join(report_dir, f"failed_{run}")
        if timeout_s is not None:
            if os.environ.get("LOCAL_RANK", "0") == "0":
                with contextlib.suppress(OSError):
                    os.remove(self.failed_marker)
            self._poll_s = poll_s or min(10.0, max(0.5, timeout_s / 10))
            threading.Thread(target=self._watch, name="nanochat-watchdog", daemon=True).start()

    def phase(self, name, step=None):
        self.phase_name, self.since = name, time.time()
        self.step = self.step if step is None else step

    def collective(self, name):  # about to enter the collective `name` (e.g. 'barrier: compile warm-up')
        self.last_collective = name

    def describe(self):
        return (f"rank {self.rank}: step {self.step}, phase '{self.phase_name}', no progress for "
                f"{time.time() - self.since:.0f}s, last collective: {self.last_collective}")

    def stop(self):
        self._stop.set()

    def _watch(self):
        while not self._stop.wait(self._poll_s):
            key, waited = (self.step, self.phase_name, self.since), time.time() - self.since
            if waited > self.timeout_s and key != self._reported:
                self._reported = key
                self.report(f"HANG? longer than --dist-timeout {self.timeout_s:g}s in")
            elif waited > 2 * self.timeout_s and key == self._reported:
                self.report(f"GIVING UP (exit 1) after twice --dist-timeout {self.timeout_s:g}s in")
                os._exit(1)

    def fail(self, error, hint=lambda: ""):
        """Exit 1 on an exception that ends this rank (under torchrun), printing failure()'s line if this is the first
        rank of the run to report (failed_marker, created with O_EXCL; hint(): where to resume)."""
        if line := self.failure(error, hint):
            print(f"ERROR: {line}", flush=True)
        sys.exit(1)

    def failure(self, error, hint):
        """The run's one line (None if another rank reported first); the traceback goes to this rank's file, and a
        collective that timed out gets the hang report (the record and every thread's stack)."""
        text, kind = str(error).strip(), type(error).__name__
        if "timed out" in text.lower() or "timeout" in kind.lower():
            self.report(f"FAILED with {kind} in")
            why = "a collective timed out (hang report above)"
        elif any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "NCCL", "peer")):
            why = "another rank failed or is gone (torchrun names it)"
        else:
            why = f"{kind}: {text.splitlines()[0][:300] if text else 'no message'}"
        os.makedirs(self.report_dir, exist_ok=True)
        with open(os.path.join(self.report_dir, f"rank{self.rank}.txt"), "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} FAILED {self.describe()}\n{traceback.format_exc()}")
        try:
            os.close(os.open(self.failed_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
        return (f"rank {self.rank} stopped at step {self.step} in '{self.phase_name}': {why}; traceback in "
                f"{self.report_dir}/rank{self.rank}.txt" + (f"; {h}" if (h := hint()) else ""))

    def report(self, reason):
        header = f"{reason} {self.describe()}. Every rank writes such a report; compare their steps and phases."
        print(header, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os.makedirs(self.report_dir, exist_ok=True)
        path = os.path.join(self.report_dir, f"rank{self.rank}.txt")
        with open(path, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"rank {self.rank}: hang report written to {path}", file=sys.stderr, flush=True)
