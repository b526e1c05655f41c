#!/bin/bash
# Open MPI's rsh agent for fake hosts (OMPI_MCA_plm_rsh_agent): runs the command Open MPI would
# run on HOST over ssh on this machine instead, inside a UTS namespace whose host name is HOST.
# Separate daemons per host, node-local ranks and TCP between hosts, with no network beyond this
# machine. Needs root (unshare --uts).
#   fake_rsh.sh HOST COMMAND...   (COMMAND is a shell string, as ssh would pass it)
host=$1
shift
exec unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$*"' "$host" "$@"
