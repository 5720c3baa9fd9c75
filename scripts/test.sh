#!/usr/bin/env bash
# The whole test suite, in both environments (docs/versions.md); arguments are passed to pytest in each
# (e.g. -k kernel, tests/test_dropout.py).
#   .venv          torch_xla's stack: every test
#   .venv-current  TorchTPU's stack: every test that does not need torch_xla (tests/conftest.py skips the rest)
# TEST_STACKS=xla (or current) runs one of them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stacks=${TEST_STACKS:-xla current}
# The first stack's environment now; the others' are built (when missing or stale) while its suite runs, at the
# lowest CPU priority: a fresh install (about 70 s: downloads, unpacking, byte-compiling on every core) then takes
# the cores only where the suite leaves them idle (at normal priority it slowed the first suite by about 100 s), and
# CI does not wait for both before the first test.
first=${stacks%% *}
bash scripts/env.sh "$first" || exit 1
declare -A building
trap 'kill $(jobs -p) 2>/dev/null' EXIT  # a build still running when this ends (its stamp stays unwritten)
for stack in ${stacks#"$first"}; do
    log=$(mktemp)
    nice -n 19 bash scripts/env.sh "$stack" > "$log" 2>&1 &
    building[$stack]="$! $log"
done
# XLA on the CPU unless told otherwise (PJRT_DEVICE=TPU on a TPU VM runs the tpu-marked tests).
export PJRT_DEVICE=${PJRT_DEVICE:-CPU}
# Cap torch_xla's in-memory compilation cache: XLA:CPU keeps thousands of memory
# mappings per cached executable, and a suite that compiles many graphs otherwise
# exhausts vm.max_map_count ("LLVM compilation error: Cannot allocate memory").
export XLA_COMPILATION_CACHE_SIZE=${XLA_COMPILATION_CACHE_SIZE:-8}
# Lint first, with setup.cfg's [flake8] rules: any finding fails the test command (and CI).
.venv/bin/python -m flake8 || exit 1
# Two pytest-xdist workers, each running whole modules (their fixtures run once): on 2 cores the suite
# takes about half as long as in one process, since most of its time is single-threaded compiles and
# tracing. TEST_WORKERS=0 runs it in this process. The summary at the end lists the slowest tests.
# --max-worker-restart 0: a worker that crashes (a segfault) ends the run with the failure and the tests it did
# not reach, instead of a replacement worker that loadfile scheduling leaves waiting forever
# (pytest-dev/pytest-xdist#784: the last CI hung that way until its 90-minute limit).
status=0
for stack in $stacks; do
    if [[ -n ${building[$stack]:-} ]]; then
        read -r pid log <<< "${building[$stack]}"
        wait "$pid"; built=$?
        cat "$log"; rm -f "$log"
        (( built == 0 )) || exit 1
    fi
    venv=.venv
    [[ $stack == current ]] && venv=.venv-current
    echo "test.sh: the suite in $venv ($stack stack)"
    $venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --max-worker-restart 0 "$@" || status=$?
done
exit $status
