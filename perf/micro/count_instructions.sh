#!/usr/bin/env bash
# The frontend app's instructions per streamed token, counted by valgrind (callgrind), for one or
# more checkouts: a count, not a time, so it holds on a busy machine. Each checkout runs
# perf/micro/bench_app_inprocess.py twice, at 20 and at 120 tokens per request (200 requests);
# the difference over the 20,000 extra tokens is the per-token figure (start-up and per-request
# work cancel out).
#     perf/micro/count_instructions.sh [--task] CHECKOUT...   # --task: without the write-now calls
set -euo pipefail
nowait=--nowait
if [ "${1:-}" = "--task" ]; then nowait=""; shift; fi
py=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
for t in "$@"; do
  t=$(cd "$t" && pwd)
  declare -A n=()
  for tokens in 20 120; do
    n[$tokens]=$(cd "$t/perf/micro" && PYTHONPATH="$t/runtime:$t/components" \
      valgrind --tool=callgrind --callgrind-out-file=/dev/null "$py" bench_app_inprocess.py \
      --requests 200 --tokens "$tokens" $nowait 2>&1 | awk '/Collected/ {print $4}')
  done
  echo "$t $(( (n[120] - n[20]) / 20000 )) instructions per token (${nowait:-task route})"
done
