"""The training loop: build a run from a RunConfig, train, evaluate, checkpoint, stop cleanly.

Lifecycle (train/__main__.py): ``Trainer(config)`` checks every input and loads data and
model before anything is written (a bad input leaves no output folder behind);
``train()`` runs; ``close()`` always runs. The trainer is Stateful: ``state_dict()``
holds everything a resumed run needs to continue exactly (model, optimizer, scheduler,
RNG states, data position), ``load_state_dict()`` restores it.

XLA shapes the loop. Each micro-batch is one graph (forward, backward, gradient
accumulation) and each optimizer step another, both synced with ``torch_xla.sync()``;
batches have a fixed number of rows and a length from a small set of buckets, so the
graphs compile once per bucket and then run from the cache. Loss values reach the
host only on logged steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import random
import shlex
import signal
import time

import numpy as np
import torch

from . import checkpoint, metrics
from .config import ConfigError, RunConfig, save_config, CONFIG_FILE, mesh_axes
from .guards import CompileWatch, MemoryWatch, TracingTimer, peak_host_rss
from .parallel import Spmd

log = logging.getLogger("train")

PROFILE_STEPS = 3  # steps --profile captures, after warm-up


class Interrupted(Exception):
    """Raised by train() after a SIGTERM/SIGINT was handled: the step finished and a checkpoint was written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
    """Seeds every generator a run draws from; torch.manual_seed does not reach the XLA device's."""
    import torch_xla.core.xla_model as xm

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    xm.set_rng_state(seed, device)


def classification_scores(predictions: np.ndarray, labels: np.ndarray, num_labels: int) -> dict[str, float]:
    """Accuracy and macro-F1 (the mean over labels of each label's F1; a label never
    predicted nor present counts as F1 0, as in scikit-learn's zero_division=0)."""
    accuracy = float(np.mean(predictions == labels))
    f1s = []
    for label in range(num_labels):
        true_positive = np.sum((predictions == label) & (labels == label))
        predicted, actual = np.sum(predictions == label), np.sum(labels == label)
        f1s.append(2 * true_positive / (predicted + actual) if predicted + actual else 0.0)
    return {"accuracy": accuracy, "macro_f1": float(np.mean(f1s))}


def autocast(config: RunConfig):
    """--bf16: compute in bfloat16 under autocast; weights, gradients and optimizer state stay float32."""
    return torch.autocast("xla", dtype=torch.bfloat16, enabled=config.bf16)


def micro_batch_gradients(model: torch.nn.Module, inputs: dict[str, torch.Tensor], config: RunConfig
                          ) -> torch.Tensor:
    """Forward and backward of one micro-batch already on the device: its gradients, divided by
    --grad-accum, are added to .grad. Returns the loss, detached (still on the device)."""
    with autocast(config):
        loss = model(**inputs).loss
    (loss / config.grad_accum).backward()
    return loss.detach()


def optimizer_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig,
                     spmd: Spmd | None = None) -> None:
    """The optimizer step after the micro-batches: clip, decay, AdamW, zero the gradients in place."""
    if config.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    if config.weight_decay > 0:
        # AdamW's decoupled decay, w -= lr * wd * w, before its update as in torch's AdamW.
        # torch's AdamW multiplies by the Python float 1 - lr * wd instead: late in a
        # decaying schedule that is float32 1.0, which torch_xla puts into the graph as a
        # constant, so the step would compile again. A small alpha stays data.
        decay = -optimizer.param_groups[0]["lr"] * config.weight_decay
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(parameter, alpha=decay)
    optimizer.step()
    # Zeroed in place, not set to None: the next micro-batch's graph stays the same.
    optimizer.zero_grad(set_to_none=False)
    if spmd is not None:  # the step's outputs keep the parameters' sharding
        spmd.shard_like_parameters(model, optimizer)


