#!/bin/bash
# Build the soft-RoCE VM image (Debian's kernel + a bookworm initramfs with rdma_rxe and pyverbs)
# and cache it under tools/rdma-vm/cache/<hash of the build inputs>/. Prints that folder.
# Needs root and tools/rdma-vm/install-host-deps.sh; about 2 minutes from nothing.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PACKAGES=mount,python3-pyverbs,ibverbs-providers,rdma-core,iproute2,kmod,python3-numpy,python3-zmq,python3-pytest
MODULES="crc32_generic crc32-pclmul rdma_rxe ib_uverbs rdma_ucm veth virtio_pci 9p 9pnet_virtio"
KEY=$( (cat "$HERE/build.sh" "$HERE/init") | sha256sum | cut -c1-16)
OUT=$HERE/cache/$KEY
if [ -f "$OUT/initrd.img" ] && [ -f "$OUT/vmlinuz" ]; then echo "$OUT"; exit 0; fi

MIRROR=${MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
W=$HERE/cache/build-$KEY
rm -rf "$W"; mkdir -p "$W"; cd "$W"
log() { echo "[rdma-vm build] $*" >&2; }

log "kernel: Debian's linux-image-amd64"
KPKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
[ -n "$KPKG" ] || { log "apt-cache knows no linux-image-amd64: run apt-get update"; exit 1; }
mkdir kernel
(cd kernel && apt-get download -q "$KPKG" >/dev/null 2>&1 && dpkg-deb -x ./*.deb x)
KV=$(ls kernel/x/lib/modules)
K=kernel/x
depmod -b $K "$KV"

log "root filesystem: mmdebstrap bookworm ($PACKAGES)"
mmdebstrap -q --variant=essential --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --dpkgopt=force-unsafe-io --include=$PACKAGES \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  bookworm rootfs "$MIRROR" >mmdebstrap.log 2>&1 || { tail -40 mmdebstrap.log >&2; exit 1; }

log "modules ($MODULES) and initramfs"
rm -rf rootfs/usr/lib/udev/hwdb.bin rootfs/usr/lib/x86_64-linux-gnu/gconv rootfs/var/cache/debconf/* \
  rootfs/usr/lib/python3.11/test rootfs/usr/share/zoneinfo rootfs/var/lib/apt/lists/*
M=rootfs/usr/lib/modules/$KV
rm -rf "$M"; mkdir -p "$M"
for m in $MODULES; do modprobe -d $K -S "$KV" --show-depends $m; done | awk '/^insmod/{print $2}' |
  sort -u | while read -r f; do
    rel=${f#*/lib/modules/$KV/}; mkdir -p "$M/$(dirname "$rel")"; cp "$f" "$M/$rel"
  done
cp $K/lib/modules/"$KV"/modules.{order,builtin,builtin.modinfo} "$M/"
depmod -b rootfs "$KV"
install -m 755 "$HERE/init" rootfs/init
(cd rootfs && find . -print0 | cpio --null -o -H newc --quiet) | gzip -1 > initrd.img

mkdir -p "$OUT.tmp"
cp $K/boot/vmlinuz-"$KV" "$OUT.tmp/vmlinuz"
mv initrd.img "$OUT.tmp/initrd.img"
echo "$KPKG $KV" > "$OUT.tmp/kernel"
rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
cd "$HERE"; rm -rf "$W"
find "$HERE/cache" -mindepth 1 -maxdepth 1 -not -name "$KEY" -exec rm -rf {} +  # older images
log "image: $OUT ($(du -sh "$OUT" | cut -f1))"
echo "$OUT"
