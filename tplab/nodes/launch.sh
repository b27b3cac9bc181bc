#!/bin/sh
# tplab's launcher for MPICH's hydra (mpiexec -launcher ssh -launcher-exec THIS): hydra calls it as it
# calls ssh, "THIS [ssh options] HOST COMMAND...", to start its proxy on HOST. Here a host is a network
# namespace named tplab-nodeK (tplab nodes up made it): the command runs inside that namespace, in a UTS
# namespace of its own whose hostname is the node's name (as a real node has its own).
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done   # ssh's options (hydra passes -x)
host=$1
shift
case $host in
    tplab-node[0-9]*) ;;
    *) echo "tplab nodes launcher: '$host' is not a tplab node (tplab-node0, tplab-node1, ...)" >&2; exit 1;;
esac
# like ssh: the rest is one command line for a shell on the remote side
exec ip netns exec "$host" unshare --uts sh -c "hostname $host && exec $*"
