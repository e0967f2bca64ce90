#!/usr/bin/env bash
# Runs a module of this repo (a benchmark) against an older `structgen` package, for an A/B on
# one warm machine:
#     git archive <commit> structgen | tar -x -C .carry/old      # here; carry ".carry/old"
#     scripts/device/old_tree.sh .carry/old benchmarks.bench_decode --models ... --no-write
# `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH, so
# `PYTHONPATH=.carry/old:$PYTHONPATH python -m benchmarks.X` imports this tree's structgen,
# not the old one: the A/B compares the tree with itself. Here the old tree goes first.
# The benchmark scripts stay this tree's (they must still run against the old package).
set -euo pipefail
tree=$(cd "$1" && pwd)
module=$2
shift 2
exec python3 -u -c '
import runpy, sys
tree, module = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import structgen
if not structgen.__file__.startswith(tree):
    sys.exit(f"old_tree.sh: structgen resolved to {structgen.__file__}, not under {tree}")
print(f"old_tree.sh: structgen from {structgen.__file__}", flush=True)
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
' "$tree" "$module" "$@"
