"""`make demo`: a pod of two containers in its own VM, on a private containerd, serving
HTTP to another pod.

Starts a containerd of its own (own root, state and sockets; the system's containerd is
not touched) with podvm registered from packaging/containerd/config-v2.toml and a private
CNI bridge network (testbed/bridgenet.py: no route off this machine), imports a
locally built busybox image, runs a pod with two containers through the CRI (our
crictl-compatible client, or the real crictl when $CRICTL names one): `web` runs busybox
httpd. A second podvm pod fetches web's page from the first pod's IP. The demo shows the
containers' output, the pods' IPs and the fetched page, the VM's size, its plan and where
its host threads run (podvmctl status), then removes everything.

The VM runs under TCG unless PODVM_DEMO_ACCEL=kvm: nested KVM hangs guests on the
machines this project is built on.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

from testbed import bridgenet, forkservers
from testbed.containerd import Containerd, mounts_under, shims_of
from testbed.cri import Crictl, write_config
from testbed.netpods import (fetch_from_pod, httpd_script, interface_addresses, pod_ip, url,
                             wait_for_port)
from testbed.pods import container_config, pod_config, pod_qemus
from testbed.vmconfig import write_test_config


PAGE = "hello from the web container of the demo pod, served by busybox httpd in its VM"


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def how_started(ctd: Containerd, pod_id: str) -> str:
    """What the pod's shim said of its VM in containerd's log."""
    said = [line for line in ctd.log().splitlines() if pod_id in line]
    if any("VM restored from template" in line for line in said):
        return "its VM restored from the template of its shape, not booted"
    return "its VM booted: no template of its shape yet (its shim makes one now)"


def warm(config: pathlib.Path) -> None:
    """What the node installer runs: the default shape's template made ahead of any pod."""
    say("podvmctl templates warm (a node's templates, made before its first pod)")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "podvmctl.cli", "templates", "warm",
                           "--config", str(config)], capture_output=True, text=True)
    print(done.stdout + done.stderr, end="")
    if done.returncode:
        raise SystemExit(f"podvmctl templates warm failed ({done.returncode})")
    print(f"in {time.monotonic() - started:.1f}s")


def main() -> int:
    accel = os.environ.get("PODVM_DEMO_ACCEL", "tcg")
    with tempfile.TemporaryDirectory(prefix="podvm-demo-") as tmp:
        work = pathlib.Path(tmp)
        templates = work / "templates"  # the demo's own: gone with its directory
        config = write_test_config(work / "podvm.toml", accel=accel,
                                   template_path=str(templates))
        warm(config)
        say(f"private containerd in {work} (podvm configuration {config}, accel={accel})")
        with Containerd(work / "containerd", namespace="podvm-demo", cri=True,
                        podvm_config=config) as ctd:
            if ctd.network is None:
                raise SystemExit("the demo's pods need a CNI bridge: Debian packages "
                                 "containernetworking-plugins and iproute2 (make test-deps)")
            ctd.import_cri_images(work)
            crictl = Crictl(ctd.cri_endpoint, timeout="120s")
            pod_file = write_config(work, "pod.json", pod_config(ctd, work, "demo"))
            say(f"crictl runp --runtime podvm {pod_file}")
            started = time.monotonic()
            pod_id = crictl.runp(pod_file, runtime="podvm")
            print(f"pod {pod_id[:13]} ready in {time.monotonic() - started:.1f}s "
                  f"({how_started(ctd, pod_id)})")
            pod_ids = [pod_id]
            ids = []
            for name, then in (("web", httpd_script(PAGE)), ("worker", "sleep 600")):
                cfile = write_config(work, f"{name}.json", container_config(
                    name, f"echo {name}: hello from $(uname -sr) on $(hostname); {then}"))
                cid = crictl.create(pod_id, cfile, pod_file)
                crictl.start(cid)
                ids.append((name, cid))
            time.sleep(1)
            for name, cid in ids:
                say(f"crictl logs {name}")
                print(crictl.logs(cid).stdout, end="")
            web = ids[0][1]

            say(f"pod to pod over the bridge {ctd.network.bridge} ({ctd.network.subnet}, "
                f"nothing routed off this machine)")
            client_file = write_config(work, "client-pod.json",
                                       pod_config(ctd, work, "demo-client"))
            started = time.monotonic()
            client_pod = crictl.runp(client_file, runtime="podvm")
            pod_ids.append(client_pod)
            print(f"second podvm pod {client_pod[:13]} ready in "
                  f"{time.monotonic() - started:.1f}s ({how_started(ctd, client_pod)})")
            cfile = write_config(work, "client.json", container_config("client", "sleep 600"))
            client = crictl.create(client_pod, cfile, client_file)
            crictl.start(client)
            web_ip = pod_ip(crictl, pod_id)
            eth0 = ", ".join(str(a) for a in interface_addresses(crictl, web))
            print(f"pod demo        IP {web_ip} (crictl inspectp); its VM's eth0: {eth0}")
            print(f"pod demo-client IP {pod_ip(crictl, client_pod)}")
            wait_for_port(crictl, web)
            say(f"crictl exec client wget -q -O - {url(web_ip)}")
            print(fetch_from_pod(crictl, client, url(web_ip), timeout=60), end="")
            say("the VM, seen from inside")
            print("vCPUs:", crictl.exec(web, "nproc").stdout.strip(), "| memory:",
                  crictl.exec(web, "sh", "-c", "grep MemTotal /proc/meminfo").stdout.strip())
            print(f"host kernel: {os.uname().release}")
            say(f"podvmctl status {pod_id[:13]}: its plan, its cgroup, where every host "
                f"thread runs")
            from podvmctl import status

            print(status.render(status.collect(status.find(pod_id))))
            exec_result = crictl.exec(web, "sh", "-c", "exit 3")
            say(f"crictl exec web sh -c 'exit 3' -> exit code {exec_result.exit_code}")
            say("crictl stopp + rmp (both pods)")
            for pod in pod_ids:
                crictl.run("stopp", pod)
                crictl.run("rmp", pod)
            left = [f"shim {c}" for _, c in shims_of(ctd.address)]
            bridge = ctd.network.bridge
        left += [f"qemu {p}" for pod in pod_ids for p in pod_qemus(pod)]
        left += [f"mount {m}" for m in mounts_under(work)]
        left += [f"bridge {bridge}"] if bridge in bridgenet.link_names() else []
        left += [f"harness forced: {f}" for f in ctd.forced]
        # the shims' warm parent (docs/design.md, "The fork server"): on a node it stays
        # for the next pod; the demo's is stopped with the rest
        left += [f"fork server {p}" for p in forkservers.stop_own()]
        say("left behind: " + (", ".join(left) if left else "nothing"))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
