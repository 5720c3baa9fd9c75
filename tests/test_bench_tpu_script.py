"""scripts/bench_tpu.sh in a copy of the checkout whose scripts/env.sh and .venv/bin/python are fakes: it sets
up the tpu extra, finds the generation from the device, runs the benchmark with the TPU implementations and the
user's flags into docs/bench/attention-tpu-<generation>, prints each command before running it, and prints
TFLOP/s and utilisation per row of the CSV."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEPARATOR = "\x1f"

FAKE_ENV_SH = r"""#!/usr/bin/env bash
echo "env.sh TORCHATTN_EXTRAS=$TORCHATTN_EXTRAS" >> "$FAKE_DIR/calls"
echo "[fake env.sh ran]"
"""

# Records each call (PJRT_DEVICE, then the arguments); answers the generation query with FAKE_GENERATION;
# for the benchmark writes a CSV at --out (the last one given, as argparse takes it); runs anything else
# (the summary) with the real Python.
FAKE_PYTHON = r"""#!/usr/bin/env bash
words=$(IFS=$'\x1f'; echo "python${IFS}PJRT_DEVICE=${PJRT_DEVICE:-}${IFS}$*")
echo "${words//$'\n'/ }" >> "$FAKE_DIR/calls"  # one line per call
if [[ $1 == -c && $2 == *tpu_generation* ]]; then
    echo "$FAKE_GENERATION"
elif [[ $1 == scripts/bench_attention.py ]]; then
    out=
    while [[ $# -gt 0 ]]; do [[ $1 == --out ]] && out=$2; shift; done
    echo "[fake benchmark ran]"
    printf '%s\n' "implementation,dtype,length,status,median_s,calls,tflops_per_s,utilisation" \
        "torchattn-pallas,bfloat16,8192,ok,0.0125,3,123.4,0.6264" \
        'jax-splash,bfloat16,8192,"failed: no module, named splash",,,,' > "$out.csv"
else
    exec "$REAL_PYTHON" "$@"
fi
"""


@pytest.fixture
def bench(tmp_path):
    """Runs the script in a fake checkout; returns (completed process, calls: lists of words)."""
    checkout = tmp_path / "checkout"
    for folder in ("scripts", ".venv/bin", "docs/bench"):
        (checkout / folder).mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "bench_tpu.sh"), checkout / "scripts")
    for path, text in ((checkout / "scripts" / "env.sh", FAKE_ENV_SH), (checkout / ".venv/bin/python", FAKE_PYTHON)):
        path.write_text(text)
        path.chmod(0o755)

    def run(*args: str, generation: str = "v5e"):
        env = dict(os.environ, FAKE_DIR=str(tmp_path), FAKE_GENERATION=generation, REAL_PYTHON=sys.executable)
        done = subprocess.run(["bash", str(checkout / "scripts" / "bench_tpu.sh"), *args], env=env,
                              capture_output=True, text=True, timeout=60)
        log = tmp_path / "calls"
        calls = [line.split(SEPARATOR) for line in log.read_text().splitlines()] if log.exists() else []
        return done, calls

    return run


BENCH = ["scripts/bench_attention.py", "--implementations", "torchattn-pallas", "torch_xla-flash", "jax-splash",
         "--out", "docs/bench/attention-tpu-v5e"]


def test_sets_up_the_tpu_extra_then_benchmarks_on_the_tpu_into_the_generations_csv(bench):
    done, calls = bench("--lengths", "1024", "8192", "--dtypes", "bfloat16")
    assert done.returncode == 0, done.stderr
    assert calls[0] == ["env.sh TORCHATTN_EXTRAS=xla,dev"]
    assert calls[1][:3] == ["python", "PJRT_DEVICE=TPU", "-c"]  # the generation, from the device
    assert calls[2] == ["python", "PJRT_DEVICE=TPU", *BENCH, "--lengths", "1024", "8192", "--dtypes", "bfloat16"]


def test_prints_tflops_and_utilisation_per_row(bench):
    done, _ = bench()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["implementation", "dtype"])
    assert lines[header + 1].split() == ["torchattn-pallas", "bfloat16", "8192", "12.50", "123.4", "62.6%", "ok"]
    assert lines[header + 2].split()[:6] == ["jax-splash", "bfloat16", "8192", "-", "-", "-"]
    assert lines[header + 2].endswith("failed: no module, named splash")


def test_each_command_is_printed_before_it_runs(bench):
    done, calls = bench("--calls", "5", generation="v6e")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for marker, command in (("[fake env.sh ran]", ["env", "TORCHATTN_EXTRAS=xla,dev", "bash", "scripts/env.sh"]),
                            ("[fake benchmark ran]", ["env", "PJRT_DEVICE=TPU", ".venv/bin/python",
                                                      *BENCH[:-1], "docs/bench/attention-tpu-v6e", "--calls", "5"])):
        printed = lines[lines.index(marker) - 1]
        assert printed.startswith("+ ") and shlex.split(printed[2:]) == command


def test_dry_run_prints_the_commands_and_runs_none(bench):
    done, calls = bench("--dry-run", "--generation", "v4", "--", "--lengths", "512")
    assert done.returncode == 0, done.stderr
    assert calls == []
    printed = [shlex.split(line[2:]) for line in done.stdout.splitlines() if line.startswith("+ ")]
    assert printed == [["env", "TORCHATTN_EXTRAS=xla,dev", "bash", "scripts/env.sh"],
                       ["env", "PJRT_DEVICE=TPU", ".venv/bin/python", *BENCH[:-1], "docs/bench/attention-tpu-v4",
                        "--lengths", "512"]]


def test_a_given_generation_is_not_detected(bench):
    done, calls = bench("--generation", "v5p")
    assert done.returncode == 0, done.stderr
    assert [call[2] for call in calls[1:]] == ["scripts/bench_attention.py", "-c"]  # the benchmark, the summary
    assert "docs/bench/attention-tpu-v5p" in calls[1]


def test_no_known_tpu_stops_before_the_benchmark(bench):
    done, calls = bench(generation="")
    assert done.returncode == 2
    assert "give --generation" in done.stderr and "usage: bash scripts/bench_tpu.sh" in done.stderr
    assert not any("scripts/bench_attention.py" in call for call in calls)


@pytest.mark.parametrize("args", [["--generation"], ["--generation", "--dry-run"], ["--out"], ["--out", "--calls"]])
def test_bad_arguments_exit_2_with_the_usage(bench, args):
    done, calls = bench(*args)
    assert done.returncode == 2
    assert "usage: bash scripts/bench_tpu.sh" in done.stderr
    assert calls == []


def test_out_names_the_csv_written_and_summarised_without_detecting_the_generation(bench, tmp_path):
    done, calls = bench("--out", "docs/bench/mine", "--lengths", "512")
    assert done.returncode == 0, done.stderr
    assert [call[2] for call in calls[1:]] == ["scripts/bench_attention.py", "-c"]  # no generation query
    assert calls[1][calls[1].index("--out") + 1] == "docs/bench/mine"
    assert (tmp_path / "checkout" / "docs" / "bench" / "mine.csv").exists()
    assert "torchattn-pallas" in done.stdout.splitlines()[-2]
