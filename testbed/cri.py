"""Run crictl from tests: our client (testbed/crictl.py) by default, or the real crictl
binary when $CRICTL names one, with the same arguments, so every e2e test can check
both against containerd."""
from __future__ import annotations

import json
import locale
import os
import pathlib
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


@dataclass
class ExecResult:
    """A command's outcome through `crictl exec -s`, the same whichever crictl ran it.

    Ours exits with the command's status and keeps its streams apart. The real crictl
    exits 1 and only reports "command '...' exited with N: <stderr>" when the status is
    not 0, and on success prints the command's stdout and then its stderr, each followed
    by a newline, both to its stdout: `stdout` is then that text less those newlines."""
    exit_code: int
    stdout: str
    stderr: str
    raw: Result


class CrictlFailed(AssertionError):
    """A crictl command that was expected to succeed did not; says what it ran and got."""


class Crictl:
    """crictl against one endpoint. `timeout` is crictl's --timeout (each call's deadline,
    generous: pods start slower under load and under a VM runtime)."""

    def __init__(self, endpoint: str, timeout: str = "60s",
                 binary: str | None = None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.binary = binary if binary is not None else os.environ.get("CRICTL") or None

    @property
    def program(self) -> list[str]:
        if self.binary:
            return [self.binary]
        return [sys.executable, "-m", "testbed.crictl"]

    def run(self, *args: str, check: bool = True, timeout: float = 180) -> Result:
        """`crictl ARGS` against the endpoint: the real crictl as a process, ours in this
        process (the same arguments, output and status, without a Python process's
        start and imports, 0.2 s a call on a busy machine); `timeout`: it is abandoned
        (TimeoutExpired) after that many seconds."""
        flags = ["--runtime-endpoint", self.endpoint, "--image-endpoint", self.endpoint,
                 "--timeout", self.timeout, *args]
        argv = [*self.program, *flags]
        if self.binary:
            # The real crictl reads /etc/crictl.yaml when no config is named: the
            # endpoint flags above win over it either way.
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  cwd=REPO_ROOT)
            result = Result(argv, proc.returncode, proc.stdout, proc.stderr)
        else:
            result = Result(argv, *_run_here(flags, timeout))
        if check and result.returncode != 0:
            raise CrictlFailed(f"`crictl {shlex.join(args)}` exited {result.returncode}:\n"
                               f"{result.stderr}{result.stdout}")
        return result

    # The calls tests make most, returning what a test wants.

    def runp(self, pod_config: os.PathLike | str, runtime: str | None = None) -> str:
        extra = ["--runtime", runtime] if runtime else []
        return self.run("runp", *extra, str(pod_config)).stdout.strip()

    def create(self, pod_id: str, container_config: os.PathLike | str,
               pod_config: os.PathLike | str) -> str:
        return self.run("create", pod_id, str(container_config),
                        str(pod_config)).stdout.strip()

    def start(self, container_id: str) -> None:
        self.run("start", container_id)

    def exec(self, container_id: str, *cmd: str, timeout: int = 0) -> ExecResult:
        extra = ["--timeout", str(timeout)] if timeout else []
        r = self.run("exec", "-s", *extra, container_id, *cmd, check=False)
        if not self.binary:
            return ExecResult(r.returncode, r.stdout, r.stderr, r)
        exited = re.search(r"command '.*' exited with (\d+):", r.stderr, re.S)
        if r.returncode != 0 and exited:
            return ExecResult(int(exited.group(1)), "", r.stderr, r)
        out = r.stdout[:-2] if r.returncode == 0 and r.stdout.endswith("\n\n") else r.stdout
        return ExecResult(r.returncode, out, r.stderr, r)

    def logs(self, container_id: str, tail: int | None = None) -> Result:
        extra = ["--tail", str(tail)] if tail is not None else []
        return self.run("logs", *extra, container_id)

    def inspect(self, container_id: str) -> dict:
        return self.run("inspect", container_id).json()

    def inspectp(self, pod_id: str) -> dict:
        return self.run("inspectp", pod_id).json()

    def ps(self, *flags: str) -> list[str]:
        """Container IDs (`ps -q` plus flags such as -a or --pod ID)."""
        return self.run("ps", "-q", *flags).stdout.split()

    def pods(self, *flags: str) -> list[str]:
        return self.run("pods", "-q", *flags).stdout.split()


def _run_here(flags: list[str], timeout: float) -> tuple[int, str, str]:
    """testbed/crictl.py's run_here in a thread of its own, given up after `timeout`
    seconds (a process's would be killed: this one is left to its deadlines); its
    output as text, as subprocess gives a process's (the locale's encoding, universal
    newlines)."""
    from . import crictl  # grpc: only where a test runs crictl

    done: list = []

    def call() -> None:
        try:
            done.append(crictl.run_here(flags))
        except BaseException as exc:  # the caller's to raise
            done.append(exc)

    thread = threading.Thread(target=call, name="crictl", daemon=True)
    thread.start()
    thread.join(timeout)
    if not done:
        raise subprocess.TimeoutExpired(["crictl", *flags], timeout)
    if isinstance(done[0], BaseException):
        raise done[0]
    status, out, err = done[0]
    return status, _text(out), _text(err)


def _text(data: bytes) -> str:
    encoding = locale.getpreferredencoding(False)
    return data.decode(encoding).replace("\r\n", "\n").replace("\r", "\n")


class PortForward:
    """A running `crictl port-forward POD :PORT`: `local_port` is where it listens; its
    stderr (where errors of forwarded connections go) is read with `errors()`."""

    def __init__(self, crictl: "Crictl", pod_id: str, remote_port: int,
                 workdir: pathlib.Path, timeout: float = 60) -> None:
        self._stderr_path = workdir / f"port-forward-{pod_id[:12]}-{remote_port}.err"
        argv = [*crictl.program, "--runtime-endpoint", crictl.endpoint, "--timeout",
                crictl.timeout, "port-forward", pod_id, f":{remote_port}"]
        with open(self._stderr_path, "wb") as err:
            self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err,
                                            cwd=REPO_ROOT, text=True)
        self.local_port = self._listening(timeout)

    def _listening(self, timeout: float) -> int:
        import select

        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        found = re.match(r"Forwarding from 127\.0\.0\.1:(\d+) -> \d+", line)
        if not found:
            self.close()
            raise CrictlFailed(f"crictl port-forward did not start listening: {line!r}; "
                               f"stderr: {self.errors()!r}")
        return int(found.group(1))

    def errors(self) -> str:
        return self._stderr_path.read_text(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> "PortForward":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_config(directory: pathlib.Path, name: str, config: dict) -> pathlib.Path:
    """A pod or container config as the JSON file crictl reads."""
    path = directory / name
    path.write_text(json.dumps(config, indent=2))
    return path
