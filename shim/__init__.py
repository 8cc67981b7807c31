"""podvm: a containerd shim v2 that runs each pod in its own QEMU VM."""

__version__ = "0.1.0"
