#!/usr/bin/env bash
# Train on an existing TPU VM pod slice: copy this checkout to every worker, set up the
# environment there (scripts/env.sh with the xla extra), then run the same `python -m train`
# on every worker at once (SPMD: one process per host). Creates nothing and deletes nothing:
# the TPU VM must exist (gcloud compute tpus tpu-vm create ...), and stays when this ends.
#
#   bash scripts/tpu_pod.sh [--dry-run] [--project PROJECT] NAME ZONE [--] [python -m train flags...]
#   bash scripts/tpu_pod.sh my-v4-32 us-central2-b --mesh fsdp=16 --output-dir /mnt/shared/run1
#
# Each gcloud command is printed before it runs; --dry-run only prints them. The checkout
# goes as an archive of the files git knows (tracked, and untracked unless ignored: no .venv,
# no runs/) to ~/torchattn on every worker. With several hosts, --output-dir must be a folder
# every worker sees (sharded checkpoints are written by every host, see docs/spmd.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage="usage: bash scripts/tpu_pod.sh [--dry-run] [--project PROJECT] NAME ZONE [--] [python -m train flags...]"
remote_dir=torchattn  # under each worker's home folder
archive_name=torchattn-checkout.tar.gz

fail() {
    echo "tpu_pod: $1" >&2
    echo "$usage" >&2
    exit 2
}

dry_run=0
project=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --dry-run) dry_run=1; shift ;;
        --project)
            [[ $# -ge 2 && -n $2 && $2 != -* ]] || fail "--project: expected a project id, got ${2:-nothing}"
            project=(--project "$2"); shift 2 ;;
        --project=*)
            [[ -n ${1#--project=} ]] || fail "--project: expected a project id, got nothing"
            project=(--project "${1#--project=}"); shift ;;
        -h|--help) echo "$usage"; exit 0 ;;
        -*) fail "unknown option $1 (python -m train flags go after NAME ZONE)" ;;
        *) break ;;
    esac
done
[[ $# -ge 2 ]] || fail "expected the TPU VM's NAME and ZONE, got ${#} argument(s)"
name=$1 zone=$2
shift 2
if [[ ${1:-} == -- ]]; then  # NAME ZONE -- flags: the separator is ours, not python -m train's
    shift
fi
[[ -n $name && $name != -* ]] || fail "NAME: expected a TPU VM name, got '$name'"
[[ -n $zone && $zone != -* ]] || fail "ZONE: expected a zone such as us-central2-b, got '$zone'"
train_flags=("$@")

# The words as one shell line: each quoted only when it needs to be.
quoted() {
    local word words=()
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
            words+=("$word")
        else
            words+=("'${word//\'/\'\\\'\'}'")
        fi
    done
    echo "${words[*]}"
}

# Prints a command, then runs it unless --dry-run.
run() {
    echo "+ $(quoted "$@")"
    if [[ $dry_run == 0 ]]; then
        "$@"
    fi
}

# Runs a shell command line on every worker of the slice, at the same time.
on_all_workers() {
    run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${project[@]}" --worker=all --command "$1"
}

folder=$(mktemp -d)
trap 'rm -rf "$folder"' EXIT
archive=$folder/$archive_name
echo "+ git ls-files --cached --others --exclude-standard -z | tar --null -T - -czf $archive"
if [[ $dry_run == 0 ]]; then
    git ls-files --cached --others --exclude-standard -z | tar --null -T - -czf "$archive"
fi
run gcloud compute tpus tpu-vm scp "$archive" "$name:$archive_name" --zone "$zone" "${project[@]}" --worker=all
on_all_workers "mkdir -p ~/$remote_dir && tar -xzf ~/$archive_name -C ~/$remote_dir && rm ~/$archive_name \
&& cd ~/$remote_dir && TORCHATTN_EXTRAS=xla bash scripts/env.sh"
train="cd ~/$remote_dir && PJRT_DEVICE=TPU .venv/bin/python -m train"
if [[ ${#train_flags[@]} -gt 0 ]]; then
    train+=" $(quoted "${train_flags[@]}")"
fi
on_all_workers "$train"
