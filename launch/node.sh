#!/usr/bin/env bash
# launch/node.sh: one role of a tandem cluster spread over several nodes (see --help).
#
# Owns: the per-role defaults and checks of a multi-node deployment (bind 0.0.0.0, advertise an
# address the other nodes can reach, a frontend needs the workers' addresses). The plan, GPUs,
# starting, readiness, logs and cleanup are `tandem up`'s: this script runs it, through
# launch/single_node.sh, for one role.
set -euo pipefail

PROG=${0##*/}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
  cat <<EOF
usage: $PROG --role frontend|prefill|decode --model DIR [options] [-- extra engine flags]

Run one role of a multi-node tandem cluster on this node:
  prefill / decode: COUNT workers of that role on this node's GPUs (TP GPUs each), bound to
                    --host (default 0.0.0.0) and advertised as --advertise-host, the address the
                    frontends and the peer workers (bootstrap, NIXL/UCX) reach this node at.
                    When ready it prints the --workers addresses to give the frontend nodes.
  frontend:         FRONTENDS frontend processes on --port, routing to --workers.

options
  --role ROLE              frontend | prefill | decode (required)
  --model DIR              model directory (required; the frontend reads the tokenizer)
  --advertise-host ADDR    workers: this node's address as the others see it (required unless
                           --host is a specific address)
  --host ADDR              bind address (default: 0.0.0.0)
  --auth-keys DIR          the cluster's CURVE key pair, the same on every node (write it once
                           with \`tandem keys init DIR\` and copy it); required
  --count N                workers: how many on this node (default: 1)
  --tp N                   workers: GPUs per worker (default: 1)
  --gpus LIST | --cpu      workers: GPU ids to use (default: all), or none
  --engine NAME            workers: reference | mock | sglang (default: sglang)
  --port-base P            workers: first ZMQ port (default: 7100)
  --bootstrap-port-base P  prefill: first bootstrap port (default: 7200)
  --health-port-base P     workers: first health port (default: 7300)
  --workers ADDRS          frontend: worker addresses, comma-separated: tcp://HOST:PORT for
                           one worker, dns://NAME:PORT for a DNS name with one A record per
                           worker (re-resolved every few seconds)
  --port P                 frontend: HTTP port (default: 8000)
  --frontends N            frontend: processes sharing --port (default: 1)
  --frontend-args 'ARGS'   frontend: extra flags
  --drain-timeout S, --ready-timeout S, --log-dir DIR, --tandem CMD, --dry-run
                           as in single_node.sh (tandem up's flags)
  -h, --help               this text

UCX (the NIXL KV transfer between prefill and decode nodes) reads its settings from the
environment: e.g. UCX_TLS=rc,ud,cuda_copy,cuda_ipc UCX_NET_DEVICES=mlx5_0:1 on InfiniBand,
UCX_TLS=tcp,cuda_copy UCX_NET_DEVICES=eth0 over TCP. Export them before running this script.

example: two prefill nodes, one decode node, one frontend node
  node-a\$ $PROG --role prefill --model /m --auth-keys /k --advertise-host 10.0.0.1 --count 4 --tp 2
  node-b\$ $PROG --role prefill --model /m --auth-keys /k --advertise-host 10.0.0.2 --count 4 --tp 2
  node-c\$ $PROG --role decode  --model /m --auth-keys /k --advertise-host 10.0.0.3 --count 8
  node-d\$ $PROG --role frontend --model /m --auth-keys /k --frontends 4 \\
            --workers tcp://10.0.0.1:7100,tcp://10.0.0.1:7101,...,tcp://10.0.0.3:7107
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
need_val() { [[ $# -ge 2 ]] || die "$1 needs a value"; }

role="" model="" advertise="" host=0.0.0.0 count=1 tp=1 gpu_args=() engine=sglang
port_base=7100 bport_base=7200 hport_base=7300 workers="" http_port=8000 frontends=1
frontend_args="" common=() extra=()

while [[ $# -gt 0 ]]; do
  case $1 in
    --role) need_val "$@"; role=$2; shift 2 ;;
    --model) need_val "$@"; model=$2; shift 2 ;;
    --advertise-host) need_val "$@"; advertise=$2; shift 2 ;;
    --host) need_val "$@"; host=$2; shift 2 ;;
    --count) need_val "$@"; count=$2; shift 2 ;;
    --tp) need_val "$@"; tp=$2; shift 2 ;;
    --gpus) need_val "$@"; gpu_args=(--gpus "$2"); shift 2 ;;
    --cpu) gpu_args=(--cpu); shift ;;
    --engine) need_val "$@"; engine=$2; shift 2 ;;
    --port-base) need_val "$@"; port_base=$2; shift 2 ;;
    --bootstrap-port-base) need_val "$@"; bport_base=$2; shift 2 ;;
    --health-port-base) need_val "$@"; hport_base=$2; shift 2 ;;
    --workers) need_val "$@"; workers=$2; shift 2 ;;
    --port) need_val "$@"; http_port=$2; shift 2 ;;
    --frontends) need_val "$@"; frontends=$2; shift 2 ;;
    --frontend-args) need_val "$@"; frontend_args=$2; shift 2 ;;
    --drain-timeout|--ready-timeout|--log-dir|--tandem|--auth-keys)
      need_val "$@"; common+=("$1" "$2"); shift 2 ;;
    --dry-run) common+=(--dry-run); shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

[[ -n $model ]] || die "--model DIR is required"
[[ $count =~ ^[1-9][0-9]*$ ]] || die "--count must be >= 1, got '$count'"
run=("$HERE/single_node.sh" --model "$model" --host "$host" ${common[@]+"${common[@]}"})

case $role in
  prefill|decode)
    [[ -z $workers ]] || die "--workers is for --role frontend"
    if [[ -z $advertise ]]; then
      case $host in
        0.0.0.0|::|'[::]') die "--advertise-host ADDR is required with --host $host: the address the frontends and the peer workers reach this node at" ;;
        *) advertise=$host ;;
      esac
    fi
    case $advertise in
      127.*|localhost|::1) echo "$PROG: warning: advertising $advertise: other nodes cannot reach it" >&2 ;;
    esac
    if [[ $role == prefill ]]; then n_prefill=$count n_decode=0; else n_prefill=0 n_decode=$count; fi
    run+=(--prefill "$n_prefill" --decode "$n_decode" --tp "$tp" --engine "$engine" --frontends 0
          --advertise-host "$advertise" --worker-port-base "$port_base"
          --bootstrap-port-base "$bport_base" --health-port-base "$hport_base"
          ${gpu_args[@]+"${gpu_args[@]}"})
    ;;
  frontend)
    [[ -n $workers ]] || die "--role frontend needs --workers ADDRS (tcp://HOST:PORT or dns://NAME:PORT, comma-separated)"
    (( ${#extra[@]} == 0 )) || die "engine flags after -- are for worker roles"
    [[ $frontends =~ ^[1-9][0-9]*$ ]] || die "--frontends must be >= 1, got '$frontends'"
    run+=(--prefill 0 --decode 0 --frontends "$frontends" --workers "$workers" --port "$http_port"
          --frontend-args "$frontend_args")
    ;;
  "") die "--role is required (frontend, prefill or decode)" ;;
  *) die "--role must be frontend, prefill or decode, got '$role'" ;;
esac

if (( ${#extra[@]} > 0 )); then run+=(-- "${extra[@]}"); fi
exec "${run[@]}"
