#!/usr/bin/env bash
# DeepEP v1.2.1 from source, for perf/ll_side_by_side.py (DeepEP's low-latency kernels beside ours on one GPU).
#
#   tools/fetch_deepep_src.sh [export] [DEEPEP_GIT]   here (network or a mirror): `git archive` of tag v1.2.1 =
#                                                     commit 9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee (setup.py,
#                                                     csrc/, deep_ep/, third-party/, LICENSE, README.md; no tests,
#                                                     no figures) into .deepep_src/v1.2.1/ (under 1 MB; never
#                                                     committed: .deepep_src/ belongs in .gitignore, and travels to
#                                                     the GPU machine as `carry: [".deepep_src"]`)
#   tools/fetch_deepep_src.sh build [PREFIX]          on the GPU machine (no network): build that tree against the
#                                                     preinstalled NVSHMEM wheel into PREFIX (default
#                                                     $DEEPEP_V121_PREFIX or /tmp/deepep_v121): PREFIX/deep_ep/ (its
#                                                     Python package) and PREFIX/deep_ep_cpp*.so. Use it with
#                                                     PYTHONPATH=PREFIX only, so it never shadows our `deep_ep`.
#                                                     Skips the build when PREFIX already holds this source's build.
#
# DEEPEP_GIT: a git directory (bare mirror or clone) of github.com/deepseek-ai/DeepEP holding 9af0e0d (default: the
# mirror the session's fetch tool makes, /work/.mirror/deepseek-ai+DeepEP/repo, else a shallow clone from GitHub).
#
# What the build sets, from DeepEP v1.2.1's setup.py:
#   NVSHMEM_DIR      a folder PREFIX/nvshmem with include/ -> the wheel's include/ and lib/ holding a link to every
#                    file of the wheel's lib/ plus libnvshmem_host.so -> libnvshmem_host.so.3 (the wheel ships only
#                    the soname). setup.py links `-l:libnvshmem_host.so -l:libnvshmem_device.a` and sets the rpath to
#                    NVSHMEM_DIR/lib, so the built module loads the wheel's libraries (and NVSHMEM's bootstrap /
#                    transport plugins, found beside libnvshmem_host) through those links.
#   CPATH            $CUDA_HOME/include/cccl first (CUDA 13 keeps cuda/std there; DeepEP includes <cuda/std/...>).
#   TORCH_CUDA_ARCH_LIST=9.0  (setup.py's default; only 9.0 permits DISABLE_AGGRESSIVE_PTX_INSTRS=0).
#   DISABLE_SM90_FEATURES=0   (FP8, TMA and the NVSHMEM kernels need SM90).
#   DISABLE_AGGRESSIVE_PTX_INSTRS  setup.py's default 1 (no `.L1::no_allocate` loads); pass
#                    DISABLE_AGGRESSIVE_PTX_INSTRS=0 in the environment to build DeepEP's faster variant.
#   MAX_JOBS         torch's parallel ninja jobs (default: the number of cores).
#   GIT_DIR=/dev/null while building, so setup.py's `git rev-parse` does not stamp our checkout's commit on
#                    DeepEP's version.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=v1.2.1
COMMIT=9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee
SRC=$ROOT/.deepep_src/$TAG
PATHS='setup.py csrc deep_ep third-party LICENSE README.md'

mode=export
if [ "${1:-}" = export ] || [ "${1:-}" = build ]; then mode=$1; shift; fi

do_export() {
    local git_dir=${1:-${DEEPEP_GIT:-/work/.mirror/deepseek-ai+DeepEP/repo}} tmp_clone=''
    if [ -d "$git_dir/.git" ]; then git_dir=$git_dir/.git; fi
    if ! git --git-dir="$git_dir" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
        echo "no mirror holding $COMMIT at $git_dir: cloning tag $TAG from GitHub" >&2
        tmp_clone=$(mktemp -d)
        git clone -q --bare --depth 1 --branch "$TAG" https://github.com/deepseek-ai/DeepEP.git "$tmp_clone/repo"
        git_dir=$tmp_clone/repo
    fi
    local G="git --git-dir=$git_dir"
    if t=$($G rev-parse -q --verify "$TAG^{commit}"); then
        [ "$t" = "$COMMIT" ] || echo "warning: tag $TAG is $t in $git_dir, not $COMMIT; exporting $COMMIT" >&2
    fi
    local new; new=$(mktemp -d "$ROOT/.deepep_src.new.XXXXXX")
    # shellcheck disable=SC2086
    $G archive "$COMMIT" $PATHS | tar -x -C "$new"
    echo "$COMMIT" > "$new/COMMIT"
    mkdir -p "$ROOT/.deepep_src"
    rm -rf "$SRC"
    mv "$new" "$SRC"
    [ -n "$tmp_clone" ] && rm -rf "$tmp_clone"
    for f in setup.py csrc/deep_ep.cpp csrc/kernels/internode_ll.cu deep_ep/buffer.py; do
        [ -f "$SRC/$f" ] || { echo "missing after export: $SRC/$f" >&2; exit 1; }
    done
    echo "exported DeepEP $TAG ($COMMIT) to $SRC: $(find "$SRC" -type f | wc -l) files, $(du -sh "$SRC" | cut -f1)"
}

