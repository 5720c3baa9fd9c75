"""The training loop: build a run from a RunConfig, train, evaluate, checkpoint, stop cleanly.

Lifecycle (train/__main__.py): ``Trainer(config)`` checks every input and loads data and
model before anything is written (a bad input leaves no output folder behind);
``train()`` runs; ``close()`` always runs. The trainer is Stateful: ``state_dict()``
holds everything a resumed run needs to continue exactly (model, optimizer, scheduler,
RNG states, data position), ``load_state_dict()`` restores it.

XLA shapes the loop. Each micro-batch is one graph (forward, backward, gradient
accumulation) and each optimizer step another, both synced with the runtime's ``sync()``;
batches have a fixed number of rows and a length from a small set of buckets, so the
graphs compile once per bucket and then run from the cache. Loss values reach the
host only on logged steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import random
import shlex
import signal
import threading
import time

import numpy as np
import torch

from . import build, checkpoint, metrics, runtime
from .checkpoint.lock import FILE as LOCK_FILE, LockedError, RunLock
from .config import (CONFIG_FILE, ConfigError, RunConfig, first_few, is_run_config, resume_changes, save_config,
                     saved_config)
from .errors import Interrupted, Stopped
from .guards import CompileWatch, MemoryWatch, TracingTimer, peak_host_rss
from .models import cpu_state, model_outputs, save_model

log = logging.getLogger("train")

PROFILE_STEPS = 3  # steps --profile captures, after warm-up
STATE_KEYS = ("model", "optimizer", "scheduler", "position", "rng")  # state_dict()'s: a checkpoint needs them all


@dataclasses.dataclass
class Position:
    """Where the run is: optimizer steps done, and the next micro-batch's epoch and index."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The learning-rate multiplier for optimizer step ``step`` (0-based): linear warm-up, then
    linear or cosine decay. Never 0: the first and last steps train, and torch_xla turns the
    scalar 0 into a graph constant (a new graph) where other values are data."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps + 1) / max(total_steps - warmup_steps + 1, 1)
    remaining = 1.0 - progress
    if schedule == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(remaining, 1e-3)


