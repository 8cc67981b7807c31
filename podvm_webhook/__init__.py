"""The admission webhook: the shim's own resource model, run when a pod is created, so
the cluster and the node agree on the pod's size before it is scheduled. `policy` (what
is admitted, patched, refused) is pure and shared with `podvmctl plan`; the server and
its HTTP library load only in the `podvm-webhook` process."""
