"""The fork server's spare network worker: one `python -m shim.network.worker` started
before any pod needs it, its imports (pyroute2's 0.15-0.25 s) done at SCHED_IDLE, and
handed to the next daemon the server forks, which attaches its pod's network through it
(shim/network/ahead.py). Without it the daemon starts its worker as it comes up, and a
pod's boot waits at the attach for that worker's imports: the longest step of the host's
share of a pod's start once the daemon's own imports are done ahead (issue 47,
docs/design.md "The fork server").

The spare is the server's child: the server reaps the spares it handed on as they exit,
and on its own way out closes its spare's socket, which ends the spare unused, and waits
for it, so that no process of the server's tree outlives it unseen (podvm_core/treegc.py
counts a tree's users)."""
from __future__ import annotations

import os
import socket
import subprocess

from ..network.remote import worker_argv

EXIT_WAIT = 2.0
"""Seconds the server waits for its unused spare to exit before it kills it."""


class Spare:
    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        """Our end of the spare's socket: what a daemon gets."""
        self._handed: list[subprocess.Popen] = []
        """Spares handed to daemons, not yet reaped."""

    def ensure(self) -> None:
        """A spare started unless there is one; none where it cannot be started (the
        daemons then start their own)."""
        if self._sock is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        policy = os.sched_getscheduler(0)
        try:
            # it inherits SCHED_IDLE to load, and none of the server's descriptors but
            # its socket (close_fds: a request's, received inheritable, would stay open)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            try:
                self._proc = subprocess.Popen(
                    worker_argv(theirs.fileno()) + ["--spare", str(policy)],
                    pass_fds=(theirs.fileno(),), close_fds=True, start_new_session=True,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
            finally:
                os.sched_setscheduler(0, policy, os.sched_param(0))
        except (OSError, subprocess.SubprocessError):
            ours.close()
            return
        finally:
            theirs.close()
        self._sock = ours

    def fd(self) -> int:
        """The spare's socket, for the daemon about to be forked; -1 when there is none."""
        return self._sock.fileno() if self._sock is not None else -1

    def handed(self) -> None:
        """The daemon just forked has the spare (or failed and dropped it): the server
        lets its copy go and starts the next."""
        if self._sock is not None and self._proc is not None:
            self._sock.close()
            self._sock = None
            self._handed.append(self._proc)
        self.reap()
        self.ensure()

    def reap(self) -> None:
        """The spares handed on that have exited, waited for."""
        self._handed = [proc for proc in self._handed if proc.poll() is None]

    def close(self) -> None:
        """The server's exit: its spare ended unused, and waited for."""
        if self._sock is not None and self._proc is not None:
            self._sock.close()
            self._sock = None
            try:
                self._proc.wait(EXIT_WAIT)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self.reap()
