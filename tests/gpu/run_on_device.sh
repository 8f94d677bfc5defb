#!/usr/bin/env bash
# tandem on a GPU machine in one run: the CUDA tests, the KV handoff in VRAM, a streamed load on
# the reference engine on CUDA; a short table last, every log in the results folder it names.
#
# Here (a machine that reaches the package index): `make gpu-wheels` puts the six wheels tandem
# needs beyond what a CUDA torch machine has (pyzmq, msgspec, uvicorn, httptools, nixl,
# nixl-cu13; about 61 MB, cp312 manylinux x86_64) into .whl/, which git ignores.
# There (Python 3.12, a CUDA build of torch, no index), from the repository root, with .whl/
# carried beside the tree:
#
#     tests/gpu/run_on_device.sh [--results DIR] [--budget-s 480]
#
# On a GPU machine reached through a remote runner: run this command there with .whl/ carried
# beside the tree; the results go to $OUT when the runner sets it.
# Anywhere, no GPU: `tests/gpu/run_on_device.sh --dry-run` checks all that needs none.
# What each step does, its deadline and the wheel pins: tests/gpu/run_on_device.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python3}" tests/gpu/run_on_device.py "$@"
