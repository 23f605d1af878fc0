#!/usr/bin/env bash
# Install pinned SGLang releases into separate target folders, never into the project's
# environment: `pip install --target DIR --no-deps` (the project's torch, triton and numpy stay
# as they are; SGLang's own pins, torch==2.9.1 among them, are not applied).
#
#   adapters/install_engines.sh [VERSION ...]      (default: 0.5.9 0.5.10)
#   ENGINES_DIR=/tmp/engines PYTHON=.venv/bin/python adapters/install_engines.sh 0.5.9
#   adapters/install_engines.sh vllm-0.33.0         (vLLM: the engine's name before the version)
#
# Each version lands in $ENGINES_DIR/sglang-VERSION with the light dependencies of
# sglang_adapter/requirements-light.txt (0.5.13 and later: requirements-light-0.5.13.txt, the
# newer transformers / tokenizers / openai pins and tvm_ffi); put that folder on PYTHONPATH.
# A folder that already holds the version is kept (delete it to reinstall).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${ENGINES_DIR:-/tmp/engines}"
py="${PYTHON:-python}"
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(0.5.9 0.5.10)
# install ENGINE VERSION REQUIREMENTS: $ENGINES_DIR/ENGINE-VERSION, kept where it already holds the version
install() {
  local name="$1" v="$2" reqs="$3" target="$dir/$1-$2" start
  if [ -f "$target/$name-$v.dist-info/METADATA" ]; then
    echo "$name $v: already in $target"
    return
  fi
  start=$(date +%s)
  rm -rf "$target.partial"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$target.partial" \
    "$name==$v" -r "$reqs"
  rm -rf "$target" && mv "$target.partial" "$target"
  echo "$name $v: installed in $target in $(( $(date +%s) - start )) s"
}
for v in "${versions[@]}"; do
  # vLLM (an argument vllm-VERSION): vllm_adapter/requirements-light.txt, the light modules on the
  # import path of its Triton attention backend and V2 runner helpers.
  if [[ "$v" == vllm-* ]]; then
    case "${v#vllm-}" in
      *[!0-9.]*|"") echo "install_engines.sh: error: bad vLLM version '${v#vllm-}' (want digits and dots, e.g. vllm-0.33.0)" >&2; exit 2;;
    esac
    install vllm "${v#vllm-}" "$here/vllm_adapter/requirements-light.txt"
    continue
  fi
  case "$v" in
    *[!0-9.]*|"") echo "install_engines.sh: error: bad SGLang version '$v' (want digits and dots, e.g. 0.5.9)" >&2; exit 2;;
  esac
  reqs="$here/sglang_adapter/requirements-light.txt"
  if [ "$(printf '%s\n' 0.5.13 "$v" | sort -V | head -1)" = 0.5.13 ]; then
    reqs="$here/sglang_adapter/requirements-light-0.5.13.txt"
  fi
  install sglang "$v" "$reqs"
done
