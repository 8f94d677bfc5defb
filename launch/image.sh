#!/usr/bin/env bash
# launch/image.sh: build tandem's container images from the Containerfile (see --help).
#
# Owns: the wheelhouse the Containerfile installs from (build/image/wheels), the Debian base of
# the cpu image where no image registry is reachable (debootstrap, from Debian's packages), the
# build itself with podman or docker, and the push. Versions come from the Containerfile's ARGs,
# which tests/deploy/test_image.py holds equal to the project's pins.
set -euo pipefail

PROG=${0##*/}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CF=$ROOT/Containerfile
WHEELS=$ROOT/build/image/wheels
LOCAL_BASE=localhost/tandem-base:bookworm

usage() {
  cat <<EOF
usage: $PROG cpu|gpu|wheels [options]

  cpu      the CPU image (reference and mock engines, frontends, perf tools): Debian 12, python3,
           a venv installed offline from the wheelhouse (torch's CPU build included)
  gpu      the GPU image: SGLang's official image of the pinned release + NIXL + tandem
           (pulls that image: needs its registry)
  wheels   only fill the wheelhouse ($WHEELS)

options
  --tag NAME:TAG   image name (default: tandem:<version>-cpu, tandem:<version>)
  --base IMAGE     the image to build FROM. cpu: a Debian 12; by default one made here with
                   debootstrap from Debian's packages and kept for later builds as
                   $LOCAL_BASE (with a registry in reach, e.g.
                   docker.io/library/debian:bookworm-slim). gpu: SGLang's image of the pinned
                   release (default: the Containerfile's SGLANG_IMAGE), e.g. your mirror of it
  --tool NAME      podman or docker (default: podman if present, else docker); where neither is
                   present and apt-get is, podman, runc and debootstrap are installed
  --push REPO      then push the image as REPO:TAG (e.g. registry.example.com/tandem)
  --python PY      the Python whose pip fills the wheelhouse (default: \$PYTHON or python3);
                   torch's CPU build must be on its indexes (pip config / PIP_EXTRA_INDEX_URL)
EOF
}

die() { echo "$PROG: $*" >&2; exit 1; }
pin() { sed -n "s/^ARG $1=//p" "$CF" | head -1; }  # a version pinned in the Containerfile

TARGET=${1:-}; [[ $TARGET == -h || $TARGET == --help ]] && { usage; exit 0; }
[[ $TARGET == cpu || $TARGET == gpu || $TARGET == wheels ]] || { usage >&2; exit 2; }
shift
TAG='' BASE='' TOOL='' PUSH='' PY=${PYTHON:-python3}
while (( $# )); do
  case $1 in
    --tag) TAG=${2:?}; shift 2 ;;
    --base) BASE=${2:?}; shift 2 ;;
    --tool) TOOL=${2:?}; shift 2 ;;
    --push) PUSH=${2:?}; shift 2 ;;
    --python) PY=${2:?}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done

VERSION=$(pin TANDEM_VERSION) TORCH=$(pin TORCH_VERSION) NIXL=$(pin NIXL_VERSION)
[[ -n $VERSION && -n $TORCH && -n $NIXL ]] || die "no version ARGs in $CF"
ARCH=$(uname -m)
# What tandem the image holds: its sources and pins, hashed (a label; tests/deploy/test_image.py
# runs the image only when it holds this checkout's tandem).
SOURCE=$(cd "$ROOT" && { find runtime components -name '*.py'; echo pyproject.toml; } |
  LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)

