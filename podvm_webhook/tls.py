"""The server's certificate, reloaded when its files change on disk (cert-manager rotates
a Secret; the kubelet swaps the mounted files). Each load makes a new SSLContext; the
listening context's SNI callback hands every new handshake the newest one, so a rotation
is never half applied: a certificate and key that do not match yet (one file written,
the other not) are refused and the previous pair keeps serving until the next look."""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Callable

log = logging.getLogger("podvm.webhook")


def load_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


class ReloadingCertificate:
    def __init__(self, cert: str, key: str,
                 on_reload: Callable[[bool], None] = lambda ok: None) -> None:
        self.cert, self.key = cert, key
        self._on_reload = on_reload
        self._seen = self._stamp()
        self.current = load_context(cert, key)
        self.listening = load_context(cert, key)
        """What the server listens with: its callback switches each handshake to
        `current`."""
        self.listening.sni_callback = self._choose

    def _choose(self, connection: ssl.SSLObject, server_name: str | None,
                _: ssl.SSLContext) -> None:
        connection.context = self.current

    def _stamp(self) -> tuple:
        """What changes when either file is replaced or rewritten (a Secret volume swaps a
        symlink: stat follows it)."""
        stamp = []
        for path in (self.cert, self.key):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                stamp.append(None)
                continue
            stamp.append((st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size))
        return tuple(stamp)

    def check(self) -> bool:
        """Load the files again if they changed since the last look; True when a new
        pair now serves."""
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        try:
            context = load_context(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            log.warning("certificate not reloaded, the previous one keeps serving",
                        extra={"fields": {"cert": self.cert, "key": self.key,
                                          "error": str(exc)}})
            self._on_reload(False)
            self._seen = stamp  # tried again when either file changes once more
            return False
        self.current, self._seen = context, stamp
        log.info("certificate reloaded", extra={"fields": {"cert": self.cert}})
        self._on_reload(True)
        return True

    async def watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.check()
