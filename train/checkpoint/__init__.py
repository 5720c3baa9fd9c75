"""The run's state on disk: atomic checkpoints of the trainer's state, the RNG states they hold, and finding
the latest one (here); their two formats (file_format.py, sharded_format.py); every durable write of the run's
files (durable.py); one run per output folder (lock.py).

A checkpoint is written under a temporary name and renamed into place (``os.replace`` is
atomic on POSIX), so a preemption while writing leaves the previous checkpoint intact and
never half of a new one: ``latest()`` only sees renamed ones. What goes in it is the
trainer's ``state_dict()`` (model, optimizer, scheduler, data position) plus the RNG states
of Python, NumPy, torch's CPU generator (patches draws torchattn's dropout seeds from it)
and the device. Two formats, one interface (:func:`format_of`):

- ``<output_dir>/checkpoints/step-<step>.pt``, one file written by the main process, when
  each process holds whole tensors (no ``--mesh``; file_format.py).
- ``<output_dir>/checkpoints/step-<step>/``, a folder, when tensors are sharded over a
  mesh (sharded_format.py).

Every checkpoint carries a SHA-256 digest and is verified before it loads: the file's digest is
its zip comment (``unzip -z`` shows it; torch.load ignores it), the folder's is a SHA256SUMS file
(``sha256sum -c`` checks it). A checkpoint that does not verify or lacks what the run needs is
``Damaged``. After a save the new checkpoint is read back and verified before rotation removes
older ones, so the newest intact checkpoint is never deleted for one that is not.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import time
import types

import numpy as np
import torch

from .. import runtime
from . import durable, file_format, sharded_format

DIRECTORY = "checkpoints"
_NAME = re.compile(r"^step-(\d+)(\.pt)?$")  # a file, or a sharded checkpoint's folder
_TEMPORARY = re.compile(r"^step-(\d+)(\.pt)?\.tmp")


class Damaged(Exception):
    """A checkpoint that does not verify or cannot be read; str(e) is one line naming it and why."""


def rng_state(device) -> dict:
    """Every random generator a training step draws from."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state(),
            "xla": runtime.rng_state(device)}


