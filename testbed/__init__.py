"""The harness tests and benchmarks share: a private containerd with its CRI and bridge
network, crictl, the shim run as containerd runs it, the test VM configuration, the
admission webhook as a process, and the prerequisites each needs of the machine.

tests/ and bench/ import it; neither it nor bench/ imports tests/ (tests/test_layout.py)."""