class Trainer:
    """One training run. See the module docstring for its lifecycle."""

    def __init__(self, config: RunConfig, *, stop_at_step: int | None = None):
        """Checks the inputs, loads data and model, then creates the output folder.

        ``stop_at_step`` (tests) makes train() behave as if SIGTERM arrived during that step.
        Raises ConfigError, data.DataError or models.ModelError (one line each) for bad input.
        """
        import datasets
        import transformers
        from accelerate import Accelerator

        from . import data, models

        # Progress bars of dataset maps and weight loading would clutter logs; ours shows progress.
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()

        if config.resume and config.output_dir is None:
            raise ConfigError("--resume: needs --output-dir, the folder of the run to continue")
        self.config = config = config.with_output_dir()
        self.spmd: Spmd | None = None
        if config.mesh is None:
            # accelerate: the XLA device, and under `accelerate launch` on a TPU VM the process
            # rank, world size and the gradient all-reduce in the optimizer step (see README).
            self.accelerator = Accelerator()
            self.device = self.accelerator.device
            self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
            self.is_main = self.accelerator.is_main_process  # the one process that writes files
        else:
            # SPMD: one process per host drives all devices, GSPMD reduces the gradients (train/parallel.py).
            self.spmd = Spmd(mesh_axes(config.mesh))  # before anything touches the device
            self.device = self.spmd.device
            self.rank, self.world = 0, 1  # every host walks every global batch, reading its own rows
            self.is_main = self.spmd.host == 0
        self.checkpointer = checkpoint.Checkpointer(config.output_dir, every=config.save_steps,
                                                    keep=config.keep_checkpoints, writer=self.is_main,
                                                    sharded=self.spmd is not None)
        self._resume_path = self._check_output_dir()
        self._stop_at_step = stop_at_step
        self._signal: int | None = None
        seed_everything(config.seed, self.device)

        # --- data and model: every user input is checked here, before anything is written
        splits = data.load_splits(config.dataset, task=config.task, text_column=config.text_column,
                                  label_column=config.label_column, eval_fraction=config.eval_fraction,
                                  seed=config.seed)
        self.label_names = splits["train"].features["label"].names if config.task == "classification" else None
        self.model, self.tokenizer = models.load_model(
            config.model, task=config.task, num_labels=len(self.label_names) if self.label_names else None,
            attn=config.attn, backend=config.backend, dropout=config.dropout)
        limit = models.max_positions(self.model.config)
        if limit is not None and config.max_length > limit:
            raise ConfigError(f"--max-length: expected at most {limit} (the position limit of {config.model}), "
                              f"got {config.max_length}")
        tokenize = data.tokenize_classification if config.task == "classification" else data.tokenize_lm
        tokenized = tokenize(splits, self.tokenizer, config.max_length)
        # LM rows are packed to exactly max_length; classification batches take a bucket.
        buckets = data.length_buckets(config.max_length) if config.task == "classification" else (config.max_length,)
        host, hosts = self.spmd.part if self.spmd else (0, 1)
        loader = dict(batch_size=config.batch_size, buckets=buckets, pad_id=self.tokenizer.pad_token_id,
                      seed=config.seed, host=host, hosts=hosts)
        self.train_loader = data.BatchLoader(tokenized["train"], shuffle=True, drop_last=True, **loader)
        self.eval_loader = data.BatchLoader(tokenized["eval"], shuffle=False, drop_last=False, **loader)
        if len(self.train_loader) == 0:
            raise ConfigError(f"--batch-size: {config.batch_size} is more than the {len(tokenized['train'])} "
                              "training rows: no full batch")
        # Each process takes every world-th batch; an optimizer step uses grad_accum of them per process.
        self.total_steps = config.epochs * (len(self.train_loader) // (config.grad_accum * self.world))
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        if self.total_steps == 0:
            raise ConfigError(f"--grad-accum: {config.grad_accum} micro-batches per step (times {self.world} "
                              f"processes) is more than the {len(self.train_loader)} batches of an epoch")

        # --- device, optimizer, schedule
        if config.grad_checkpointing:
            from .recompute import enable_activation_checkpointing

            enable_activation_checkpointing(self.model)
        # Weight decay is applied by _optimizer_step itself (see there), so AdamW gets 0.
        adamw = functools.partial(torch.optim.AdamW, lr=config.lr, weight_decay=0.0)
        if self.spmd is None:
            # Moves the model to the device; the optimizer then all-reduces gradients across processes.
            self.model, self.optimizer = self.accelerator.prepare(self.model, adamw(self.model.parameters()))
        else:
            # Sharded before the optimizer takes the parameters: moving to the device replaces them.
            self.model = self.spmd.shard_model(self.model)
            self.optimizer = adamw(self.model.parameters())
        warmup_steps = int(config.warmup * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(
            step, warmup_steps=warmup_steps, total_steps=self.total_steps, schedule=config.lr_schedule))
        self.position = Position()

        self.compiles = CompileWatch()
        self.tracing = TracingTimer()
        # Gradients exist from the start, so every micro-batch is the same graph (no first-step
        # variant that creates them). Before a resume restores the RNGs: a sync advances the XLA
        # generator, so none may run between the restore and the next step.
        self._sync("zero_grad", self._zero_grads)

        # --- output folder: only now, after every check passed
        self.metrics = metrics.MetricsFile(config.output_dir, writer=self.is_main)
        if self.is_main:
            os.makedirs(config.output_dir, exist_ok=True)
            save_config(config, os.path.join(config.output_dir, CONFIG_FILE))
        if self._resume_path is not None:
            self.load_state_dict(self.checkpointer.load(self._resume_path, template=self._state_to_load_into))
            if self.is_main:
                self.metrics.truncate_after(self.position.step)
        self.memory = MemoryWatch(self.device)
        self.display = metrics.Progress(self.total_steps, quiet=not self.is_main)
        self._step_times: list[tuple[float, int]] = []  # (seconds, tokens) of steps after warm-up
        self._final_eval: dict | None = None
        self._profile_end: int | None = None  # last step of the --profile trace; -1 once written
        # Entered once for the whole run (torchattn's kernels per device under --mesh); close() leaves it.
        self._contexts = contextlib.ExitStack()
        if self.spmd is not None:
            self._contexts.enter_context(self.spmd.attention())

    def _check_output_dir(self) -> str | None:
        """The checkpoint to resume from; refuses a folder holding another run's checkpoints."""
        latest = self.checkpointer.latest()
        if self.config.resume:
            if latest is None:
                raise ConfigError(f"--resume: nothing to resume in {self.config.output_dir} "
                                  f"(no {checkpoint.DIRECTORY}/step-*)")
            return latest
        if latest is not None:
            raise ConfigError(f"--output-dir: {self.config.output_dir} holds another run's checkpoints "
                              f"({os.path.basename(latest)}); add --resume to continue it or pick another folder")
        return None

    # ------------------------------------------------------------------
    # Stateful

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "position": dataclasses.asdict(self.position),
                "rng": checkpoint.rng_state(self.device)}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.position = Position(**state["position"])
        checkpoint.set_rng_state(state["rng"], self.device)

    def _state_to_load_into(self) -> dict:
        """state_dict() ready to take a sharded checkpoint in place: the optimizer's state exists."""
        from torch_xla.experimental.distributed_checkpoint import prime_optimizer

        prime_optimizer(self.optimizer)  # one step with zero gradients creates it
        return self.state_dict()

    # ------------------------------------------------------------------
    # Training

    def train(self) -> dict:
        """Trains to the end; returns the summary. Raises Interrupted after SIGTERM/SIGINT
        (the step in flight finished and was checkpointed)."""
        config = self.config
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if self._resume_path is not None:
                self.display.line(f"resuming from {self._resume_path} at step {self.position.step}")
            elif config.task == "lm":  # perplexity before training, to compare with after
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
        if self._signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._signal = signum
        self.display.line(f"{signal.Signals(signum).name}: finishing step {self.position.step + 1}, "
                          "then writing a checkpoint (again to stop at once)")

    def _train_epoch(self) -> None:
        config = self.config
        micro_losses: list[torch.Tensor] = []
        tokens, compiled = 0, 0
        started = time.perf_counter()
        # Only the batches the remaining steps take: a parallel loader reading ahead then ends with them.
        needed = (self.total_steps - self.position.step) * config.grad_accum * self.world
        batches = itertools.islice(self.train_loader.epoch(self.position.epoch, start=self.position.batch), needed)
        for index, (batch, inputs) in enumerate(self._placed(batches), start=self.position.batch):
            self.position.batch = index + 1
            if index % self.world != self.rank:
                continue
            tokens += self._tokens(batch)
            loss, new = self._micro_step(inputs)
            micro_losses.append(loss)
            compiled += new
            if len(micro_losses) < config.grad_accum:
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
        if self.spmd is not None:
            self.spmd.shard_like_parameters(self.model, self.optimizer)

    def _placed(self, batches):
        """(CPU batch, model input) pairs. Under --mesh the input is already on the devices, split over
        the batch axes by torch_xla's parallel loader; otherwise it is the CPU batch, moved in the step."""
        if self.spmd is None:
            return ((batch, batch) for batch in batches)
        return self.spmd.device_batches(batches)

    def _sync(self, kind: str, work, *args, shape: tuple[int, ...] = (), **kwargs) -> int:
        """Runs ``work`` and executes the graph it traced; returns how many graphs that compiled."""
        import torch_xla

        with self.tracing.measure():  # host time spent tracing: what the device waits for
            work(*args, **kwargs)
        torch_xla.sync()
        return self.compiles.after(kind, shape, self.position.step + 1)

    def _tokens(self, batch: dict[str, torch.Tensor]) -> int:
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return batch["input_ids"].numel()

    def _micro_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch, gradients added to .grad; returns its loss
        (on the device) and how many graphs that compiled."""
        losses = []

        def forward_backward():
            inputs = {name: tensor.to(self.device) for name, tensor in batch.items()}
            losses.append(micro_batch_gradients(self.model, inputs, self.config))

        compiled = self._sync("train", forward_backward, shape=tuple(batch["input_ids"].shape))
        return losses[0], compiled

    def _optimizer_step(self) -> int:
        """Clip, step, schedule, zero the gradients; returns how many graphs that compiled."""

        def update():
            optimizer_update(self.model, self.optimizer, self.config, self.spmd)
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
        loss = None
        if step % config.log_steps == 0 or step == self.total_steps:
            loss = sum(t.item() for t in micro_losses) / len(micro_losses)
            memory = self.memory.check(f"step {step}")
            self.metrics.write({"step": step, "epoch": self.position.epoch, "loss": loss,
                                "lr": lr, "tokens_per_s": tokens / elapsed,
                                "step_time_s": elapsed, "compiles": compiles,
                                "host_rss_mb": memory["host_rss"] / 2**20})
        self.display.update(step, loss=loss, tokens_per_s=tokens / elapsed, step_time=elapsed, compiles=compiles)
        if self._stop_at_step == step and self._signal is None:
            self._signal = signal.SIGTERM
        if self._signal is not None:
            path = self.checkpointer.save(self.state_dict(), step)
            command = ["python", "-m", "train", "--output-dir", config.output_dir, "--resume"]
            self.display.line(f"checkpoint written: {path}\nto resume: {shlex.join(command)}")
            raise Interrupted(self._signal)
        if self.checkpointer.due(step) or step == self.total_steps:
            self.checkpointer.save(self.state_dict(), step)

    def _profile(self, step: int, compiled: int) -> None:
        """--profile: a torch_xla trace of PROFILE_STEPS steps, from the first step that compiled nothing."""
        if not self.config.profile or self._profile_end == -1:
            return
        import torch_xla.debug.profiler as xp

        if self._profile_end is None and not compiled:
            os.makedirs(self.config.profile, exist_ok=True)
            xp.start_trace(self.config.profile)
            self._profile_end = step + PROFILE_STEPS
        elif self._profile_end is not None and step >= self._profile_end:
            xp.stop_trace()
            self._profile_end = -1  # done
            self.display.line(f"profile of steps {step - PROFILE_STEPS + 1}-{step} written to {self.config.profile}")

    # ------------------------------------------------------------------
    # Evaluation

    @torch.no_grad()
    def _evaluate(self) -> dict:
        """Held-out accuracy and macro-F1 (classification) or perplexity (lm); logged and returned."""
        import torch_xla

        self.model.eval()
        outputs, labels, token_counts = [], [], []
        # Labels and token counts are read from the device: under --mesh with several hosts, the
        # CPU batch holds only this host's rows.
        for batch, inputs in self._placed(itertools.islice(self.eval_loader.epoch(0), self.config.eval_batches)):
            inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
            with autocast(self.config):
                output = self.model(**inputs)
            if self.config.task == "classification":
                outputs.append(output.logits.argmax(dim=-1))
                labels.append(inputs["labels"])
            else:
                # HF's causal LM loss: mean over the tokens whose shifted label is not -100.
                counted = (inputs["labels"][:, 1:] != -100).sum()
                outputs.append(output.loss * counted)
                token_counts.append(counted)
            torch_xla.sync()
            self.compiles.after("eval", tuple(batch["input_ids"].shape), self.position.step)
        if self.config.task == "classification":
            predictions = torch.cat([p.cpu() for p in outputs]).numpy()
            truth = torch.cat([label.cpu() for label in labels]).numpy()
            real = truth != -100  # rows that only fill the last batch up
            result = classification_scores(predictions[real], truth[real], len(self.label_names))
        else:
            nll = sum(t.item() for t in outputs) / sum(t.item() for t in token_counts)
            result = {"perplexity": math.exp(nll)}
        record = {"step": self.position.step, "eval": True, **result}
        self.metrics.write(record)
        self.display.line("eval step {}: ".format(self.position.step)
                          + " ".join(f"{k} {v:.4f}" for k, v in result.items()))
        self._final_eval = record
        return record

    # ------------------------------------------------------------------
    # The end

    def _finish(self) -> dict:
        from .models import cpu_state, save_model

        config = self.config
        model_dir = os.path.join(config.output_dir, "model")
        records = self.metrics.read()
        model = self.model if self.spmd else self.accelerator.unwrap_model(self.model)
        # Under --mesh every host takes part in copying the sharded weights to the CPU (a collective).
        state = cpu_state(model) if self.spmd or self.is_main else None
        if self.is_main:
            save_model(model, self.tokenizer, model_dir, state)
            metrics.plot_loss(records, os.path.join(config.output_dir, metrics.PLOT_FILE))
        seconds = sum(t for t, _ in self._step_times)
        summary = {name: value for name, value in self._final_eval.items() if name not in ("step", "eval")}
        first_eval = next((r for r in records if r.get("eval")), None)
        if config.task == "lm" and first_eval is not None and first_eval is not self._final_eval:
            summary["perplexity_before"] = first_eval["perplexity"]
        summary.update({
            "tokens_per_s": sum(n for _, n in self._step_times) / seconds if seconds else None,
            "compiles_warmup": self.compiles.warmup, "compiles_after_warmup": self.compiles.after_warmup,
            "jax_traces_after_warmup": self.compiles.jax_traces_after_warmup, **self.tracing.summary(),
            "peak_host_bytes": peak_host_rss(), "peak_device_bytes": self.memory.peak_device(),
            "model_dir": model_dir, "checkpoints": self.checkpointer.directory,
        })
        if self.spmd is not None:
            summary["mesh"] = self.spmd.description
        return summary

    def close(self) -> None:
        """Releases what train() may have left open (a profile trace) and leaves the run's contexts."""
        self._contexts.close()
        if self.config.profile and self._profile_end not in (None, -1):
            import torch_xla.debug.profiler as xp

            xp.stop_trace()
            self._profile_end = -1
