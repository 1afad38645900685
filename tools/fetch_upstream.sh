#!/usr/bin/env bash
# Rebuild .upstream/: DeepEP's own test programs, which launch/gpu_suite.sh runs unmodified through
# `python -m deepep_cupy.as_deep_ep`. Only DeepEP's tests/ folders are copied, byte for byte (no csrc, no binaries,
# a few hundred KB); .upstream/ is in .gitignore and is never committed.
#
#   .upstream/head/tests/  DeepEP HEAD, commit dd758caf451848bd150e1046af3d0a73e5fff38d (__version__ 2.1.0):
#                          `git archive` of tests/ (elastic/*.py, legacy/*.py, utils/test_gate.py). These programs
#                          import deep_ep.utils.* (served by deepep_cupy) and, in legacy/, their sibling
#                          test_low_latency.py.
#   .upstream/v1/tests/    tag v1.2.1 = commit 9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee: `git archive` of tests/
#                          (test_intranode.py, test_internode.py, test_low_latency.py and the utils.py they import).
#   .upstream/v25/tests/   DeepEP V2.5 (tests/{ep,bucket,buffer,engram,pp,comm}/*). V2.5 is not in the public mirror
#                          (its newest commit is dd758ca); the files below were read one by one from the stored
#                          versions of deepseek-ai/DeepEP in the search tool's code index (read_file, repo
#                          deepseek-ai/DeepEP, at the commit listed per file; the index holds one version of each),
#                          written out unchanged and checked against the index's character counts (SIZE below)
#                          and the line numbers quoted in perf/results/*.log tracebacks. Nothing of them is stored in
#                          this repository. This script takes each one from the mirror when the mirror holds its
#                          commit; otherwise from $V25_SRC (a folder with a tests/ tree) if given; otherwise it keeps
#                          the copy already in .upstream/v25/. BLOB is the git blob id of the copy built from the
#                          index, to compare with once a mirror holds those commits.
#                          Left out: tests/ep/test_recv_view.py (four versions in the index at commits not named as
#                          V2.5, a borrow_recv/DispatchRecvView API that V2.5 as documented does not have).
#
# Usage: tools/fetch_upstream.sh [DEEPEP_GIT]     (or DEEPEP_GIT=...)
#   DEEPEP_GIT: a git directory (bare mirror or clone) of github.com/deepseek-ai/DeepEP holding dd758ca and 9af0e0d.
#   V25_SRC:    optional folder holding a V2.5 tests/ tree to copy the V2.5 files from.
# Exits 1 if a file the GPU suite runs is missing afterwards.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$ROOT/.upstream
GIT_DIR_ARG=${1:-${DEEPEP_GIT:-}}
V25_SRC=${V25_SRC:-}
HEAD_COMMIT=dd758caf451848bd150e1046af3d0a73e5fff38d
V1_COMMIT=9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee

[ -n "$GIT_DIR_ARG" ] || { echo "usage: $0 DEEPEP_GIT (or set DEEPEP_GIT): a git mirror of deepseek-ai/DeepEP" >&2; exit 2; }
G() { git --git-dir="$GIT_DIR_ARG" "$@"; }
if [ -d "$GIT_DIR_ARG/.git" ]; then GIT_DIR_ARG=$GIT_DIR_ARG/.git; fi
for c in $HEAD_COMMIT $V1_COMMIT; do
    G cat-file -e "$c^{commit}" 2>/dev/null || { echo "$GIT_DIR_ARG: commit $c not found" >&2; exit 1; }
done
if t=$(G rev-parse -q --verify 'v1.2.1^{commit}'); then
    [ "$t" = $V1_COMMIT ] || echo "warning: tag v1.2.1 is $t here, not $V1_COMMIT; using $V1_COMMIT" >&2
fi

NEW=$(mktemp -d "$ROOT/.upstream.new.XXXXXX")
trap 'rm -rf "$NEW"' EXIT
mkdir -p "$NEW/head" "$NEW/v1" "$NEW/v25"
G archive $HEAD_COMMIT tests | tar -x -C "$NEW/head"
G archive $V1_COMMIT tests | tar -x -C "$NEW/v1"

