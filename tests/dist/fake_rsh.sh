#!/bin/bash
# Open MPI's rsh agent for fake hosts (OMPI_MCA_plm_rsh_agent): runs the command Open MPI would
# run on HOST over ssh on this machine instead, inside a UTS namespace whose host name is HOST.
# Separate daemons per host, node-local ranks and TCP between hosts, with no network beyond this
# machine. Needs root (unshare --uts).
#   fake_rsh.sh HOST COMMAND...   (COMMAND is a shell string, as ssh would pass it)
#
# Per-host files: with LOOM_TEST_PER_HOST_FILE=PATH and a file PATH.HOST, the host also gets a
# mount namespace of its own in which PATH.HOST is bind-mounted onto PATH, so every host reads its
# own file at one path, as real hosts read their own /etc (a per-host topology file, say).
#
# Hosts that are down: with LOOM_TEST_DOWN_HOSTS=DIR, a host with a file DIR/HOST answers as ssh
# does for a machine that is off (exit 255), so Open MPI cannot start anything there.
host=$1
shift
if [ -n "${LOOM_TEST_DOWN_HOSTS:-}" ] && [ -e "$LOOM_TEST_DOWN_HOSTS/$host" ]; then
  echo "ssh: connect to host $host port 22: No route to host" >&2
  exit 255
fi
per_host=${LOOM_TEST_PER_HOST_FILE:-}
if [ -n "$per_host" ] && [ -f "$per_host.$host" ]; then
  exec unshare --uts --mount --propagation private /bin/sh -c \
    'hostname "$0" && mount --bind "$1" "$2" && shift 2 && exec /bin/sh -c "$*"' "$host" "$per_host.$host" "$per_host" "$@"
fi
exec unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$*"' "$host" "$@"
