"""What the shim on the host and the agent in the guest both speak and both need: ttrpc,
the generated protobuf modules (`pb`, made by protos/generate.py), the protocol's
constants, non-blocking fd I/O, atomic file writes and the kernel's CPU-list syntax.

Standard library and protobuf only: the guest image ships this package as it is, and
nothing here may import `shim`, `cgroups` or the agent."""
