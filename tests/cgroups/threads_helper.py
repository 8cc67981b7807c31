"""A small multithreaded process that stands in for QEMU where QEMU cannot run (or to make
threads on demand): prints {"pid", "threads"} as JSON, then on each stdin line
`spawn <tid>` the thread <tid> starts a new thread and the new thread's id is printed
(a thread starts in the cgroup of the thread that created it)."""
from __future__ import annotations

import json
import os
import queue
import sys
import threading

workers: dict[int, queue.Queue] = {}


def worker(ready: queue.Queue) -> None:
    inbox: queue.Queue = queue.Queue()
    tid = threading.get_native_id()
    workers[tid] = inbox
    ready.put(tid)
    while True:
        job = inbox.get()
        if job is None:
            return
        job()


def start_worker() -> int:
    ready: queue.Queue = queue.Queue()
    threading.Thread(target=worker, args=(ready,), daemon=True).start()
    return ready.get()


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    tids = [start_worker() for _ in range(count)]
    print(json.dumps({"pid": os.getpid(), "threads": tids}), flush=True)
    for line in sys.stdin:
        verb, _, arg = line.strip().partition(" ")
        if verb == "spawn":
            answer: queue.Queue = queue.Queue()
            workers[int(arg)].put(lambda: answer.put(start_worker()))
            print(answer.get(), flush=True)
        elif verb == "exit":
            return


if __name__ == "__main__":
    main()