do_build() {
    local prefix=${1:-${DEEPEP_V121_PREFIX:-/tmp/deepep_v121}}
    local py=${PYTHON:-python3}
    [ -f "$SRC/setup.py" ] || { echo "$SRC/setup.py missing: run tools/fetch_deepep_src.sh export first (and carry" \
                                     ".deepep_src to the GPU machine)" >&2; exit 1; }
    local stamp; stamp="$COMMIT $(cat "$SRC/COMMIT" 2>/dev/null) ptx=${DISABLE_AGGRESSIVE_PTX_INSTRS:-1}"
    if [ -f "$prefix/BUILT" ] && [ "$(cat "$prefix/BUILT")" = "$stamp" ] && ls "$prefix"/deep_ep_cpp*.so >/dev/null 2>&1
    then
        echo "DeepEP $TAG already built in $prefix"; return 0
    fi
    local wheel
    wheel=$($py -c 'import importlib.util as u; s = u.find_spec("nvidia.nvshmem"); print(s.submodule_search_locations[0])') \
        || { echo "the nvidia-nvshmem wheel (nvidia.nvshmem) is not importable by $py" >&2; exit 1; }
    [ -d "$wheel/lib" ] && [ -d "$wheel/include" ] || { echo "$wheel has no lib/ or include/" >&2; exit 1; }
    local host_so; host_so=$(cd "$wheel/lib" && ls libnvshmem_host.so.* 2>/dev/null | head -1)
    [ -n "$host_so" ] || { echo "no libnvshmem_host.so.* in $wheel/lib" >&2; exit 1; }
    [ -f "$wheel/lib/libnvshmem_device.a" ] || echo "warning: no libnvshmem_device.a in $wheel/lib" >&2

    rm -rf "$prefix"
    mkdir -p "$prefix/nvshmem/lib" "$prefix/build"
    ln -s "$wheel/include" "$prefix/nvshmem/include"
    local f
    for f in "$wheel"/lib/*; do ln -s "$f" "$prefix/nvshmem/lib/$(basename "$f")"; done
    [ -e "$prefix/nvshmem/lib/libnvshmem_host.so" ] || ln -s "$wheel/lib/$host_so" "$prefix/nvshmem/lib/libnvshmem_host.so"

    local cuda_home=${CUDA_HOME:-}
    if [ -z "$cuda_home" ]; then
        if command -v nvcc >/dev/null; then cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
        else cuda_home=/usr/local/cuda; fi
    fi
    [ -x "$cuda_home/bin/nvcc" ] || { echo "no nvcc under $cuda_home (set CUDA_HOME)" >&2; exit 1; }
    local cpath=$cuda_home/include
    [ -d "$cuda_home/include/cccl" ] && cpath=$cuda_home/include/cccl:$cpath
    echo "building DeepEP $TAG: NVSHMEM wheel $wheel ($host_so), CUDA $cuda_home, into $prefix"
    local t0=$SECONDS
    # A copy of the tree, so that build outputs never land in .deepep_src.
    cp -r "$SRC" "$prefix/src"
    (
        cd "$prefix/src"
        export NVSHMEM_DIR=$prefix/nvshmem CUDA_HOME=$cuda_home PATH=$cuda_home/bin:$PATH
        export CPATH=$cpath${CPATH:+:$CPATH}
        export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} DISABLE_SM90_FEATURES=0
        export DISABLE_AGGRESSIVE_PTX_INSTRS=${DISABLE_AGGRESSIVE_PTX_INSTRS:-1}
        export MAX_JOBS=${MAX_JOBS:-$(nproc)} GIT_DIR=/dev/null
        $py setup.py build_ext --build-lib "$prefix" --build-temp "$prefix/build"
    ) > "$prefix/build.log" 2>&1 || { tail -n 60 "$prefix/build.log" >&2; echo "DeepEP build failed (log:" \
                                       "$prefix/build.log)" >&2; exit 1; }
    cp -r "$SRC/deep_ep" "$prefix/deep_ep"
    rm -rf "$prefix/src" "$prefix/build"
    # The check: this prefix's deep_ep is DeepEP's, with its C++ module.
    PYTHONPATH=$prefix $py -c "
import os, sys, torch, deep_ep, deep_ep_cpp
assert os.path.dirname(os.path.abspath(deep_ep.__file__)) == os.path.join(os.path.abspath('$prefix'), 'deep_ep'), \
    deep_ep.__file__
print('deep_ep', deep_ep.__file__, '| deep_ep_cpp', deep_ep_cpp.__file__)
" || { echo "the built DeepEP does not import (log: $prefix/build.log)" >&2; exit 1; }
    echo "$stamp" > "$prefix/BUILT"
    echo "built DeepEP $TAG in $prefix in $((SECONDS - t0)) s (log $prefix/build.log)"
}

case $mode in
    export) do_export "$@" ;;
    build) do_build "$@" ;;
esac
