"""The fork server's worker parent: one `python -m shim.network.worker --parent` started
once the server has loaded, which forks each daemon's network workers, loaded already
(shim/network/worker.py). Every daemon the server forks inherits the parent's socket and
asks it for a worker when its pod's network is attached and when it is detached
(shim/network/ahead.py). A forked worker is ready in milliseconds; a worker a daemon
starts itself spends its Python start and pyroute2's import first, 0.15-0.25 s of CPU on
an idle node and seconds each when twenty pods stop at once on a busy one (issue 47,
docs/design.md "The fork server").

The parent is the server's child. It never answers on its socket, which all the daemons
share: each request brings the socket the worker is to serve on. The workers are its
children, reaped by the kernel as they exit. A parent that died is started again once the
server has been idle DELAY after its last fork (its imports then take no CPU from the pod
just started); on its way out the server closes its socket, kills the parent and waits for
it, so that no process of the server's tree outlives it unseen (podvm_core/treegc.py
counts a tree's users). The server stays while daemons it forked run (forkserver.py), so
their removal finds the parent however old their pods are. A daemon whose parent is gone
starts its workers itself."""
from __future__ import annotations

import os
import socket
import subprocess

from ..network.remote import worker_argv

EXIT_WAIT = 0.5
"""Seconds the server waits for its killed parent to exit; past them init reaps it."""
DELAY = 1.0
"""Seconds the server waits after a fork before it starts a parent anew."""


class WorkerParent:
    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        """Our end of the parent's socket: what each daemon inherits a copy of."""

    def ensure(self) -> None:
        """The parent started unless it runs; none where it cannot be started (the
        daemons then start their own workers)."""
        if not self.missing():
            return
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # None of the server's descriptors but its socket (close_fds: a request's,
            # received inheritable, would stay open). At the daemons' own policy: a
            # worker loading at SCHED_IDLE on a busy node was not scheduled for long, not
            # even to die when its tree was collected.
            self._proc = subprocess.Popen(
                worker_argv(theirs.fileno()) + ["--parent", str(os.sched_getscheduler(0))],
                pass_fds=(theirs.fileno(),), close_fds=True, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            ours.close()
            return
        finally:
            theirs.close()
        self._sock = ours

    def fd(self) -> int:
        """The parent's socket, for the daemon about to be forked; -1 when there is none."""
        return self._sock.fileno() if self._sock is not None else -1

    def missing(self) -> bool:
        """No parent runs (none started yet, or it died, reaped now): the server starts
        one when it has been idle for DELAY."""
        return self._proc is None or self._proc.poll() is not None

    def close(self) -> None:
        """The server's exit (or a dead parent's end): our socket closed, the parent
        killed, and waited for a moment."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
                try:
                    self._proc.wait(EXIT_WAIT)
                except subprocess.TimeoutExpired:
                    pass
            self._proc = None
