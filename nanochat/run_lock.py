"""
One run per checkpoint folder: <ckpt_dir>/run.lock, held by the run's rank 0 as an flock, which the kernel drops when
the process ends however it ends (so two runs racing for a stale lock cannot both win, and a reused PID proves
nothing). The file names the holder's host, PID and start time for the refusal. A lock of another host is refused even
where that host's flock cannot be seen from here (some shared filesystems lock per node); where the filesystem has no
locks at all, a live PID of this host refuses.
"""

import os
import json
import time
import fcntl
import socket
import contextlib

from nanochat.checkpoint_manager import CheckpointError


def take_lock(ckpt_dir):
    """Take <ckpt_dir>/run.lock (module docstring) or refuse, naming its holder; returns the open file, for
    release_lock."""
    path = os.path.join(ckpt_dir, "run.lock")
    os.makedirs(ckpt_dir, exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    while True:
        f, locks = open(path, "a+"), True
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(f) or {"host": "?", "pid": "?", "started": "?"}
            f.close()
            raise _in_use(ckpt_dir, holder, "") from None
        except OSError:  # a filesystem without locks (Lustre mounted without flock): the file's PID decides
            locks = False
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        f.close()  # the holder removed the file as it released it: lock the one there now
    holder = _holder(f)
    if holder is not None and (holder.get("host") != me["host"] or not locks and _alive(holder.get("pid"))):
        f.close()
        raise _in_use(ckpt_dir, holder, f" (if that run is gone, delete {path})")
    if holder is not None:
        print(f"note: took over {path} from a run that is gone (PID {holder.get('pid')} on {holder.get('host')}, "
              f"started {holder.get('started')})", flush=True)
    f.seek(0)
    f.truncate()
    json.dump(me, f)
    f.flush()
    return f


def _holder(f):
    """The run a lock file names, or None (empty: killed as it wrote)."""
    f.seek(0)
    with contextlib.suppress(ValueError):
        holder = json.loads(f.read() or "null")
        return holder if isinstance(holder, dict) else None


def _alive(pid):
    try:
        os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # someone else's process, alive
        pass
    return True


def _in_use(ckpt_dir, holder, hint):
    return CheckpointError(f"{ckpt_dir} is in use by another run (PID {holder.get('pid')} on {holder.get('host')}, "
                           f"started {holder.get('started')}): wait for it to end or use another --model-tag{hint}")


def release_lock(lock):
    """Remove the lock file (if it is still the one held) and drop the lock."""
    if lock is None:
        return
    with contextlib.suppress(OSError):
        if os.stat(lock.name).st_ino == os.fstat(lock.fileno()).st_ino:
            os.remove(lock.name)
    lock.close()
