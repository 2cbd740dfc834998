#!/usr/bin/env bash
# The README's two commands, as a new user runs them: a fresh clone of this checkout's HEAD with
# only the default extras (`make install`), then `make demo` (the main job, for real) and
# `make test` selecting every step's tests without running them (TEST_ARGS=--collect-only: the
# steps' logic, including the line that skips a step whose extra is missing; the suite itself
# runs once, with every extra, in .ci/run). Under two minutes on an idle 2-core machine.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
git clone -q "$src" "$dir/paramserver"
cd "$dir/paramserver"
make install
make demo
make test TEST_ARGS=--collect-only | tail -n 3
