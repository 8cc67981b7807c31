# podvm. `make demo` runs the main job, `make test` runs every test; each installs what
# it needs first and is safe to run again.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PREFIX ?= /opt/podvm
BINDIR ?= /usr/local/bin
CONFDIR ?= /etc/podvm
GUESTDIR ?= /usr/share/podvm
GUEST_BUILD := build/guest
BUNDLE_DIR := build/node-bundle

# Debian packages: the runtime's own needs, then what the tests add.
# erofs-utils: the guest's root image is built where podvm is installed.
# iptables: the nat rule that brings CRI PortForward into the VM (shim/network/portforward.py).
RUNTIME_DEBS := containerd runc python3-venv qemu-system-x86 erofs-utils iptables
TEST_DEBS := $(RUNTIME_DEBS) busybox-static containernetworking-plugins iproute2 gcc libc6-dev \
	patchelf
# skopeo: the images' archives read by a registry client (tests/images).
TEST_DEBS += skopeo
# libsqlite3-dev: its static library, for the SQLite probe the busybox image runs
# (testbed/sqliteprobe.c).
TEST_DEBS += libsqlite3-dev

STAMP := $(VENV)/.podvm-installed
SOURCES := pyproject.toml setup.py $(shell find protos -name '*.proto' -o -name '*.py' 2>/dev/null)

.PHONY: help deps test-deps venv gen guest virtiofsd bundle images install uninstall test test-busy bench demo clean

help:
	@echo "make demo       run the demo on a private containerd (installs what it needs)"
	@echo "make test       run every test (installs what it needs)"
	@echo "make test-busy  the same with another process keeping one core busy throughout"
	@echo "make install    install podvm for the system's containerd"
	@echo "make uninstall  remove what make install put in place (keeps $(CONFDIR))"
	@echo "make bench      print the benchmarks' figures"
	@echo "make gen        regenerate the protobuf modules (podvm_core/pb)"
	@echo "make guest      build the guest image (kernel + initramfs) into $(GUEST_BUILD)"
	@echo "make virtiofsd  fetch the Rust virtiofsd podvm ships (Debian 13's) into build/virtiofsd"
	@echo "make bundle     build the tree podvm-node install puts in /opt/podvm into $(BUNDLE_DIR)"
	@echo "make images     build the podvm-webhook and podvm-node images into build/images"

deps:
	@$(call apt_install,$(RUNTIME_DEBS))

test-deps:
	@$(call apt_install,$(TEST_DEBS))

# Install Debian packages that are missing; `apt-get update` only when something is.
define apt_install
	missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -q && apt-get install -y -q --no-install-recommends $$missing; \
	fi
endef

venv: $(STAMP)