def set_rng_state(state: dict, device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    runtime.set_rng_state(state["xla"], device)


class Checkpointer:
    """Saves every ``every`` steps (and when asked), keeps the newest ``keep``, finds the latest.

    ``writer``: this process writes files (one process of a multi-process run; the coordinator
    of a sharded one). ``sharded``: the tensors are sharded over a mesh; every
    process then takes part in each save and load (see the module docstring).
    """

    def __init__(self, output_dir: str, *, every: int, keep: int, writer: bool = True, sharded: bool = False):
        self.directory = os.path.join(output_dir, DIRECTORY)
        self.every = every
        self.keep = keep
        self.writer = writer
        self.sharded = sharded
        self.format = sharded_format if sharded else file_format  # the one this checkpointer writes

    def due(self, step: int) -> bool:
        """Whether the loop's ``step`` is a regular checkpoint step."""
        return self.every > 0 and step % self.every == 0

    def _entries(self, pattern: re.Pattern) -> list[tuple[int, str]]:
        """(step, name) of each entry of the folder whose name matches ``pattern``."""
        if not os.path.isdir(self.directory):
            return []
        return [(int(m.group(1)), m.string) for m in map(pattern.match, os.listdir(self.directory)) if m]

    def _checkpoints(self) -> dict[int, str]:
        return dict(self._entries(_NAME))

    def steps(self) -> list[int]:
        """Steps of the checkpoints on disk (of either format), oldest first."""
        return sorted(self._checkpoints())

    def path(self, step: int) -> str:
        """Where this checkpointer writes the checkpoint of ``step``."""
        return os.path.join(self.directory, f"step-{step:08d}" + self.format.SUFFIX)

    def latest(self) -> str | None:
        names = self._checkpoints()
        return os.path.join(self.directory, names[max(names)]) if names else None

    def save(self, state: dict, step: int) -> str:
        """Writes ``state`` (tensors may live on the XLA device) as the checkpoint of ``step``; raises
        the OSError of a failed write, or EIO when what is on disk does not verify."""
        path = self.path(step)
        self.format.save(state, path, writer=self.writer)
        if self.writer:
            try:
                verify(path)  # read back: older checkpoints go only once this one is whole on disk
            except Damaged as error:
                raise OSError(errno.EIO, f"written but does not verify: {error}") from None
            self._remove_old(step)
        return path

    def newest_intact(self) -> str | None:
        """The newest checkpoint that verifies, or None."""
        names = self._checkpoints()
        for step in sorted(names, reverse=True):
            path = os.path.join(self.directory, names[step])
            try:
                verify(path)
                return path
            except Damaged:
                continue
        return None

    def load_newest(self, template=None, required: tuple[str, ...] = ()) -> tuple[str, dict, list[str]]:
        """(path, state, damaged) of the newest checkpoint that verifies and holds the keys ``required``;
        ``damaged``: one line for each newer one skipped. Raises Damaged, naming every checkpoint and
        what is wrong with it, when none is intact. ``template``: as for load().

        The run goes on from the loaded step and will write the skipped steps again, so the writer moves
        each skipped checkpoint aside (``<name>.damaged-<time>``, never deleted: it may be worth a look)
        and removes what crashed saves of later steps left (``.tmp``), which the new saves would meet."""
        damaged = []
        names = self._checkpoints()
        for step in sorted(names, reverse=True):
            path = os.path.join(self.directory, names[step])
            try:
                state = self.load(path, template, required)
            except Damaged as error:
                damaged.append((path, str(error)))
                continue
            if self.writer:
                damaged = [(path, f"{problem}; moved aside to {_set_aside(path)}") for path, problem in damaged]
                for later, name in self._entries(_TEMPORARY):
                    if later > step:
                        _remove(os.path.join(self.directory, name))
            return path, state, [problem for _, problem in damaged]
        raise Damaged(f"no intact checkpoint in {self.directory}: "
                      + ("; ".join(problem for _, problem in damaged) or "none written"))

    def _remove_old(self, step: int) -> None:
        """Removes all but the newest ``keep`` checkpoints, never ``step``'s (just verified; a resumed run
        may still have newer, damaged ones), and temporaries left by saves that crashed (up to ``step``:
        every process has finished writing those)."""
        names = self._checkpoints()
        for old in sorted(names)[:-self.keep]:
            if old != step:
                _remove(os.path.join(self.directory, names[old]))
        for leftover, name in self._entries(_TEMPORARY):
            if leftover <= step:
                _remove(os.path.join(self.directory, name))

    def load(self, path: str, template=None, required: tuple[str, ...] = ()) -> dict:
        """The state saved at ``path``, verified, with every tensor on the CPU (a file) or on the device
        (a folder). Raises Damaged if it does not verify, cannot be read or lacks a key of ``required``.

        A sharded checkpoint (a folder) is read in place into ``template()``: the run's own
        state_dict(), tensors on the device with their shardings and the optimizer's state
        already created (runtime.prime_optimizer), so each process reads only what it holds.
        """
        form = format_of(path)
        if form.NEEDS_TEMPLATE and template is None:
            raise ValueError(f"load: {path} is a sharded checkpoint; expected a template (the run's state "
                             "on the device) to read it into, got None")
        verify(path)
        try:
            state = form.load(path, template() if form.NEEDS_TEMPLATE else None)
        except form.READ_ERRORS as error:  # verified, yet not a state this torch can read
            raise Damaged(f"{path}: cannot be read ({type(error).__name__}: {error})") from None
        missing = [key for key in required if not isinstance(state, dict) or key not in state]
        if missing:
            raise Damaged(f"{path}: not a training checkpoint (no {', '.join(missing)})")
        return state


def format_of(path: str) -> types.ModuleType:
    """The format of the checkpoint at ``path``: a folder is sharded (sharded_format.py), a file is one file
    (file_format.py). Both have SUFFIX, NEEDS_TEMPLATE, READ_ERRORS and save(state, path, writer=),
    verify(path) -> problem or None, load(path, template)."""
    return sharded_format if os.path.isdir(path) else file_format


def verify(path: str) -> None:
    """Raises Damaged unless the checkpoint at ``path`` (a file or a sharded folder) matches its digest."""
    problem = format_of(path).verify(path)
    if problem:
        raise Damaged(f"{path}: {problem}")


def _set_aside(path: str) -> str:
    """Renames the checkpoint at ``path`` to a name no checkpoint pattern matches; returns that name."""
    aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
    durable.replace(path, aside)
    return aside


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
