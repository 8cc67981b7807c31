"""A pod's network: the interfaces CNI configured in its network namespace, read
(`read.py`), bridged to taps that QEMU's virtio-net devices use (`attach.py`) and undone
(`detach.py`).

Nothing is imported here: `model` and `errors` load no netlink library, so a state file
that holds a `PodNetwork` can be read without pyroute2; the modules that speak netlink
are imported only by the code that networks or cleans up a pod."""