$(STAMP): $(SOURCES) | test-deps
	@[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q grpcio-tools
	$(VENV)/bin/python protos/generate.py
	$(VENV)/bin/pip install -q -e '.[test,bench]' --config-settings editable_mode=compat
	@touch $@

gen: $(STAMP)
	$(VENV)/bin/python protos/generate.py

# Cached: rebuilt only when its inputs (package versions, agent sources) change.
guest: $(STAMP)
	$(VENV)/bin/python guest/build.py --out $(GUEST_BUILD)

# The Rust virtiofsd podvm ships (Debian 13's, made to load on Debian 12) into
# build/virtiofsd: the pods' file server in the bundle, `make install` and the tests
# (podvm_node/rust_virtiofsd.py); fetched again when Debian's changes.
virtiofsd: $(STAMP)
	$(VENV)/bin/python -m podvm_node.rust_virtiofsd --out build/virtiofsd

# The self-contained podvm a node gets in /opt/podvm (podvm_node/bundle.py): Debian's
# QEMU and Python with their libraries, podvm, the guest. Cached like the guest.
bundle: guest virtiofsd
	$(VENV)/bin/python -m podvm_node.bundle --out $(BUNDLE_DIR)

# OCI layouts and archives of podvm-webhook and podvm-node, no Docker daemon; cached like
# the guest (images/build.py).
images: guest virtiofsd
	$(VENV)/bin/python -m images.build --out build/images

install: deps
	@[ -x $(PREFIX)/venv/bin/python ] || $(PYTHON) -m venv $(PREFIX)/venv
	$(PREFIX)/venv/bin/pip install -q --upgrade pip
	$(PREFIX)/venv/bin/pip install -q .
	ln -sf $(PREFIX)/venv/bin/containerd-shim-podvm-v2 $(BINDIR)/containerd-shim-podvm-v2
	ln -sf $(PREFIX)/venv/bin/podvmctl $(BINDIR)/podvmctl
	ln -sf $(PREFIX)/venv/bin/podvm-webhook $(BINDIR)/podvm-webhook
	$(PREFIX)/venv/bin/python -m podvm_node.rust_virtiofsd --out build/virtiofsd
	install -D -m 0755 build/virtiofsd/virtiofsd $(PREFIX)/libexec/virtiofsd
	@[ "$(PREFIX)" = /opt/podvm ] || echo "note: podvm looks for its virtiofsd in" \
		"/opt/podvm/libexec: set virtio_fs_daemon = \"$(PREFIX)/libexec/virtiofsd\""
	$(PREFIX)/venv/bin/python guest/build.py --out $(GUEST_BUILD)
	install -d $(GUESTDIR)
	install -m 0644 $(GUEST_BUILD)/vmlinux $(GUEST_BUILD)/initrd.img $(GUESTDIR)/
	cp --sparse=always $(GUEST_BUILD)/rootfs.img $(GUESTDIR)/rootfs.img
	@mkdir -p $(CONFDIR)
	@if [ -e $(CONFDIR)/configuration.toml ]; then \
		echo "keeping existing $(CONFDIR)/configuration.toml"; \
	else install -m 0644 packaging/configuration.toml $(CONFDIR)/configuration.toml; \
		echo "installed $(CONFDIR)/configuration.toml"; fi
	@echo "podvm installed: $(BINDIR)/containerd-shim-podvm-v2 -> $(PREFIX)/venv"

uninstall:
	rm -f $(BINDIR)/containerd-shim-podvm-v2 $(BINDIR)/podvmctl $(BINDIR)/podvm-webhook
	rm -rf $(PREFIX) $(GUESTDIR)

test: guest virtiofsd
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Our machines are shared and noisy: the suite must pass with one core taken by
# someone else. The hog runs at normal priority on the first CPU and ends with the run.
test-busy: guest virtiofsd
	@hog_cpu=$$(cut -d, -f1 /sys/fs/cgroup/cpuset/cpuset.cpus 2>/dev/null | cut -d- -f1); \
	taskset -c $${hog_cpu:-0} $(PYTHON) -c 'while True: pass' & hog=$$!; \
	trap "kill $$hog" EXIT; \
	echo "CPU hog (pid $$hog) on CPU $${hog_cpu:-0} for the whole run"; \
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: guest virtiofsd
	$(VENV)/bin/python bench/ttrpc_bench.py
	$(VENV)/bin/python bench/pod_bench.py
	$(VENV)/bin/python bench/scale.py
	$(VENV)/bin/python bench/density.py
	$(VENV)/bin/python bench/hardening_bench.py
	$(VENV)/bin/python bench/accounting_bench.py
	$(VENV)/bin/python bench/resize_bench.py
	$(VENV)/bin/python bench/reservation.py --repeat 3
	$(VENV)/bin/python bench/reservation_vms.py --json build/reservation_vms.json
	$(VENV)/bin/python bench/plot_reservation.py build/reservation_vms.json build/reservation_vms.png
	$(VENV)/bin/python bench/net_bench.py
	$(VENV)/bin/python bench/fs_bench.py
	$(VENV)/bin/python bench/disk_bench.py
	$(VENV)/bin/python bench/fs_bench.py --runtime-only podvm --shared-fs virtio-9p
	$(VENV)/bin/python bench/webhook_bench.py
	$(VENV)/bin/python bench/monitor_bench.py

demo: guest virtiofsd
	$(VENV)/bin/python -m tests.e2e.demo

clean:
	rm -rf $(VENV) build *.egg-info podvm_core/pb .pytest_cache .hypothesis
