"""The fork server's spare network worker: one `python -m shim.network.worker` started
before any pod needs it, once the server has been idle a moment after its last fork (its
imports, pyroute2's 0.15-0.25 s, then take no CPU from the pod just started), and handed
to the next daemon the server forks, which attaches its pod's network through it
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

EXIT_WAIT = 0.5
"""Seconds the server waits for its killed spare to exit; past them init reaps it."""
DELAY = 1.0
"""Seconds the server waits after a fork before it starts the next spare."""


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
        try:
            # None of the server's descriptors but its socket (close_fds: a request's,
            # received inheritable, would stay open). At the daemons' own policy: a spare
            # loading at SCHED_IDLE on a busy node was not scheduled for long, not even
            # to die when its tree was collected.
            self._proc = subprocess.Popen(
                worker_argv(theirs.fileno()) + ["--spare", str(os.sched_getscheduler(0))],
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
        """The spare's socket, for the daemon about to be forked; -1 when there is none."""
        return self._sock.fileno() if self._sock is not None else -1

    def missing(self) -> bool:
        """No spare is kept: the server starts one when it has been idle for DELAY."""
        return self._sock is None

    def handed(self) -> None:
        """The daemon just forked has the spare (or failed and dropped it): the server
        lets its copy go; the next is started once the server is idle (ensure)."""
        if self._sock is not None and self._proc is not None:
            self._sock.close()
            self._sock = None
            self._handed.append(self._proc)
        self.reap()

    def reap(self) -> None:
        """The spares handed on that have exited, waited for."""
        self._handed = [proc for proc in self._handed if proc.poll() is None]

    def close(self) -> None:
        """The server's exit: its spare, unused, killed, and waited for a moment."""
        if self._sock is not None and self._proc is not None:
            self._sock.close()
            self._sock = None
            self._proc.kill()
            try:
                self._proc.wait(EXIT_WAIT)
            except subprocess.TimeoutExpired:
                pass
        self.reap()
