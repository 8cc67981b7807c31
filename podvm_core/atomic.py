"""Files that hold either their old content or the new, never a part: what a crash at
any moment may leave is what `delete` and the next writer read."""
from __future__ import annotations

import contextlib
import json
import os


def write_atomic(path: str, data: bytes, durable: bool = False) -> None:
    """Replace `path` with `data` in one rename. `durable`: the data reaches the disk
    before the rename (for state other processes trust after a power loss)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str, value: object, durable: bool = False, **dump_args) -> None:
    write_atomic(path, json.dumps(value, **dump_args).encode(), durable)
