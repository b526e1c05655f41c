#!/bin/bash
# Open MPI's rsh agent for a fake host that starts, as ssh does, with a login's bare environment:
# nothing of mpirun's environment reaches the daemon on HOST, so a rank there sees only what mpirun
# forwards (-x). Wraps tests/dist/fake_rsh.sh (a UTS namespace named after HOST). Needs root.
#   clean_env_rsh.sh HOST COMMAND...
exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$HOME" "$(dirname "$0")/../dist/fake_rsh.sh" "$@"
