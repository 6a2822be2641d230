#!/bin/sh
# Runs inside the VM (called by its /init): soft-RoCE device rxe0 on one end of a veth pair, then
# the command the host left in /out/cmd, from /host (the repo); its output and exit status go
# back through /out. A veth pair keeps every RoCE packet inside the VM: no qemu network at all.
ip link add veth0 type veth peer name veth1
ip addr add 192.0.2.1/24 dev veth0
ip link set veth1 up
ip link set veth0 up
rdma link add rxe0 type rxe netdev veth0 || echo "[guest] rdma link add failed"
rdma link >/out/rdma-link.txt 2>&1
echo "[guest] rxe0 ready at uptime $(cut -d' ' -f1 /proc/uptime)s"
cd /host
# The repo's venv (same Python ABI as Debian's python3) first, so that the tests import the
# versions the host tests use (its pandas needs a newer numpy than Debian's); Debian's own
# dist-packages, which python3 adds after PYTHONPATH, supply pyverbs (python3-pyverbs).
export PYTHONPATH=/host:$(echo /host/.venv/lib/python3*/site-packages | tr ' ' :)
export PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
START=$(cut -d' ' -f1 /proc/uptime)
sh /out/cmd >/out/output.log 2>&1
echo $? >/out/exit_status
END=$(cut -d' ' -f1 /proc/uptime)
echo "boot_s=$START end_s=$END" >/out/timing
echo "[guest] command exited $(cat /out/exit_status) at uptime ${END}s"
