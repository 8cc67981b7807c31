"""bench/scale.py's reading of containerd's log (issue 47): each `shim delete` containerd
ran, killed or saw fail is told by its pod's ids, so that a podvm delete ending while the
runc pods beside run counts as podvm's, and a failure of no pod of the runs still fails the
bench. Lines as containerd 1.6 writes them (runtime/v2/shim.go and binary.go)."""
from __future__ import annotations

from bench.scalelog import read_deletes, removal_phases, unattributed_failures
from bench.scalepods import PodRun, removal_wall

PODVM_POD, PODVM_CTR, RUNC_POD, RUNC_CTR = "a1" * 32, "a2" * 32, "b1" * 32, "b2" * 32


def began(ident: str, at: str) -> str:
    return (f'time="2026-12-06T18:30:{at}Z" level=warning msg="cleaning up after shim '
            f'disconnected" id={ident} namespace=k8s.io')


def done(ident: str, at: str) -> str:
    return (f'time="2026-12-06T18:30:{at}Z" level=warning msg="cleanup warnings time=\\"'
            f'2026-12-06T18:30:{at}Z\\" level=info msg=\\"shim delete of {ident} done in '
            f'0.080s, 0.100s since exec\\" runtime=io.containerd.podvm.v2"')


def killed(ident: str, at: str, shim: str = "podvm") -> str:
    return (f'time="2026-12-06T18:30:{at}Z" level=error msg="failed to delete" cmd="/usr/bin/'
            f'containerd-shim-{shim}-v2 -namespace k8s.io -address /w/containerd.sock '
            f'-id {ident} -bundle /w/state/{ident} delete" error="signal: killed"')


def runs() -> tuple[list[PodRun], list[PodRun]]:
    return ([PodRun("p", (1, 256), "podvm", PODVM_POD, PODVM_CTR)],
            [PodRun("r", (1, 256), "runc", RUNC_POD, RUNC_CTR)])


def test_a_delete_is_its_pods_whichever_run_was_on() -> None:
    podvm, runc = runs()
    log = "\n".join([
        began(PODVM_CTR, "01.000"), done(PODVM_CTR, "01.500"), began(PODVM_POD, "02.000"),
        began(RUNC_CTR, "03.000"),  # the runc pods go while podvm's last delete runs
        killed(PODVM_POD, "07.000"), began(RUNC_POD, "08.000")])
    ours = read_deletes(podvm, log)
    theirs = read_deletes(runc, log[log.index(began(RUNC_CTR, "03.000")):])
    assert (ours.runs, len(ours.written), len(ours.failed)) == (2, 1, 1)
    assert ours.written[0][2] == 0.5  # from containerd's line to the delete's own
    assert PODVM_POD in ours.failed[0]
    assert (theirs.runs, theirs.written, theirs.failed) == (2, [], [])
    assert unattributed_failures(log, podvm + runc) == []


def test_a_failed_delete_of_no_pod_of_the_runs_is_reported() -> None:
    stray = killed("c3" * 32, "09.000", shim="runc")
    podvm, runc = runs()
    assert unattributed_failures("\n".join([began(RUNC_POD, "08.000"), stray]),
                                 podvm + runc) == [stray]


def test_a_podvm_pods_removal_is_split_where_its_shim_stops_the_vm() -> None:
    OTHER = "c4" * 32

    def line(at: str, msg: str) -> str:
        return f'time="2026-12-06T18:37:{at}Z" level=info msg="{msg}"'
    log = [line("30.500", f'StopPodSandbox for \\"{PODVM_POD}\\"'),
           line("30.600", f'StopPodSandbox for \\"{OTHER}\\"'),
           line("59.500", f"sandbox {PODVM_POD}: stopping the VM"),
           line("59.700", f"sandbox {OTHER}: stopping the VM"),
           line("59.900", f'StopPodSandbox for \\"{PODVM_POD}\\" returns successfully'),
           line("59.950", f'RemovePodSandbox \\"{PODVM_POD}\\" returns successfully')]
    assert [round(s, 3) for s in removal_phases(log, PODVM_POD)] == [29.0, 0.4, 0.05]
    assert removal_phases(log, OTHER) == []  # the pod interleaved: its returns missing


def test_the_removal_runs_from_the_first_stop_to_the_last_remove() -> None:
    pods = [PodRun("a", (1, 256), pod_id="x", stop_called=10.0, removed_at=14.0),
            PodRun("b", (1, 256), pod_id="y", stop_called=10.5, removed_at=12.0),
            PodRun("c", (1, 256), stop_called=0.0, removed_at=99.0)]  # never started
    assert removal_wall(pods) == 4.0
