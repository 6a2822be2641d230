#!/bin/bash
# Boot the soft-RoCE VM under qemu TCG (never KVM), run one command inside from the repo root, and
# power off. Usage: tools/rdma-vm/run.sh COMMAND...   e.g.
#   tools/rdma-vm/run.sh python3 -m pytest tests/rdma -q -p no:cacheprovider
# The repo is shared read-only at /host (the working directory inside); /out is a writable share:
# RDMA_VM_OUT (default: a fresh temporary folder) on the host. The command's output is printed,
# and the exit status is the command's own; 124 when RDMA_VM_TIMEOUT (s, default 600) ran out.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
[ $# -gt 0 ] || { echo "usage: $0 COMMAND..." >&2; exit 2; }
IMAGE=$("$HERE/build.sh")
OUT=${RDMA_VM_OUT:-$(mktemp -d /tmp/rdma-vm-out.XXXXXX)}
mkdir -p "$OUT"; rm -f "$OUT"/{cmd,exit_status,output.log,timing,console.log}
printf '%q ' "$@" > "$OUT/cmd"; echo >> "$OUT/cmd"
T0=$(date +%s.%N)
set +e
timeout --kill-after=10 "${RDMA_VM_TIMEOUT:-600}" qemu-system-x86_64 \
  -accel tcg,thread=multi -cpu max -smp "${RDMA_VM_CPUS:-2}" -m "${RDMA_VM_MEM_MB:-1536}" \
  -kernel "$IMAGE/vmlinuz" -initrd "$IMAGE/initrd.img" \
  -append "console=ttyS0 panic=-1 loglevel=3" -nographic -no-reboot -monitor none -nic none \
  -virtfs local,path="$REPO",mount_tag=host,security_model=none,readonly=on \
  -virtfs local,path="$OUT",mount_tag=out,security_model=none >"$OUT/console.log" 2>&1
QEMU_RC=$?
set -e
T1=$(date +%s.%N)
cat "$OUT/output.log" 2>/dev/null || true
echo "[rdma-vm] qemu exit $QEMU_RC after $(awk "BEGIN{printf \"%.1f\", $T1 - $T0}")s; $(cat "$OUT/timing" 2>/dev/null); output in $OUT" >&2
if [ ! -f "$OUT/exit_status" ]; then
  echo "[rdma-vm] the command did not finish (timeout or VM crash); console:" >&2
  tail -30 "$OUT/console.log" >&2
  [ "$QEMU_RC" -eq 124 ] || [ "$QEMU_RC" -eq 137 ] && exit 124
  exit 1
fi
exit "$(cat "$OUT/exit_status")"
