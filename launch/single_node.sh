#!/usr/bin/env bash
# launch/single_node.sh: an xPyD tandem cluster on one node's GPUs (see --help).
#
# Owns: the plan (which GPUs and ports each process gets, and its exact command), starting the
# processes (each in its own session, so a stop reaches its children too), waiting for readiness
# with a deadline, and stopping everything it started -- by the PIDs it recorded, never by name --
# when any of them exits or on SIGINT/SIGTERM. launch/node.sh runs one role through this script.
set -euo pipefail

PROG=${0##*/}
if (( BASH_VERSINFO[0] < 5 )); then echo "$PROG: needs bash >= 5 (wait -n, EPOCHREALTIME)" >&2; exit 2; fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
  cat <<EOF
usage: $PROG --model DIR [options] [-- extra engine flags]

Start P prefill and D decode workers on this node's GPUs and N frontends in front of them.
Each worker gets its own GPUs (CUDA_VISIBLE_DEVICES), ZMQ port, health port and (prefill)
bootstrap port; all frontends share one HTTP port (SO_REUSEPORT). The script waits until every
worker's /health and the frontends' /health answer 200, then watches: when any process exits, or
on Ctrl-C / SIGTERM, it stops every process it started (SIGTERM, then SIGKILL after the drain
deadline + 5 s) and exits. Logs: one file per process in --log-dir.

workers and GPUs
  --prefill N              prefill workers (default: 1)
  --decode N               decode workers (default: 1)
  --tp N                   GPUs per worker, both roles (default: 1)
  --prefill-tp N           GPUs per prefill worker (default: --tp)
  --decode-tp N            GPUs per decode worker (default: --tp)
  --gpus LIST              GPU ids to use, in order: prefill workers first, then decode
                           (default: \$CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists)
  --cpu                    assign no GPUs (engines on CPU: --engine mock or reference)
  --engine NAME            reference | mock | sglang (default: reference); sglang gets
                           --tp-size from the TP above unless the extra flags set it
  --model DIR              model directory (required)
ports and addresses
  --host ADDR              bind address of workers and frontends (default: 127.0.0.1)
  --advertise-host ADDR    address other processes reach the workers at (default: --host,
                           or 127.0.0.1 when --host is 0.0.0.0)
  --worker-port-base P     ZMQ port of the first worker; workers count up (default: 7100)
  --bootstrap-port-base P  bootstrap port of the first prefill worker (default: 7200)
  --health-port-base P     health port of the first worker (default: 7300)
  --port P                 HTTP port of the frontends (default: 8000)
frontends
  --frontends N            frontend processes on --port, 0 for workers only (default: 1)
  --workers ADDRS          more worker addresses for the frontends (tcp://H:P or dns://NAME:P)
  --frontend-args 'ARGS'   extra frontend flags, split on spaces
  --auth-keys DIR          the cluster's CURVE keys (\`tandem keys init DIR\`), passed to every
                           process; required to bind, or reach workers, beyond loopback
process control
  --drain-timeout S        drain deadline passed to every process (default: 10)
  --ready-timeout S        give up when not ready after this long (default: 600)
  --log-dir DIR            per-process logs (default: \${TMPDIR:-/tmp}/tandem-DATE-PID)
  --tandem CMD             the tandem executable (default: tandem on PATH, else .venv/bin/tandem)
  --dry-run                print the plan (one line per process, tab-separated key=value
                           fields, cmd= last) and start nothing
  -h, --help               this text

example: 8 GPUs as 2 prefill + 2 decode workers of 2 GPUs each
  $PROG --model /models/llama --engine sglang --prefill 2 --decode 2 --tp 2 --gpus 0,1,2,3,4,5,6,7 \\
        -- --mem-fraction-static 0.8
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
note() { echo "$PROG: $*" >&2; }
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
need_val() { [[ $# -ge 2 ]] || die "$1 needs a value"; }

prefill=1 decode=1 tp="" prefill_tp="" decode_tp="" gpus_arg="" cpu=0 engine=reference model=""
host=127.0.0.1 advertise="" wport=7100 bport=7200 hport=7300 http_port=8000 frontends=1
extra_workers="" frontend_args="" auth_keys="" drain=10 ready_timeout=600 log_dir="" tandem_cmd="" dry_run=0
extra=()

while [[ $# -gt 0 ]]; do
  case $1 in
    --prefill) need_val "$@"; prefill=$2; shift 2 ;;
    --decode) need_val "$@"; decode=$2; shift 2 ;;
    --tp) need_val "$@"; tp=$2; shift 2 ;;
    --prefill-tp) need_val "$@"; prefill_tp=$2; shift 2 ;;
    --decode-tp) need_val "$@"; decode_tp=$2; shift 2 ;;
    --gpus) need_val "$@"; gpus_arg=$2; shift 2 ;;
    --cpu) cpu=1; shift ;;
    --engine) need_val "$@"; engine=$2; shift 2 ;;
    --model) need_val "$@"; model=$2; shift 2 ;;
    --host) need_val "$@"; host=$2; shift 2 ;;
    --advertise-host) need_val "$@"; advertise=$2; shift 2 ;;
    --worker-port-base) need_val "$@"; wport=$2; shift 2 ;;
    --bootstrap-port-base) need_val "$@"; bport=$2; shift 2 ;;
    --health-port-base) need_val "$@"; hport=$2; shift 2 ;;
    --port) need_val "$@"; http_port=$2; shift 2 ;;
    --frontends) need_val "$@"; frontends=$2; shift 2 ;;
    --workers) need_val "$@"; extra_workers=$2; shift 2 ;;
    --frontend-args) need_val "$@"; frontend_args=$2; shift 2 ;;
    --auth-keys) need_val "$@"; auth_keys=$2; shift 2 ;;
    --drain-timeout) need_val "$@"; drain=$2; shift 2 ;;
    --ready-timeout) need_val "$@"; ready_timeout=$2; shift 2 ;;
    --log-dir) need_val "$@"; log_dir=$2; shift 2 ;;
    --tandem) need_val "$@"; tandem_cmd=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option '$1' (see --help; engine flags go after --)" ;;
  esac
