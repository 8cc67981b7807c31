"""`make demo`: a pod of two containers in its own VM, on a private containerd.

Starts a containerd of its own (own root, state and sockets; the system's containerd is
not touched) with podvm registered from packaging/containerd/config-v2.toml, imports a
locally built busybox image, runs a pod with two containers through the CRI (our
crictl-compatible client, or the real crictl when $CRICTL names one), shows their
output, the VM's size, its plan and where its host threads run (podvmctl status), then
removes everything.

The VM runs under TCG unless PODVM_DEMO_ACCEL=kvm: nested KVM hangs guests on the
machines this project is built on.
"""
from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time

from tests.vmconfig import write_test_config

from .containerd import Containerd, mounts_under, shims_of
from .cri import Crictl, write_config
from .test_crictl import container_config, pod_config
from .test_podvm_pods import pod_qemus


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main() -> int:
    accel = os.environ.get("PODVM_DEMO_ACCEL", "tcg")
    with tempfile.TemporaryDirectory(prefix="podvm-demo-") as tmp:
        work = pathlib.Path(tmp)
        config = write_test_config(work / "podvm.toml", accel=accel)
        say(f"private containerd in {work} (podvm configuration {config}, accel={accel})")
        with Containerd(work / "containerd", namespace="podvm-demo", cri=True,
                        podvm_config=config) as ctd:
            ctd.import_cri_images(work)
            crictl = Crictl(ctd.cri_endpoint, timeout="120s")
            pod_file = write_config(work, "pod.json", pod_config(ctd, work, "demo"))
            say(f"crictl runp --runtime podvm {pod_file}")
            started = time.monotonic()
            pod_id = crictl.runp(pod_file, runtime="podvm")
            print(f"pod {pod_id[:13]} ready in {time.monotonic() - started:.1f}s")
            ids = []
            for name in ("web", "worker"):
                cfile = write_config(work, f"{name}.json", container_config(
                    name, f"echo {name}: hello from $(uname -sr) on $(hostname); sleep 600"))
                cid = crictl.create(pod_id, cfile, pod_file)
                crictl.start(cid)
                ids.append((name, cid))
            time.sleep(1)
            for name, cid in ids:
                say(f"crictl logs {name}")
                print(crictl.logs(cid).stdout, end="")
            web = ids[0][1]
            say("the VM, seen from inside")
            print("vCPUs:", crictl.exec(web, "nproc").stdout.strip(), "| memory:",
                  crictl.exec(web, "sh", "-c", "grep MemTotal /proc/meminfo").stdout.strip())
            print(f"host kernel: {os.uname().release}")
            say(f"podvmctl status {pod_id[:13]}: its plan, its cgroup, where every host "
                f"thread runs")
            from shim import status

            print(status.render(status.collect(status.find(pod_id))))
            exec_result = crictl.exec(web, "sh", "-c", "exit 3")
            say(f"crictl exec web sh -c 'exit 3' -> exit code {exec_result.exit_code}")
            say("crictl stopp + rmp")
            crictl.run("stopp", pod_id)
            crictl.run("rmp", pod_id)
            left = [f"shim {c}" for _, c in shims_of(ctd.address)]
        left += [f"qemu {p}" for p in pod_qemus(pod_id)]
        left += [f"mount {m}" for m in mounts_under(work)]
        say("left behind: " + (", ".join(left) if left else "nothing"))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
