#!/bin/bash
# Host packages for the soft-RoCE VM tier (Debian, as root): qemu to boot the VM, mmdebstrap to
# build its root filesystem, kmod/cpio to assemble the initramfs, and Debian's pyverbs for the
# host-side tests of device discovery (they expect "no RDMA device" here).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  qemu-system-x86 mmdebstrap kmod cpio python3-pyverbs >/dev/null
echo "rdma-vm host deps: $(qemu-system-x86_64 --version | head -1); mmdebstrap $(mmdebstrap --version | awk '{print $2}')"