def seed_everything(seed: int, device) -> None:
    """Seeds every generator a run draws from; torch.manual_seed does not reach the device's."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    runtime.set_rng_state(seed, device)


def autocast(config: RunConfig):
    """--bf16: compute in bfloat16 under autocast; weights, gradients and optimizer state stay float32."""
    return torch.autocast(runtime.device_type(), dtype=torch.bfloat16, enabled=config.model.bf16)


def micro_batch_gradients(model: torch.nn.Module, inputs: dict[str, torch.Tensor], config: RunConfig
                          ) -> torch.Tensor:
    """Forward and backward of one micro-batch already on the device (``inputs``: the model's keyword arguments,
    the task's model_inputs): its gradients, divided by --grad-accum, are added to .grad. Returns the loss,
    detached (still on the device)."""
    with autocast(config):
        loss = model_outputs(model, inputs).loss
    (loss / config.optimizer.grad_accum).backward()
    return loss.detach()


def optimizer_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig,
                     spmd: runtime.Spmd | None = None) -> None:
    """The optimizer step after the micro-batches: clip, decay, AdamW, zero the gradients in place."""
    if config.optimizer.max_grad_norm > 0:
        runtime.clip_grad_norm_(model.parameters(), config.optimizer.max_grad_norm)
    if config.optimizer.weight_decay > 0:
        # AdamW's decoupled decay, w -= lr * wd * w, before its update as in torch's AdamW.
        # torch's AdamW multiplies by the Python float 1 - lr * wd instead: late in a
        # decaying schedule that is float32 1.0, which torch_xla puts into the graph as a
        # constant, so the step would compile again. A small alpha stays data.
        decay = -optimizer.param_groups[0]["lr"] * config.optimizer.weight_decay
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(parameter, alpha=decay)
    optimizer.step()
    # Zeroed in place, not set to None: the next micro-batch's graph stays the same.
    optimizer.zero_grad(set_to_none=False)
    if spmd is not None:  # the step's outputs keep the parameters' sharding
        spmd.shard_like_parameters(model, optimizer)


def _unchanged(value: torch.Tensor) -> torch.Tensor:
    return value


class Trainer:
    """One training run. See the module docstring for its lifecycle."""

    def __init__(self, config: RunConfig, *, stop_at_step: int | None = None):
        """Checks the inputs, loads data and model, then creates the output folder.

        ``stop_at_step`` (tests) makes train() behave as if SIGTERM arrived during that step.
        Raises ConfigError, errors.DataError or errors.ModelError (one line each) for bad input.
        """
        self._lock: RunLock | None = None
        try:
            self._build(config, stop_at_step)
        except BaseException:  # a refused input leaves the folder free for the next run
            self._release_lock()
            raise

    def _build(self, config: RunConfig, stop_at_step: int | None) -> None:
        import datasets
        import transformers

        # Progress bars of dataset maps and weight loading would clutter logs; ours shows progress.
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        if config.run.resume and config.run.output_dir is None:
            raise ConfigError("--resume: needs --output-dir, the folder of the run to continue")
        config, placement = runtime.place(config)  # before anything touches the device
        self.config = config
        self.placement = placement  # where its tensors live, which process writes (runtime.Placement)
        self.checkpointer = checkpoint.Checkpointer(config.run.output_dir, every=config.checkpoint.save_steps,
                                                    keep=config.checkpoint.keep_checkpoints, writer=placement.is_main,
                                                    sharded=placement.spmd is not None)
        self._refuse_other_files()  # before the lock, whose file would be the first written there
        if placement.is_main and os.path.isdir(config.run.output_dir):
            self._take_lock()  # before its files are read: no other run writes them meanwhile
        self._resume_changes = resume_changes(saved_config(config.run.output_dir), config) if config.run.resume else {}
        self._resume_path = self._check_output_dir()
        self._stop_at_step = stop_at_step
        self._signal: int | None = None
        seed_everything(config.run.seed, placement.device)

        # Data and model: every user input is checked here, before anything is written.
        built = build.model_and_data(config, placement)
        self.task = built.task
        self.tokenizer = built.tokenizer
        self.train_loader, self.eval_loader = built.train_loader, built.eval_loader
        self.total_steps = build.total_steps(config, len(self.train_loader), placement.world)
        self.model, self.optimizer = build.placed_model(built.model, config, placement)
        warmup_steps = int(config.optimizer.warmup * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(
            step, warmup_steps=warmup_steps, total_steps=self.total_steps, schedule=config.optimizer.lr_schedule))
        self.position = Position()
        self._prepare_run()

    def _prepare_run(self) -> None:
        """The watches, the first zeroed gradients, then the output folder: a resume's state loaded, the
        configuration saved. Only after every check of _build passed."""
        config = self.config
        self.compiles = CompileWatch()
        self.tracing = TracingTimer()
        # Gradients exist from the start, so every micro-batch is the same graph (no first-step
        # variant that creates them). Before a resume restores the RNGs: a sync advances the XLA
        # generator, so none may run between the restore and the next step.
        self._sync("zero_grad", self._zero_grads)

        # --- output folder: only now, after every check passed
        self.metrics = metrics.MetricsFile(config.run.output_dir, writer=self.placement.is_main)
        if self.placement.is_main and self._lock is None:
            os.makedirs(config.run.output_dir, exist_ok=True)
            self._take_lock()
        if self._resume_path is not None:
            self._resume_path, state = self._load_newest_intact()
            self.load_state_dict(state)
            self._apply_lr()
            if self.placement.is_main:
                self.metrics.truncate_after(self.position.step)
        if self.placement.is_main:  # a resume rewrites the run's configuration only once its checkpoint loaded
            save_config(config, os.path.join(config.run.output_dir, CONFIG_FILE))
        self.memory = MemoryWatch(self.placement.device)
        self.display = metrics.Progress(self.total_steps, quiet=not self.placement.is_main)
        self._step_times: list[tuple[float, int]] = []  # (seconds, tokens) of steps after warm-up
        # The evaluation at the step the run stands at, if one is logged: a resume of a finished run repeats none.
        self._final_eval: dict | None = None if self._resume_path is None else next(
            (record for record in reversed(self.metrics.read()) if record.get("eval")
             and record["step"] == self.position.step), None)
        self._profile_end: int | None = None  # last step of the --profile trace; -1 once written
        # Entered once for the whole run (torchattn's kernels per device under --mesh); close() leaves it.
        self._contexts = contextlib.ExitStack()
        if self.placement.spmd is not None:
            self._contexts.enter_context(self.placement.spmd.attention())

    def _take_lock(self) -> None:
        try:
            self._lock = RunLock(self.config.run.output_dir)
        except LockedError as error:
            raise ConfigError(str(error)) from None
        if self._lock.previous is not None:
            log.info(f"took over {self._lock.path} from pid {self._lock.previous}, a run that ended without "
                     "releasing it")

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _apply_lr(self) -> None:
        """A resume with another --lr: the restored schedule continues from this step with the new peak
        (the scheduler's state holds the old one)."""
        lr = self.config.optimizer.lr
        if self.scheduler.base_lrs != [lr] * len(self.scheduler.base_lrs):
            self.scheduler.base_lrs = [lr] * len(self.scheduler.base_lrs)
            factors = [factor(self.scheduler.last_epoch) for factor in self.scheduler.lr_lambdas]
            for group, factor in zip(self.optimizer.param_groups, factors):
                group["lr"] = lr * factor

    def _refuse_other_files(self) -> None:
        """Refuses an --output-dir that is a file, or a folder holding anything but a run of this trainer (its
        config.json or checkpoints) and a stale lock: the run would write its config.json, metrics.jsonl and
        model/ among the files there, e.g. over a saved model's config.json."""
        output_dir = self.config.run.output_dir
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ConfigError(f"--output-dir: {output_dir} is a file, not a folder; pick a new or empty folder")
        if not os.path.isdir(output_dir):
            return
        entries = sorted(name + "/" * os.path.isdir(os.path.join(output_dir, name))
                         for name in os.listdir(output_dir) if name != LOCK_FILE)
        if not entries or is_run_config(os.path.join(output_dir, CONFIG_FILE)) or self.checkpointer.latest():
            return
        raise ConfigError(f"--output-dir: {output_dir} holds {first_few(entries)} ({len(entries)} entries), not a run "
                          "of python -m train: a run would write its config.json, metrics.jsonl and model/ among them; "
                          "pick a new or empty folder")

    def _check_output_dir(self) -> str | None:
        """The checkpoint to resume from; refuses a folder holding another run's checkpoints."""
        latest = self.checkpointer.latest()
        if self.config.run.resume:
            if latest is None:
                raise ConfigError(f"--resume: nothing to resume in {self.config.run.output_dir} "
                                  f"(no {checkpoint.DIRECTORY}/step-*)")
            return latest
        if latest is not None:
            raise ConfigError(f"--output-dir: {self.config.run.output_dir} holds another run's checkpoints "
                              f"({os.path.basename(latest)}); add --resume to continue it or pick another folder")
        return None

    def _load_newest_intact(self) -> tuple[str, dict]:
        """(path, state) of the newest checkpoint that verifies; each damaged newer one is named in a
        warning. None intact: ConfigError (exit 2)."""
        try:
            path, state, damaged = self.checkpointer.load_newest(self._state_to_load_into, required=STATE_KEYS)
        except checkpoint.Damaged as error:
            raise ConfigError(f"--resume: {error}") from None
        for problem in damaged:
            log.warning(f"warning: checkpoint {problem}; resuming from the newest intact one, {path}")
        return path, state

    # ------------------------------------------------------------------
    # Stateful

    def state_dict(self) -> dict:
        return {**runtime.model_state(self.model, self.optimizer), "scheduler": self.scheduler.state_dict(),
                "position": dataclasses.asdict(self.position), "rng": checkpoint.rng_state(self.placement.device)}

    def load_state_dict(self, state: dict) -> None:
        runtime.load_model_state(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.position = Position(**state["position"])
        checkpoint.set_rng_state(state["rng"], self.placement.device)

    def _state_to_load_into(self) -> dict:
        """state_dict() ready to take a sharded checkpoint in place: the optimizer's state exists."""
        runtime.prime_optimizer(self.optimizer)
        return self.state_dict()

    # ------------------------------------------------------------------
    # Training

    def train(self) -> dict:
        """Trains to the end; returns the summary. Raises Interrupted after SIGTERM/SIGINT
        (the step in flight finished and was checkpointed)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        else:  # torch_xla's spawn (accelerate launch --tpu) runs each process's training in a thread
            log.warning("warning: training outside the main thread (accelerate launch --tpu): SIGTERM and Ctrl-C "
                        "stop the run without a checkpoint of the step in flight; --save-steps checkpoints remain")
        try:
            if self._resume_path is not None and self.position.step >= self.total_steps and self._final_eval:
                self.display.line(f"the run is already complete: step {self.position.step} of {self.total_steps}, "
                                  f"evaluated; nothing to train or log")
            elif self._resume_path is not None:
                self.display.line(f"resuming from {self._resume_path} at step {self.position.step}")
                for name, (before, after) in self._resume_changes.items():
                    before, after = ("none" if value is None else repr(value) for value in (before, after))
                    self.display.line(f"  --{name.replace('_', '-')}: {before} -> {after} from step "
                                      f"{self.position.step + 1} on")  # None as the flags spell it
            elif self.task.EVAL_BEFORE_TRAINING:
                self._evaluate()
            self.model.train()
            while self.position.step < self.total_steps:
                self._train_epoch()
            if not self._final_eval or self._final_eval["step"] != self.position.step:
                self._evaluate()
            return self._finish()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self._signal is not None:
            # A second signal stops at once. Not by raising: the handler may run inside a callback
            # (torch_xla's gc callback among them) that swallows the exception and carries on.
            self.display.line(f"{name} again: stopped at once, without a checkpoint of the step in flight")
            os._exit(128 + signum)
        self._signal = signum
        # No step number here: the signal may land just before or just after a step's end. The
        # checkpoint line names the step it wrote.
        self.display.line(f"{name}: finishing the step in flight, then writing its checkpoint "
                          f"({name} or Ctrl-C again to stop at once)")

    def _train_epoch(self) -> None:
        config = self.config
        micro_losses: list[torch.Tensor] = []
        tokens, compiled = 0, 0
        started = time.perf_counter()
        # Only the batches the remaining steps take: a parallel loader reading ahead then ends with them.
        needed = (self.total_steps - self.position.step) * config.optimizer.grad_accum * self.placement.world
        batches = itertools.islice(self.train_loader.epoch(self.position.epoch, start=self.position.batch), needed)
        for index, (batch, inputs) in enumerate(self._placed(batches), start=self.position.batch):
            self.position.batch = index + 1
            if index % self.placement.world != self.placement.rank:
                continue
            tokens += self.task.tokens(batch)
            loss, new = self._micro_step(inputs, last=len(micro_losses) + 1 == config.optimizer.grad_accum)
            micro_losses.append(loss)
            compiled += new
            if len(micro_losses) < config.optimizer.grad_accum:
                continue
            lr = self.optimizer.param_groups[0]["lr"]  # this step's, before the scheduler moves it
            compiled += self._optimizer_step()
            self.position.step += 1
            self._after_step(micro_losses, lr, tokens, time.perf_counter() - started, compiled)
            micro_losses, tokens, compiled = [], 0, 0
            started = time.perf_counter()
            if self.position.step >= self.total_steps:
                return
        # The epoch ran out. A partial accumulation is dropped, as drop_last drops a partial batch.
        self.position.epoch += 1
        self.position.batch = 0
        if micro_losses:
            self._sync("zero_grad", self._zero_grads)
        self._evaluate()
        self.memory.check(f"the end of epoch {self.position.epoch - 1}")
        self.model.train()

    def _zero_grads(self) -> None:
        for parameter in self.model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        if self.placement.spmd is not None:
            self.placement.spmd.shard_like_parameters(self.model, self.optimizer)

    def _placed(self, batches):
        """(CPU batch, model input) pairs. Under --mesh the input is already on the devices, split over
        the batch axes by torch_xla's parallel loader; otherwise it is the CPU batch, moved in the step."""
        if self.placement.spmd is None:
            return ((batch, batch) for batch in batches)
        return self.placement.spmd.device_batches(batches)

    def _sync(self, kind: str, work, *args, shape: tuple[int, ...] = (), **kwargs) -> int:
        """Runs ``work`` and executes the graph it traced; returns how many graphs that compiled."""
        with self.tracing.measure():  # host time spent tracing: what the device waits for
            work(*args, **kwargs)
        runtime.sync()
        return self.compiles.after(kind, shape, self.position.step + 1)

    def _micro_step(self, batch: dict[str, torch.Tensor], *, last: bool) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch, gradients added to .grad (reduced over a mesh's processes
        with the step's ``last``); returns its loss (on the device) and how many graphs that compiled."""
        losses = []
        if self.placement.spmd is not None:
            self.placement.spmd.gradient_sync(self.model, last)

        def forward_backward():
            inputs = {name: tensor.to(self.placement.device) for name, tensor in batch.items()}
            losses.append(micro_batch_gradients(self.model, self.task.model_inputs(inputs), self.config))

        compiled = self._sync("train", forward_backward, shape=tuple(batch["input_ids"].shape))
        return losses[0], compiled

    def _optimizer_step(self) -> int:
        """Clip, step, schedule, zero the gradients; returns how many graphs that compiled."""

        def update():
            optimizer_update(self.model, self.optimizer, self.config, self.placement.spmd)
            self.scheduler.step()

        return self._sync("optimizer", update)

    def _after_step(self, micro_losses: list[torch.Tensor], lr: float, tokens: int, elapsed: float,
                    compiled: int) -> None:
        config, step = self.config, self.position.step
        self.tracing.step_done(steady=not compiled)
        if not compiled:  # steady state: throughput without compile time
            self._step_times.append((elapsed, tokens))
        self._profile(step, compiled)
        compiles = self.compiles.warmup + self.compiles.after_warmup
        if self._stop_at_step == step and self._signal is None:
            self._signal = signal.SIGTERM
        stop = self._signal  # a signal arriving from here on is handled after the next step
        if self.placement.spmd is not None:  # every process stops after the same step (each saves its part)
            stop = self.placement.spmd.agreed_signal(stop)
        logged = step % config.logging.log_steps == 0 or step == self.total_steps
        saving = stop is not None or self.checkpointer.due(step) or step == self.total_steps
        loss = None
        if logged or saving:  # the loss reaches the host only here: no extra sync on other steps
            spmd = self.placement.spmd
            loss = sum((spmd.mean(t) if spmd else t).item() for t in micro_losses) / len(micro_losses)
            if not math.isfinite(loss):  # before it is logged, checkpointed or saved as model/
                raise Stopped(f"step {step}: the training loss is {loss}; stopped without checkpointing this "
                              "step or writing model/. "
                              + self._where_to_resume())
        if logged:
            memory = self.memory.check(f"step {step}", steady=not compiled)
            self.metrics.write({"step": step, "epoch": self.position.epoch, "loss": loss,
                                "lr": lr, "tokens_per_s": tokens / elapsed,
                                "step_time_s": elapsed, "compiles": compiles,
                                "host_rss_mb": memory["host_rss"] / 2**20})
        self.display.update(step, loss=loss if logged else None, tokens_per_s=tokens / elapsed, step_time=elapsed,
                            compiles=compiles)
        if stop is not None:
            path = self._save_checkpoint(step)
            self.display.line(f"checkpoint of step {step} written: {path}\nto resume: {self._resume_command()}")
            raise Interrupted(stop)
        if saving:
            self._save_checkpoint(step)

    def _save_checkpoint(self, step: int) -> str:
        """Writes the checkpoint of ``step``; a failed write is retried once (the state is still in
        memory), a second failure raises Stopped naming the path and the OS error."""
        for attempt in (1, 2):
            try:
                return self.checkpointer.save(self.state_dict(), step)
            except OSError as error:
                failure = f"{error.filename or self.checkpointer.path(step)}: {error.strerror or error}"
                if attempt == 1:
                    log.warning(f"warning: writing the checkpoint of step {step} failed ({failure}); trying again")
        raise Stopped(f"step {step}: writing its checkpoint failed twice ({failure}); the steps since the last "
                      "checkpoint are lost. " + self._where_to_resume())

    def _resume_command(self) -> str:
        return shlex.join(["python", "-m", "train", "--output-dir", self.config.run.output_dir, "--resume"])

    def _where_to_resume(self) -> str:
        """Which checkpoint a resume would start from, and the command."""
        intact = self.checkpointer.newest_intact() if self.placement.is_main else None
        if intact is None:
            return f"No intact checkpoint in {self.checkpointer.directory}: the run has to start again."
        return f"Newest intact checkpoint: {intact}; to resume from it: {self._resume_command()}"

    def _profile(self, step: int, compiled: int) -> None:
        """--profile: a profiler trace of PROFILE_STEPS steps, from the first step that compiled nothing."""
        if not self.config.logging.profile or self._profile_end == -1:
            return
        if self._profile_end is None and not compiled:
            os.makedirs(self.config.logging.profile, exist_ok=True)
            runtime.start_profile(self.config.logging.profile)
            self._profile_end = step + PROFILE_STEPS
        elif self._profile_end is not None and step >= self._profile_end:
            runtime.stop_profile()
            self._profile_end = -1  # done
            self.display.line(f"profile of steps {step - PROFILE_STEPS + 1}-{step} written to "
                              f"{self.config.logging.profile}")

    # ------------------------------------------------------------------
    # Evaluation

    @torch.no_grad()
    def _evaluate(self) -> dict:
        """The task's held-out metrics (its Evaluation: accuracy and macro-F1, perplexity); logged and returned."""
        self.model.eval()
        evaluation = self.task.Evaluation()
        for batch, inputs in self._placed(self.eval_loader.epoch(0)):
            inputs = {name: tensor.to(self.placement.device) for name, tensor in inputs.items()}
            with autocast(self.config):
                evaluation.add(model_outputs(self.model, self.task.model_inputs(inputs)), inputs)
            runtime.sync()
            self.compiles.after("eval", tuple(batch["input_ids"].shape), self.position.step)
        result = evaluation.result(self.placement.spmd.gather if self.placement.spmd else _unchanged)
        record = {"step": self.position.step, "eval": True, **result}
        self.metrics.write(record)
        self.display.line("eval step {}: ".format(self.position.step)
                          + " ".join(f"{k} {v:.4f}" for k, v in result.items()))
        self._final_eval = record
        return record

    # ------------------------------------------------------------------
    # The end

    def _finish(self) -> dict:
        config = self.config
        model_dir = os.path.join(config.run.output_dir, "model")
        records = self.metrics.read()
        model = self.placement.accelerator.unwrap_model(self.model) if self.placement.accelerator else self.model
        # Under --mesh every host takes part in copying the sharded weights to the CPU (a collective).
        state = cpu_state(model) if self.placement.spmd or self.placement.is_main else None
        if self.placement.is_main:
            save_model(model, self.tokenizer, model_dir, state)
            metrics.plot_loss(records, os.path.join(config.run.output_dir, metrics.PLOT_FILE), self.task.plot_eval)
        seconds = sum(t for t, _ in self._step_times)
        summary = {name: value for name, value in self._final_eval.items() if name not in ("step", "eval")}
        first_eval = next((r for r in records if r.get("eval")), None)
        summary.update(self.task.summary(first_eval, self._final_eval))
        summary.update({
            "tokens_per_s": sum(n for _, n in self._step_times) / seconds if seconds else None,
            "compiles_warmup": self.compiles.warmup, "compiles_after_warmup": self.compiles.after_warmup,
            "jax_traces_after_warmup": self.compiles.jax_traces_after_warmup, **self.tracing.summary(),
            "peak_host_bytes": peak_host_rss(), "peak_device_bytes": self.memory.peak_device(),
            "model_dir": model_dir, "checkpoints": self.checkpointer.directory,
        })
        if self.mesh_description is not None:
            summary["mesh"] = self.mesh_description
        return summary

    @property
    def mesh_description(self) -> str | None:
        """The devices the run trains on, as printed at its start and in the summary: the mesh, and
        why when --mesh auto decided (None for one device on a host with one)."""
        if self.placement.spmd is None:
            return self.placement.mesh_note
        return self.placement.spmd.description + (f", {self.placement.mesh_note}" if self.placement.mesh_note else "")

    def close(self) -> None:
        """Releases what train() may have left open (a profile trace), leaves the run's contexts and
        frees the output folder for the next run."""
        self._contexts.close()
        if self.config.logging.profile and self._profile_end not in (None, -1):
            runtime.stop_profile()
            self._profile_end = -1
        self._release_lock()