wheels() {  # $1 = cpu: everything the cpu image installs (offline); gpu: tandem's own wheel
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/tandem-*.whl
  "$PY" -m pip wheel -q --no-deps --wheel-dir "$WHEELS" "$ROOT"
  [[ -f $WHEELS/tandem-$VERSION-py3-none-any.whl ]] || die "tandem's wheel is not version $VERSION"
  [[ $1 == cpu ]] || return 0
  # For the image's Python (Debian 12: CPython 3.11, glibc 2.36), whatever Python runs pip here.
  local target=(--only-binary=:all: --implementation cp --python-version 3.11
                --abi cp311 --abi abi3 --abi none --platform "linux_$ARCH")
  local n; for n in $(seq 36 -1 17); do target+=(--platform "manylinux_2_${n}_$ARCH"); done
  target+=(--platform "manylinux2014_$ARCH")
  "$PY" -m pip download -q "${target[@]}" --dest "$WHEELS" --find-links "$WHEELS" \
    pip "tandem[perf]==$VERSION" "torch==$TORCH"
  "$PY" -m pip download -q "${target[@]}" --no-deps --dest "$WHEELS" \
    "nixl==$NIXL" "nixl-cu13==$NIXL"
  compgen -G "$WHEELS/torch-$TORCH+cpu-*.whl" >/dev/null || die "pip took a torch $TORCH that is" \
    "not the CPU build (several GB of CUDA): put the CPU build on pip's indexes and rerun"
  echo "$PROG: wheelhouse $WHEELS ($(du -sh "$WHEELS" | cut -f1))"
}

tools() {
  if [[ -z $TOOL ]]; then
    if command -v podman >/dev/null; then TOOL=podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then TOOL=docker
    elif command -v apt-get >/dev/null && (( EUID == 0 )); then
      echo "$PROG: installing podman, runc and debootstrap (Debian's packages)"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
      TOOL=podman
    else die "needs podman or a running docker"; fi
  fi
  command -v "$TOOL" >/dev/null || die "$TOOL not found"
}

local_base() {  # a minimal Debian 12 with python3, from Debian's packages, imported as an image
  if "$TOOL" image inspect "$LOCAL_BASE" >/dev/null 2>&1; then return; fi
  command -v debootstrap >/dev/null || die "--base IMAGE, or debootstrap to make one"
  (( EUID == 0 )) || die "debootstrap needs root (or give --base IMAGE)"
  local rootfs=$ROOT/build/image/rootfs
  rm -rf "$rootfs"
  echo "$PROG: debootstrap bookworm (minbase + python3) -> $LOCAL_BASE"
  debootstrap --variant=minbase --include=python3 bookworm "$rootfs" \
    > "$ROOT/build/image/debootstrap.log" 2>&1 || die "debootstrap failed: build/image/debootstrap.log"
  # What debian:bookworm-slim leaves out too: package caches and lists, docs, manuals, locales.
  rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/{doc,man,info,locale}/*
  tar -C "$rootfs" -c . | "$TOOL" import --change 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$rootfs"
}

build() {  # $1: target, $2: tag, then extra build args
  local target=$1 tag=$2; shift 2
  local extra=()
  # Containers here may not raise rlimits past the hard limits (the default asks for more).
  [[ $TOOL == podman ]] && extra+=(--isolation chroot)
  echo "$PROG: $TOOL build --target $target -t $tag"
  "$TOOL" build -f "$CF" --target "$target" -t "$tag" --label "tandem.source-sha256=$SOURCE" \
    "${extra[@]}" "$@" "$ROOT"
  echo "$PROG: built $tag ($("$TOOL" image inspect --format '{{.Size}}' "$tag" |
    awk '{printf "%.0f MB", $1 / 1e6}'))"
  if [[ -n $PUSH ]]; then
    local dest=$PUSH:${tag##*:}
    "$TOOL" tag "$tag" "$dest"
    "$TOOL" push "$dest"
  fi
}

case $TARGET in
  wheels) wheels cpu ;;
  cpu)
    tools; wheels cpu
    [[ -n $BASE ]] || { local_base; BASE=$LOCAL_BASE; }
    build cpu "${TAG:-tandem:$VERSION-cpu}" --build-arg "CPU_BASE=$BASE" ;;
  gpu)
    tools; wheels gpu
    build gpu "${TAG:-tandem:$VERSION}" ${BASE:+--build-arg "SGLANG_IMAGE=$BASE"} ;;
esac
