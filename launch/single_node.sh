#!/usr/bin/env bash
# launch/single_node.sh: an xPyD tandem cluster on one node's GPUs, through `tandem up` (see --help).
#
# A thin wrapper: it gives `tandem up` this script's defaults (1 prefill + 1 decode worker, ports
# counted from 7100, 7200 and 7300, 600 s to get ready, one log per process in a new directory)
# and accepts its older flag names, then execs it. The plan, the GPUs each worker gets, the ports,
# the cluster's keys, starting, readiness, supervision and stopping by PID are all tandem up's
# (components/tandem/up.py). launch/node.sh runs one role through this script.
set -euo pipefail

PROG=${0##*/}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
  cat <<EOF
usage: $PROG --model DIR [options] [-- extra engine flags]

Start P prefill and D decode workers on this node's GPUs and N frontends in front of them, with
\`tandem up\`: each worker gets its own GPUs (CUDA_VISIBLE_DEVICES), ZMQ, health and (prefill)
bootstrap port; the frontends share one HTTP port. Every option is a \`tandem up\` flag (its help
follows); this script sets other defaults and also takes a few older names:

defaults (give the flag to change one)
  --prefill 1 --decode 1 --workers 0     one prefill and one decode worker, no aggregated one
  --worker-base-port 7100 --bootstrap-base-port 7200 --health-base-port 7300
  --ready-timeout 600 --log-dir \${TMPDIR:-/tmp}/tandem-DATE-PID
other names
  --worker-port-base P, --bootstrap-port-base P, --health-port-base P
                           the same as --worker-base-port, --bootstrap-base-port,
                           --health-base-port
  --workers ADDRS          worker addresses for the frontends besides the ones started here
                           (tandem up's --worker-addresses; tcp://H:P or dns://NAME:P)
  --frontend-args 'ARGS'   more frontend flags, split on spaces (tandem up takes them as they are)
this script's own
  --tandem CMD             the tandem executable (default: tandem on PATH, else the repository's
                           .venv/bin/tandem)
  -h, --help               this text, then tandem up's

examples
  $PROG --model /models/llama --engine sglang --prefill 2 --decode 2 --tp 2 \\
        --gpus 0,1,2,3,4,5,6,7 --dry-run                     # the plan: one line per process
  $PROG --model /models/llama --engine sglang --prefill 2 --decode 2 --tp 2 \\
        --gpus 0,1,2,3,4,5,6,7 -- --mem-fraction-static 0.8
  $PROG --model models/tiny --cpu --engine mock --frontends 2   # no GPU
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
need_val() { [[ $# -ge 2 ]] || die "$1 needs a value"; }

tandem_cmd="" help=0 args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --worker-port-base) need_val "$@"; args+=(--worker-base-port "$2"); shift 2 ;;
    --bootstrap-port-base) need_val "$@"; args+=(--bootstrap-base-port "$2"); shift 2 ;;
    --health-port-base) need_val "$@"; args+=(--health-base-port "$2"); shift 2 ;;
    --workers) need_val "$@"; args+=(--worker-addresses "$2"); shift 2 ;;
    --frontend-args) need_val "$@"; read -r -a split <<<"$2"; args+=(${split[@]+"${split[@]}"}); shift 2 ;;
    --tandem) need_val "$@"; tandem_cmd=$2; shift 2 ;;
    -h|--help) help=1; shift ;;
    --) args+=("$@"); break ;;
    *) args+=("$1"); shift ;;
  esac
done

if [[ -z $tandem_cmd ]]; then
  if command -v tandem >/dev/null 2>&1; then tandem_cmd=tandem
  elif [[ -x $HERE/../.venv/bin/tandem ]]; then tandem_cmd=$(cd "$HERE/.." && pwd)/.venv/bin/tandem
  else die "no tandem executable: put tandem on PATH, or pass --tandem CMD"
  fi
fi
read -r -a tandem_argv <<<"$tandem_cmd"
if (( help == 1 )); then
  usage
  echo
  exec "${tandem_argv[@]}" up --help
fi

defaults=(--prefill 1 --decode 1 --workers 0 --worker-base-port 7100 --bootstrap-base-port 7200
          --health-base-port 7300 --ready-timeout 600
          --log-dir "${TMPDIR:-/tmp}/tandem-$(date +%Y%m%d-%H%M%S)-$$")
exec "${tandem_argv[@]}" up "${defaults[@]}" ${args[@]+"${args[@]}"}
