#!/usr/bin/env bash
# Runs this machine's task of an od-dist cluster: the same script on every Linux machine.
#
#   scripts/od-dist-node.sh [ROLE [INDEX]] [more `od-dist train` flags...]
#
#   OD_DIST_PIPELINE=pipelines/shapes_retinanet.yaml OD_DIST_MODEL_DIR=runs/lan \
#       scripts/od-dist-node.sh worker 1
#   scripts/od-dist-node.sh ps 0 --pipeline=pipelines/shapes_retinanet.yaml --model_dir=runs/lan
#   scripts/od-dist-node.sh          # role and index found from this machine's own address
#
# ROLE is ps, master (or chief), worker or evaluator; INDEX defaults to 0. Environment:
#   OD_DIST_CLUSTER    the cluster file (default clusters/lan.yaml, as in the README), same on
#                      every machine
#   OD_DIST_PIPELINE   passed as --pipeline     (or give --pipeline=... after ROLE INDEX)
#   OD_DIST_MODEL_DIR  passed as --model_dir    (or give --model_dir=...)
#   OD_DIST_WORKDIR    where to run (default: the checkout this script is in); relative paths
#                      above are resolved there
#   OD_DIST_VENV       a virtual environment to run od-dist from (default: <workdir>/.venv if it
#                      has od-dist, else `od-dist` on PATH)
#   OD_DIST_PYTHON     run `<python> -m od_dist` instead
# The task runs under od-dist's supervisor with --max_restarts=3 (the generated scripts' default,
# LAUNCH_MAX_RESTARTS in od_dist/cli/flags.py): a lost task is restarted, as there; a
# --max_restarts among the flags wins. The order in which machines start does not matter: every
# task waits for its peers (--wait_timeout). See scripts/README.md.
set -euo pipefail

here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
cd -- "${OD_DIST_WORKDIR:-$here/..}"

args=(train "--cluster=${OD_DIST_CLUSTER:-clusters/lan.yaml}")
if [[ $# -gt 0 && $1 != -* ]]; then
  args+=("--role=$1")
  shift
  if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    args+=("--index=$1")
    shift
  fi
fi
if [[ -n ${OD_DIST_PIPELINE:-} ]]; then args+=("--pipeline=$OD_DIST_PIPELINE"); fi
if [[ -n ${OD_DIST_MODEL_DIR:-} ]]; then args+=("--model_dir=$OD_DIST_MODEL_DIR"); fi
# Before the caller's flags: absl takes the last of a flag given twice.
args+=(--max_restarts=3 "$@")

if [[ -n ${OD_DIST_PYTHON:-} ]]; then
  exec "$OD_DIST_PYTHON" -m od_dist "${args[@]}"
fi
venv=${OD_DIST_VENV:-}
if [[ -z $venv && -x .venv/bin/od-dist ]]; then
  venv=$PWD/.venv
fi
if [[ -n $venv ]]; then
  export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH
  unset PYTHONHOME
  exec "$venv/bin/od-dist" "${args[@]}"
fi
exec od-dist "${args[@]}"
