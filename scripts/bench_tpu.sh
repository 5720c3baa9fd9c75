#!/usr/bin/env bash
# The attention benchmark on a TPU VM (one host): torchattn's pallas kernels against torch_xla's flash
# attention and, where installed, JAX's splash attention; then TFLOP/s and utilisation per row.
#
#   bash scripts/bench_tpu.sh [--dry-run] [--generation NAME] [--out PATH] [--] [bench_attention.py flags...]
#   bash scripts/bench_tpu.sh --lengths 1024 8192 --dtypes bfloat16
#
# 1. TORCHATTN_EXTRAS=xla,dev bash scripts/env.sh: the xla extra (torch_xla, and libtpu: the TPU runtime of torch_xla
#    and jax).
# 2. The TPU generation from the device kind (torchattn.tpu.devices.tpu_generation), unless --generation or
#    --out.
# 3. PJRT_DEVICE=TPU .venv/bin/python scripts/bench_attention.py --implementations torchattn-pallas
#    torch_xla-flash jax-splash --out docs/bench/attention-tpu-GENERATION (or --out PATH) [flags]: flags
#    given here come last, so they override these (argparse keeps an option's last value); give --out
#    before them, as this script's option, so that step 4 reads the CSV written.
# 4. The CSV's TFLOP/s and utilisation (of the chip's peak) per row.
# Each command is printed before it runs; --dry-run only prints them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage="usage: bash scripts/bench_tpu.sh [--dry-run] [--generation NAME] [--out PATH] [--] [bench_attention.py flags...]"
python=.venv/bin/python
implementations=(torchattn-pallas torch_xla-flash jax-splash)

fail() {
    echo "bench_tpu: $1" >&2
    echo "$usage" >&2
    exit 2
}

dry_run=0
generation=
out=
while [[ $# -gt 0 ]]; do
    case $1 in
        --dry-run) dry_run=1; shift ;;
        --generation)
            [[ $# -ge 2 && -n $2 && $2 != -* ]] || fail "--generation: expected a name such as v5e, got ${2:-nothing}"
            generation=$2; shift 2 ;;
        --out)
            [[ $# -ge 2 && -n $2 && $2 != -* ]] || fail "--out: expected a path without .csv, got ${2:-nothing}"
            out=$2; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        --) shift; break ;;
        *) break ;;  # the first flag that is not ours: it and the rest go to bench_attention.py
    esac
done
bench_flags=("$@")

# Prints a command as one shell line (words quoted where they need it).
show() {
    local line
    printf -v line ' %q' "$@"
    echo "+$line"
}

# Prints a command, then runs it unless --dry-run.
run() {
    show "$@"
    [[ $dry_run == 1 ]] || "$@"
}

run env TORCHATTN_EXTRAS=xla,dev bash scripts/env.sh

if [[ -z $out ]]; then
    if [[ -z $generation ]]; then
        detect='import torch_xla; from torchattn import devices; print(devices.tpu_generation(torch_xla.device()) or "")'
        show env PJRT_DEVICE=TPU "$python" -c "$detect"
        if [[ $dry_run == 1 ]]; then
            generation=GENERATION  # not detected without running
        else
            generation=$(env PJRT_DEVICE=TPU "$python" -c "$detect")
            [[ -n $generation ]] || fail "no TPU of a generation torchattn knows (v4, v5e, v5p, v6e); give --generation"
        fi
    fi
    out=docs/bench/attention-tpu-$generation
fi

run env PJRT_DEVICE=TPU "$python" scripts/bench_attention.py --implementations "${implementations[@]}" \
    --out "$out" "${bench_flags[@]}"

if [[ $dry_run == 0 ]]; then
    echo "TFLOP/s and utilisation of the chip's peak per row ($out.csv):"
    "$python" -c '
import csv, sys

def number(row, name, spec, scale=1.0):
    value = row.get(name) or ""
    return format(float(value) * scale, spec) if value else "-"

line = "{:<20} {:<9} {:>7} {:>10} {:>8} {:>11}  {}"
print(line.format("implementation", "dtype", "length", "median ms", "TFLOP/s", "utilisation", "status"))
for row in csv.DictReader(open(sys.argv[1])):
    print(line.format(row["implementation"], row["dtype"], row["length"], number(row, "median_s", ".2f", 1e3),
                      number(row, "tflops_per_s", ".1f"), number(row, "utilisation", ".1%"), row["status"]))
' "$out.csv"
fi