done

# --- validate ---------------------------------------------------------------------------------
[[ -n $model ]] || die "--model DIR is required"
case $engine in reference|mock|sglang) ;; *) die "--engine must be reference, mock or sglang" ;; esac
tp=${tp:-1}; prefill_tp=${prefill_tp:-$tp}; decode_tp=${decode_tp:-$tp}
for pair in "prefill:$prefill" "decode:$decode" "frontends:$frontends" "drain-timeout:$drain" \
            "ready-timeout:$ready_timeout"; do
  is_uint "${pair#*:}" || die "--${pair%%:*} must be a whole number, got '${pair#*:}'"
done
for pair in "tp:$tp" "prefill-tp:$prefill_tp" "decode-tp:$decode_tp"; do
  { is_uint "${pair#*:}" && (( ${pair#*:} >= 1 )); } || die "--${pair%%:*} must be >= 1"
done
for pair in "worker-port-base:$wport" "bootstrap-port-base:$bport" "health-port-base:$hport" \
            "port:$http_port"; do
  { is_uint "${pair#*:}" && (( ${pair#*:} >= 1 && ${pair#*:} <= 65535 )); } \
    || die "--${pair%%:*} must be a port (1-65535), got '${pair#*:}'"
done
nworkers=$(( prefill + decode ))
(( nworkers + frontends > 0 )) || die "nothing to start: no workers and no frontends"
if (( frontends > 0 && nworkers == 0 )) && [[ -z $extra_workers ]]; then
  die "frontends without local workers need --workers ADDRS"
fi
if [[ $engine != sglang ]] && (( prefill_tp > 1 || decode_tp > 1 )); then
  note "warning: engine $engine runs on one device; TP > 1 only reserves GPUs"
fi
if [[ -z $advertise ]]; then
  case $host in 0.0.0.0|::|'[::]') advertise=127.0.0.1 ;; *) advertise=$host ;; esac
fi
case $host in 0.0.0.0|::|'[::]') probe_host=127.0.0.1 ;; *) probe_host=$host ;; esac
is_loopback() { case $1 in 127.*|localhost|::1|'[::1]') return 0 ;; *) return 1 ;; esac; }
if [[ -z $auth_keys ]]; then  # the runtime refuses unauthenticated ZMQ beyond loopback: say so now
  if (( nworkers > 0 )) && ! is_loopback "$host"; then
    die "workers bound to $host (beyond loopback) need --auth-keys DIR (write one with: tandem keys init DIR)"
  fi
  if (( frontends > 0 )) && [[ -n $extra_workers ]]; then
    IFS=, read -r -a entries <<<"$extra_workers"
    for e in "${entries[@]}"; do
      e=${e#*://}; e=${e%:*}
      is_loopback "$e" || die "frontends reaching workers beyond loopback ($e) need --auth-keys DIR"
    done
  fi
fi
auth_args=()
if [[ -n $auth_keys ]]; then auth_args=(--auth-keys "$auth_keys"); fi

# --- GPUs ---------------------------------------------------------------------------------------
need_gpus=$(( prefill * prefill_tp + decode * decode_tp ))
gpus=()
if (( cpu == 0 && nworkers > 0 )); then
  if [[ -n $gpus_arg ]]; then
    IFS=, read -r -a gpus <<<"$gpus_arg"
  elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true)
  fi
  (( ${#gpus[@]} > 0 )) || die "no GPUs found (no --gpus, CUDA_VISIBLE_DEVICES or nvidia-smi); pass --gpus LIST, or --cpu"
  declare -A seen_gpu=()
  for g in "${gpus[@]}"; do
    is_uint "$g" || die "--gpus: '$g' is not a GPU id (want e.g. 0,1,2,3)"
    [[ -z ${seen_gpu[$g]:-} ]] || die "--gpus: GPU $g is listed twice"
    seen_gpu[$g]=1
  done
  (( need_gpus <= ${#gpus[@]} )) || die "not enough GPUs: $prefill prefill x TP$prefill_tp + $decode decode x TP$decode_tp need $need_gpus, have ${#gpus[@]} (${gpus[*]})"
  (( need_gpus == ${#gpus[@]} )) || note "warning: using $need_gpus of ${#gpus[@]} GPUs"
fi

if [[ -z $tandem_cmd ]]; then
  if command -v tandem >/dev/null 2>&1; then tandem_cmd=tandem
  elif [[ -x $HERE/../.venv/bin/tandem ]]; then tandem_cmd=$(cd "$HERE/.." && pwd)/.venv/bin/tandem
  else tandem_cmd=tandem
  fi
fi
read -r -a tandem_argv <<<"$tandem_cmd"
read -r -a frontend_extra <<<"$frontend_args"
log_dir=${log_dir:-${TMPDIR:-/tmp}/tandem-$(date +%Y%m%d-%H%M%S)-$$}
extra_has_tp=0
for a in ${extra[@]+"${extra[@]}"}; do
  case $a in --tp-size|--tp-size=*|--tp|--tp=*) extra_has_tp=1 ;; esac
done

# --- plan: one entry per process ----------------------------------------------------------------
names=() kinds=() cmds=() health_urls=() info=()
T=$'\t'
declare -A port_owner=()
claim_port() {  # port, what
  (( $1 >= 1 && $1 <= 65535 )) || die "$2: port $1 is out of range (1-65535)"
  [[ -z ${port_owner[$1]:-} ]] || die "overlapping ports: $1 is both ${port_owner[$1]} and $2"
  port_owner[$1]=$2
}
quote() { local out="" a; for a in "$@"; do out+="$(printf '%q' "$a") "; done; printf '%s' "${out% }"; }

worker_addrs=()
gpu_next=0
for (( i = 0; i < nworkers; i++ )); do
  if (( i < prefill )); then role=prefill; idx=$i; wtp=$prefill_tp
  else role=decode; idx=$(( i - prefill )); wtp=$decode_tp
  fi
  name=$role-$idx
  zport=$(( wport + i )); hp=$(( hport + i ))
  claim_port "$zport" "$name ZMQ"
  claim_port "$hp" "$name health"
  if (( cpu == 1 )); then devs=""
  else devs=$(IFS=,; echo "${gpus[*]:gpu_next:wtp}"); gpu_next=$(( gpu_next + wtp ))
  fi
  cmd=(env "CUDA_VISIBLE_DEVICES=$devs" "${tandem_argv[@]}" worker --role "$role" --engine "$engine"
       --model "$model" --host "$host" --port "$zport" --advertise-host "$advertise")
  bp=-
  if [[ $role == prefill ]]; then
    bp=$(( bport + idx )); claim_port "$bp" "$name bootstrap"
    cmd+=(--bootstrap-port "$bp")
  fi
  cmd+=(--health-port "$hp" --drain-timeout "$drain" ${auth_args[@]+"${auth_args[@]}"})
  if (( cpu == 0 )) && [[ $engine == reference ]]; then cmd+=(--device cuda); fi
  if [[ $engine == sglang ]] && (( extra_has_tp == 0 )); then cmd+=(--tp-size "$wtp"); fi
  cmd+=(${extra[@]+"${extra[@]}"})
  addr=tcp://$advertise:$zport
  worker_addrs+=("$addr")
  names+=("$name"); kinds+=(worker); cmds+=("$(quote "${cmd[@]}")")
  health_urls+=("http://$probe_host:$hp/health")
  info+=("role=$role${T}gpus=${devs:--}${T}port=$zport${T}bootstrap_port=$bp${T}health_port=$hp${T}address=$addr")
done

all_workers=$(IFS=,; echo "${worker_addrs[*]}")
if [[ -n $extra_workers ]]; then all_workers=${all_workers:+$all_workers,}$extra_workers; fi
if (( frontends > 0 )); then claim_port "$http_port" "frontend HTTP"; fi
for (( i = 0; i < frontends; i++ )); do
  cmd=("${tandem_argv[@]}" frontend --model "$model" --workers "$all_workers" --host "$host"
       --port "$http_port" --drain-timeout "$drain" ${auth_args[@]+"${auth_args[@]}"})
  if (( frontends > 1 )); then cmd+=(--reuse-port); fi  # N processes on one port
  cmd+=(${frontend_extra[@]+"${frontend_extra[@]}"})
  names+=("frontend-$i"); kinds+=(frontend); cmds+=("$(quote "${cmd[@]}")")
  health_urls+=("http://$probe_host:$http_port/health")
  info+=("role=frontend${T}gpus=-${T}port=$http_port${T}bootstrap_port=-${T}health_port=$http_port${T}address=http://$probe_host:$http_port")
done

used_gpus=$(IFS=,; echo "${gpus[*]:0:need_gpus}")
print_plan() {
  printf 'plan\tprefill=%s\tdecode=%s\tprefill_tp=%s\tdecode_tp=%s\tgpus=%s\tfrontends=%s\thttp_port=%s\tengine=%s\tlog_dir=%s\tworkers=%s\n' \
    "$prefill" "$decode" "$prefill_tp" "$decode_tp" "${used_gpus:--}" \
    "$frontends" "$http_port" "$engine" "$log_dir" "${all_workers:--}"
  local i
  for i in "${!names[@]}"; do
    printf '%s\tname=%s\t%s\tlog=%s\tcmd=%s\n' "${kinds[$i]}" "${names[$i]}" "${info[$i]}" \
      "$log_dir/${names[$i]}.log" "${cmds[$i]}"
  done
}

if (( dry_run == 1 )); then print_plan; exit 0; fi

# --- run ----------------------------------------------------------------------------------------
mkdir -p "$log_dir"
print_plan >"$log_dir/plan.tsv"
pids=()
use_setsid=0; command -v setsid >/dev/null 2>&1 && use_setsid=1

alive() { kill -0 "$1" 2>/dev/null; }
now_ms() { local t=${EPOCHREALTIME//[.,]/}; echo $(( t / 1000 )); }  # bash 5: microseconds
signal_proc() {  # signal, pid: the process's own group when it has one (setsid), else the PID
  if (( use_setsid == 1 )); then kill "-$1" -- "-$2" 2>/dev/null || kill "-$1" "$2" 2>/dev/null || true
  else kill "-$1" "$2" 2>/dev/null || true
  fi
}
stop_group() {  # stop the listed indexes: SIGTERM, then SIGKILL past drain + 5 s
  local i deadline=$(( $(now_ms) + (drain + 5) * 1000 )) left
  for i in "$@"; do signal_proc TERM "${pids[$i]}"; done
  while :; do
    left=0
    for i in "$@"; do if alive "${pids[$i]}"; then left=1; fi; done
    if (( left == 0 || $(now_ms) >= deadline )); then break; fi
    sleep 0.2
  done
  for i in "$@"; do
    if alive "${pids[$i]}"; then
      note "${names[$i]} (pid ${pids[$i]}) did not stop within $(( drain + 5 )) s: SIGKILL"
      signal_proc KILL "${pids[$i]}"
    fi
  done
}
stopping=0
cleanup() {
  (( stopping == 0 )) || return 0
  stopping=1
  trap '' INT TERM
  local i fe=() wk=()
  for i in "${!pids[@]}"; do
    if [[ ${kinds[$i]} == frontend ]]; then fe+=("$i"); else wk+=("$i"); fi
  done
  note "stopping ${#pids[@]} process(es)"
  (( ${#fe[@]} == 0 )) || stop_group "${fe[@]}"   # frontends first: no new requests
  (( ${#wk[@]} == 0 )) || stop_group "${wk[@]}"
  for i in "${!pids[@]}"; do wait "${pids[$i]}" 2>/dev/null || true; done
}
on_signal() { note "got $1"; cleanup; exit "$2"; }
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGTERM 143' TERM
trap cleanup EXIT

for i in "${!names[@]}"; do
  eval "cmd=(${cmds[$i]})"
  if (( use_setsid == 1 )); then setsid "${cmd[@]}" >"$log_dir/${names[$i]}.log" 2>&1 </dev/null &
  else "${cmd[@]}" >"$log_dir/${names[$i]}.log" 2>&1 </dev/null &
  fi
  pids[i]=$!
  note "started ${names[$i]} (pid ${pids[$i]}), log $log_dir/${names[$i]}.log"
done

http_ok() {
  if command -v curl >/dev/null 2>&1; then
    curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null
  else
    python3 -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)' "$1" 2>/dev/null
  fi
}
died() {  # index: report and stop everything
  local i=$1
  note "${names[$i]} (pid ${pids[$i]}) exited; last lines of its log:"
  tail -n 20 "$log_dir/${names[$i]}.log" >&2 || true
  cleanup
  exit 1
}
wait_ready() {  # kind: every process of that kind answers 200 on its health URL
  local i deadline=$(( $(now_ms) + ready_timeout * 1000 )) pending
  while :; do
    pending=0
    for i in "${!names[@]}"; do
      [[ ${kinds[$i]} == "$1" ]] || continue
      alive "${pids[$i]}" || died "$i"
      http_ok "${health_urls[$i]}" || pending=1
    done
    (( pending == 0 )) && return 0
    if (( $(now_ms) >= deadline )); then
      note "not ready after ${ready_timeout} s (logs in $log_dir)"; cleanup; exit 1
    fi
    sleep 0.5
  done
}
wait_ready worker
note "workers ready: $all_workers"
if (( frontends > 0 )); then
  wait_ready frontend
  # Frontends share the port: the kernel spreads new connections over them, so ask several
  # times in a row before calling them all ready.
  ok=0
  while (( ok < 4 * frontends )); do
    if http_ok "http://$probe_host:$http_port/health"; then ok=$(( ok + 1 )); else ok=0; wait_ready frontend; fi
  done
  note "ready: http://$probe_host:$http_port (logs in $log_dir)"
fi
echo "ready"

# Watch: the first process to exit (for any reason) ends the cluster.
while :; do
  rc=0
  wait -n || rc=$?
  for i in "${!pids[@]}"; do
    alive "${pids[$i]}" || { note "${names[$i]} exited (status $rc)"; died "$i"; }
  done
done
