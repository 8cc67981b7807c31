"""Structured log lines (logfmt, as containerd's own shims write) on stderr.

The daemon's stderr is containerd's `<bundle>/log` FIFO, so these lines show up in
containerd's log next to the runtime's; `-debug` lowers the level to debug.
"""
from __future__ import annotations

import logging
import sys
import time


def _quote(value: object) -> str:
    text = str(value)
    if text and all(c.isalnum() or c in "-_./:@" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class LogfmtFormatter(logging.Formatter):
    def __init__(self, fields: dict[str, str]) -> None:
        super().__init__()
        self._fields = "".join(f" {k}={_quote(v)}" for k, v in fields.items())

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (f"time=\"{ts}.{int(record.msecs):03d}Z\" level={record.levelname.lower()} "
                f"msg={_quote(record.getMessage())}{self._fields}")
        for key, value in getattr(record, "fields", {}).items():
            line += f" {key}={_quote(value)}"
        if record.exc_info:
            line += " error=" + _quote(self.formatException(record.exc_info))
        return line


def setup(debug: bool, **fields: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter({"runtime": "io.containerd.podvm.v2", **fields}))
    root = logging.getLogger("podvm")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False