# V2.5: PATH COMMIT SIZE(bytes) BLOB (see the header)
V25_FILES='
tests/ep/test_ep.py                 1a1ffbac1f9ba94e1f731f7647b5d6353fb38ade 39012 c37d03de5c62c45e1633d683520438ffb865dd28
tests/ep/test_prefetch_weights.py   1a1ffbac1f9ba94e1f731f7647b5d6353fb38ade 14803 fd15f100892fbfebd032cb78ad998428cc7fc901
tests/ep/test_reduce_grads.py       def865146e95aa9ea223e277c0a8a4c6b81e5ac7 15407 22547d9e11ec8c9aa96c04e39b9753a715762590
tests/bucket/test_all_gather.py     db8166d6892d1fe1a4072d2a4ff798d2b5bfc38c 4986 fc31ac9a47331498586d8e1deb6123c4cba16271
tests/bucket/test_all_reduce.py     1a1ffbac1f9ba94e1f731f7647b5d6353fb38ade 3857 45e2d2ad7446915874cb57026c494d3b66b48f3e
tests/bucket/test_mixed.py          def865146e95aa9ea223e277c0a8a4c6b81e5ac7 19020 6787366d4d4443eaca818ab22fb836f571398256
tests/bucket/test_perf.py           db8166d6892d1fe1a4072d2a4ff798d2b5bfc38c 13918 2a3a95659856496a7f33671da7e26dd0034bc41d
tests/bucket/test_reduce_scatter.py def865146e95aa9ea223e277c0a8a4c6b81e5ac7 5952 7f18e9b3d769d0029bdaeb8fd17bc5cc18c31145
tests/bucket/test_session.py        def865146e95aa9ea223e277c0a8a4c6b81e5ac7 4821 9a62411c0e3fc15531ba9810a24c3cbf7a66ec0b
tests/buffer/test_allocation.py     db8166d6892d1fe1a4072d2a4ff798d2b5bfc38c 1962 09d236e144bcc25ca0e062703eaf28096af15cde
tests/comm/test_barrier.py          db8166d6892d1fe1a4072d2a4ff798d2b5bfc38c 2723 2a9cc7b1b775f077afa6b1e93378693357e3e615
tests/comm/test_comm_reuse.py       f5815151bab3118a892cf85868539ed6e8833cff 5133 7b986cbd86a981fc554fdeb0fe19707ca959112e
tests/engram/test_engram.py         def865146e95aa9ea223e277c0a8a4c6b81e5ac7 8080 2eb5223593558e6f56bd13b06bd5188bc530e682
tests/pp/test_pp.py                 855fa9dea1219b3f0ec761b5c70523e4ee14cfb0 6791 b7cec878c5a120460de988c1141bbf2b6115f410
'
missing=0
while read -r path commit size blob; do
    [ -n "$path" ] || continue
    out=$NEW/v25/$path
    mkdir -p "$(dirname "$out")"
    if G cat-file -e "$commit:$path" 2>/dev/null; then
        G show "$commit:$path" > "$out"; from="mirror $commit"
    elif [ -n "$V25_SRC" ] && [ -f "$V25_SRC/$path" ]; then
        cp "$V25_SRC/$path" "$out"; from="$V25_SRC"
    elif [ -f "$DEST/v25/$path" ]; then
        cp "$DEST/v25/$path" "$out"; from="kept .upstream/v25"
    else
        echo "v25: MISSING $path (commit $commit is not in the mirror; see this script's header)" >&2
        rm -f "$out"; missing=1; continue
    fi
    got_size=$(wc -c < "$out"); got_blob=$(git hash-object "$out")
    note=""
    [ "$got_size" = "$size" ] || note=" (size $got_size, expected $size)"
    [ "$got_blob" = "$blob" ] || note="$note (blob $got_blob differs from the index-built copy)"
    echo "v25: $path <- $from$note"
done <<< "$V25_FILES"

rm -rf "$DEST"
mv "$NEW" "$DEST"
trap - EXIT

# Every program launch/gpu_suite.sh runs, and the local modules they import.
need='
head/tests/elastic/test_ep.py head/tests/elastic/test_agrs.py head/tests/elastic/test_barrier.py
head/tests/elastic/test_pp.py head/tests/elastic/test_engram.py head/tests/utils/test_gate.py
head/tests/legacy/test_intranode.py head/tests/legacy/test_low_latency.py
v1/tests/test_intranode.py v1/tests/test_low_latency.py v1/tests/utils.py
v25/tests/ep/test_ep.py v25/tests/ep/test_prefetch_weights.py v25/tests/ep/test_reduce_grads.py
v25/tests/comm/test_barrier.py v25/tests/engram/test_engram.py v25/tests/buffer/test_allocation.py
v25/tests/pp/test_pp.py v25/tests/bucket/test_all_gather.py v25/tests/bucket/test_reduce_scatter.py
v25/tests/bucket/test_all_reduce.py v25/tests/bucket/test_session.py v25/tests/bucket/test_mixed.py
v25/tests/bucket/test_perf.py
'
for f in $need; do
    [ -f "$DEST/$f" ] || { echo "missing: .upstream/$f" >&2; missing=1; }
done
echo "built $DEST: $(find "$DEST" -type f | wc -l) files, $(du -sh "$DEST" | cut -f1)"
exit $missing
