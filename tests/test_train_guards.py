"""The trainer's watchers and displays in isolation: compilations after warm-up, memory growth,
the progress display with and without a terminal, the learning-rate schedule."""

from __future__ import annotations

import io
import logging
import math

import pytest

from train import guards, metrics, runtime
from train.trainer import lr_factor


def test_compilation_after_warm_up_is_a_warning_naming_the_shape(monkeypatch, caplog):
    counts = iter([0, 3, 4, 4, 4, 6])  # the counter torch_xla would report after each graph
    monkeypatch.setattr(runtime, "compile_count", lambda: next(counts))
    watch = guards.CompileWatch()
    with caplog.at_level(logging.WARNING, logger="train"):
        assert watch.after("train", (16, 128), step=1) == 3  # first run: compiles
        assert watch.after("train", (16, 128), step=2) == 1  # second run (optimizer state): still warm-up
        assert watch.after("train", (16, 128), step=3) == 0
        assert watch.after("train", (16, 64), step=4) == 0
        assert not caplog.records
        assert watch.after("train", (16, 128), step=5) == 2  # third run of a known shape compiles: a warning
    assert (watch.warmup, watch.after_warmup) == (4, 2)
    [record] = caplog.records
    assert "step 5" in record.getMessage() and "(16, 128)" in record.getMessage()
    assert watch.shapes("train") == {(16, 128), (16, 64)}


def test_jax_traces_after_warm_up_are_counted_and_warned(monkeypatch, caplog):
    traces = iter([0, 5, 5, 5, 7])  # torchattn's JAX traces + lowerings after each graph
    monkeypatch.setattr(runtime, "compile_count", lambda: 0)
    monkeypatch.setattr(guards, "jax_trace_count", lambda: next(traces))
    watch = guards.CompileWatch()
    with caplog.at_level(logging.WARNING, logger="train"):
        for step in (1, 2, 3):  # warm-up traces the kernels; the third run traces nothing
            watch.after("train", (4, 512), step=step)
        assert watch.jax_traces_after_warmup == 0 and not caplog.records
        watch.after("train", (4, 512), step=4)
    assert watch.jax_traces_after_warmup == 2
    [record] = caplog.records
    assert "JAX trace" in record.getMessage() and "step 4" in record.getMessage()


def test_jax_trace_count_reads_torchattn_counters():
    import torchattn.counters

    before = guards.jax_trace_count()
    torchattn.counters.count("jax_traces")
    torchattn.counters.count("jax_lowerings")
    torchattn.counters.count("body_traces")  # not JAX
    assert guards.jax_trace_count() == before + 2


def test_tracing_timer_keeps_steady_steps_only(monkeypatch):
    # perf_counter, thread_time at each measure's start, then at its end
    clock = iter([10.0, 1.0, 10.5, 1.25, 20.0, 2.0, 22.0, 3.0, 30.0, 4.0, 30.25, 4.125])
    monkeypatch.setattr(guards.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(guards.time, "thread_time", lambda: next(clock))
    timer = guards.TracingTimer()
    assert timer.summary() == {"tracing_s_per_step": None, "tracing_cpu_s_per_step": None}
    with timer.measure():  # a step that compiled: dropped
        pass
    timer.step_done(steady=False)
    with timer.measure():  # a steady step of two graphs (micro-batch, optimizer): both count
        pass
    with timer.measure():
        pass
    timer.step_done(steady=True)
    assert timer.steps == [(2.25, 1.125)]
    assert timer.summary() == {"tracing_s_per_step": 2.25, "tracing_cpu_s_per_step": 1.125}


def test_summary_table_shows_jax_traces_and_tracing_time():
    summary = {"tokens_per_s": 100.0, "compiles_warmup": 4, "compiles_after_warmup": 0,
               "jax_traces_after_warmup": 0, "tracing_s_per_step": 0.25, "tracing_cpu_s_per_step": 0.125,
               "peak_host_bytes": 2**30, "peak_device_bytes": None, "model_dir": "m", "checkpoints": "c"}
    text = metrics.summary_table(summary)
    assert "jax traces after warm-up" in text and "0.250 s (0.125 s CPU)" in text


def test_memory_growth_after_the_first_reading_is_a_probable_leak(monkeypatch, caplog):
    watch = guards.MemoryWatch(device=None, threshold=0.2)
    readings = iter([{"host_rss": 1000}, {"host_rss": 1150}, {"host_rss": 1300}, {"host_rss": 1400}])
    monkeypatch.setattr(watch, "read", lambda: next(readings))
    with caplog.at_level(logging.WARNING, logger="train"):
        watch.check("step 10")
        watch.check("step 20")  # +15 %: within the threshold
        assert not caplog.records
        watch.check("step 30")  # +30 %
        watch.check("the end of epoch 0")  # still growing: already reported once
    [record] = caplog.records
    assert "probable memory leak" in record.getMessage() and "host_rss" in record.getMessage()
    assert "+30%" in record.getMessage() and "from step 10 to step 30" in record.getMessage()


class FakeStream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_is_plain_lines_without_a_terminal():
    stream = FakeStream(tty=False)
    progress = metrics.Progress(total_steps=3, stream=stream)
    progress.update(1, loss=None, tokens_per_s=10.0, step_time=0.5, compiles=2)  # not a logged step
    progress.update(2, loss=1.25, tokens_per_s=10.0, step_time=0.5, compiles=2)
    progress.line("eval step 2: accuracy 0.5")
    assert stream.getvalue() == ("step 2/3 loss 1.2500 10 tok/s 0.50 s/step compiles 2\n"
                                 "eval step 2: accuracy 0.5\n")


def test_progress_is_one_updating_line_on_a_terminal():
    stream = FakeStream(tty=True)
    progress = metrics.Progress(total_steps=3, stream=stream)
    progress.update(3, loss=None, tokens_per_s=10.0, step_time=0.5, compiles=2)
    progress.line("done")
    text = stream.getvalue()
    assert text.startswith("\r[" + "#" * metrics.Progress.WIDTH + "] step 3/3")
    assert text.endswith("\ndone\n"), "a message starts on a new line below the bar"


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_learning_rate_warms_up_then_decays_and_never_reaches_zero(schedule):
    factors = [lr_factor(step, warmup_steps=4, total_steps=20, schedule=schedule) for step in range(20)]
    assert factors[:4] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert all(a > b for a, b in zip(factors[4:], factors[5:])), "decays after warm-up"
    assert min(factors) > 0
    middle = lr_factor(12, warmup_steps=4, total_steps=20, schedule=schedule)  # progress 9/17 of the decay
    expected = 1 - 9 / 17 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * 9 / 17))
    assert middle == pytest.approx(expected)
