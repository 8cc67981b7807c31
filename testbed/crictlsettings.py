"""Where crictl connects and how long each call waits: its flags, their environment
variables, its config file and its defaults, settled as crictl settles them."""
from __future__ import annotations

import argparse
import os
import re

from .crictlformat import Fatal, stderr

DEFAULT_CONFIG = "/etc/crictl.yaml"
DEFAULT_ENDPOINTS = ("unix:///run/containerd/containerd.sock", "unix:///run/crio/crio.sock",
                     "unix:///var/run/cri-dockerd.sock")
DEFAULT_TIMEOUT = 2.0


def read_config(path: str) -> dict[str, str]:
    """crictl's YAML config (`runtime-endpoint: unix:///...` lines): flat keys only, so a
    small reader does; no YAML dependency."""
    values: dict[str, str] = {}
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
            if not line or line == "---":
                continue
            key, sep, value = line.partition(":")
            if not sep or not key.strip():
                raise Fatal(f"load config file {path}: line {number}: expected `key: value`")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values[key.strip()] = value
    return values


def parse_duration(text: str) -> float:
    """Seconds from a Go duration ("2s", "1m30s", "500ms") or a bare number of seconds."""
    text = str(text).strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise Fatal(f"invalid duration {text!r} (e.g. 2s, 500ms, 1m)")
    return sum(float(n) * units[u] for n, u in parts)


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def resolve_settings(args: argparse.Namespace) -> tuple[str, str, float, bool]:
    """Endpoints, timeout and debug as crictl settles them: a flag (or its environment
    variable), else the config file, else the defaults."""
    config_path = args.config or os.environ.get("CRI_CONFIG_FILE") or ""
    config: dict[str, str] = {}
    if config_path:
        if not os.path.exists(config_path):
            raise Fatal(f"load config file {config_path}: no such file")
        config = read_config(config_path)
    elif os.path.exists(DEFAULT_CONFIG):
        config = read_config(DEFAULT_CONFIG)
    runtime = (args.runtime_endpoint or os.environ.get("CONTAINER_RUNTIME_ENDPOINT")
               or config.get("runtime-endpoint", ""))
    if not runtime:
        runtime = next((e for e in DEFAULT_ENDPOINTS if os.path.exists(e[len("unix://"):])),
                       DEFAULT_ENDPOINTS[0])
        print(f"WARN[0000] runtime connect using default endpoint: {runtime}",
              file=stderr())
    image = (args.image_endpoint or os.environ.get("IMAGE_SERVICE_ENDPOINT")
             or config.get("image-endpoint", "") or runtime)
    timeout_text = args.global_timeout or config.get("timeout", "")
    timeout = parse_duration(timeout_text) if timeout_text else DEFAULT_TIMEOUT
    if timeout <= 0:
        timeout = DEFAULT_TIMEOUT
    debug = bool(args.debug) or _truthy(config.get("debug", "false"))
    return runtime, image, timeout, debug
