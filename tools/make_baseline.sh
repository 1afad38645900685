#!/usr/bin/env bash
# .baseline/: this repository's tree at REV, for launch/gpu_suite.sh perf1, which runs the one-rank EP program and
# perf/ep_profile.py of that tree beside the current one in the same device call (before / after figures of a
# refactor). Carry it to the GPU machine (the device tool's `carry: [".baseline"]`).
#
#   bash tools/make_baseline.sh [REV]      REV default 7266e72: the tree before the house's second pass
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-7266e72}
rm -rf .baseline
mkdir -p .baseline
git archive "$rev" | tar -x -C .baseline
echo "built .baseline from $(git rev-parse --short "$rev"): $(du -sh .baseline | cut -f1)"
