#!/usr/bin/env bash
# The working tree a device call carries is limited (the device tool: 64 MiB, the carried .whl
# included), and the committed records outgrew it on 2026-12-06 (54.8 MB tracked, .whl 12.9
# MB). Before a session's device calls, leave the records' tarballs and figures out of the
# working tree; after them, put them back. They stay tracked and committed throughout (git
# sparse-checkout), and nothing a device call runs reads them.
#   bash benchmarks/device_tree.sh slim     # then the calls, e.g. bash benchmarks/gpu_session.sh
#   bash benchmarks/device_tree.sh full
#   bash benchmarks/device_tree.sh size     # bytes that would travel, .whl included
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
case "${1:-size}" in
  slim) git sparse-checkout set --no-cone '/*' '!/benchmarks/results/**/*.xz' \
          '!/benchmarks/results/**/*.png' ;;
  full) git sparse-checkout disable ;;
  size) ;;
  *) echo "usage: bash benchmarks/device_tree.sh slim|full|size" >&2; exit 2 ;;
esac
# what travels: the tracked files on disk, the untracked ones git does not ignore, and .whl
{ git ls-files -z; git ls-files -z --others --exclude-standard; find .whl -type f -print0 2>/dev/null || true; } \
  | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
  | du -cb --files0-from=- | tail -1 \
  | awk '{printf "%.1f MiB would travel (the limit: 64 MiB)\n", $1 / 1048576}'
