"""Reading one Mosaic kernel's final VLIW schedule from libtpu 0.0.21's ``--xla_jf_dump_to`` files.

A compile writes, per kernel, ``<id>-<name>-NN-<pass>.txt`` files; three are read here:

- ``*-schedule-analysis_final_bundles.txt``: "total scheduled bundles: N";
- ``*-final_bundles.txt``: one VLIW bundle per line (``0x17 LB: > { ... }``) with the markers
  ``LB:`` (the first bundle of a loop body) and ``PF:`` (where a predicated region's skip lands),
  and ``sbr.rel (%p) target bundleno = ...`` branches (a forward one skips a predicated region:
  ``pl.when``, up to the next ``PF:``, which also ends the enclosing regions branching to the same
  target; the one on the ``/* loop exit test */`` closes the loop). ``>`` marks a non-empty bundle
  inside the loop. A region's first bundles are its branch's delay slots, counted with it;
- ``*-final_hlo-static-per-bundle-utilization.txt``: the slots each unit has and uses per bundle.

A ``pallas_call``'s grid is one loop, its body one grid step (the pipeline adds two iterations
that only move blocks). A region entered only when a grid index equals a constant
(``pl.when(j == 0)``, ``pl.when(j == last)``: its skip predicate is ``scmp.ne <index>, <constant>``)
runs once per row of tiles; every other region (e.g. the mask's tile skipping) counts as
every-step work. Anything that does not look as 0.0.21 writes it raises :class:`DumpFormatError`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from pathlib import Path

FORMAT_VERSION = "0.0.21"  # the libtpu whose dump format this module reads
UNITS = ("MXU", "XLU", "VALU", "EUP", "LOAD", "STORE", "SALU")  # the utilization file's columns, in order

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|0)\s+(LH|LB|LE|PB|PF|CT)?:\s*(>?)\s*\{")
_BRANCH = re.compile(r"sbr\.rel \((!?)(%p\d+_p\d+)\) target bundleno = (\d+) \(0x[0-9a-f]+\), region = \d+")
_PREDICATE = re.compile(r"(%p\d+_p\d+) = ([^;}]*)")
_EQUALS_CONSTANT = {"": re.compile(r"^scmp\.ne\.s32\.totalorder (%s\d+_s\d+), -?\d+$"),  # skip unless == C
                    "!": re.compile(r"^scmp\.eq\.s32\.totalorder (%s\d+_s\d+), -?\d+$")}
_SCALAR = re.compile(r"(%s\d+_s\d+) = ([^;}]*)")
_SPILL_STORE = re.compile(r"= sst \[smem:\[(#allocation\d+_spill)\]\] (%s\d+_s\d+)")
_LOOP_EXIT = re.compile(r"^scmp\.ge\.s32\.totalorder %s\w+, (\d+) /\* loop exit test \*/$")


class DumpFormatError(ValueError):
    """A dump file is not what libtpu 0.0.21 writes: nothing is read from it."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"{path}: {what} (installed libtpu {_installed_libtpu()}; this reader knows the format "
                         f"of libtpu {FORMAT_VERSION}'s --xla_jf_dump_to files)")


@dataclasses.dataclass(frozen=True)
class Region:
    """A predicated region of the loop body: bundles [first, last] (indices into the program)."""

    first: int
    last: int
    once_per_row: bool

    @property
    def bundles(self) -> int:
        return self.last - self.first + 1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One kernel's final schedule: the loop body is bundles [body_first, body_last]."""

    path: Path  # the final_bundles file
    total_bundles: int
    body_first: int
    body_last: int
    loop_trips: int  # iterations of the grid loop (grid steps + 2 for a pipelined pallas_call); 1 without a loop
    regions: tuple[Region, ...]  # every predicated region in the body, outer before inner
    capacity: dict[str, int]  # slots per bundle of each unit
    usage: tuple[tuple[int, ...], ...]  # per bundle, slots used per unit (in UNITS order)

    @property
    def body_bundles(self) -> int:
        return self.body_last - self.body_first + 1

    def once_per_row_bundles(self) -> list[int]:
        """The bundles of the body that run once per row of tiles (outermost such regions)."""
        taken: set[int] = set()
        for region in self.regions:
            if region.once_per_row and region.first not in taken:
                taken.update(range(region.first, region.last + 1))
        return sorted(taken)

    def step_bundles(self) -> list[int]:
        """The bundles of the body that every grid step runs (or may run: masked-tile regions)."""
        once = set(self.once_per_row_bundles())
        return [i for i in range(self.body_first, self.body_last + 1) if i not in once]

    def path_regions(self) -> list[Region]:
        """The alternative paths of the every-step work, in program order (e.g. a tile's mask-free and masked
        work, each run on some of the steps): the outermost regions that are not once per row, looking inside
        a region that is alone at its level (a guard every step takes, such as the pipeline's)."""
        level = self._children(None)
        while len(level) == 1 and self._children(level[0]):
            level = self._children(level[0])
        return level

    def _children(self, parent: Region | None) -> list[Region]:
        """The regions directly inside ``parent`` (None: the body) that are not once per row."""
        inside = [r for r in self.regions if parent is None
                  or (r != parent and parent.first <= r.first and r.last <= parent.last)]
        direct = [r for r in inside if not any(o is not r and o.first <= r.first and r.last <= o.last
                                               for o in inside)]
        return [r for r in direct if not r.once_per_row]

    def unit_slots(self, bundles: list[int]) -> dict[str, int]:
        return {unit: sum(self.usage[i][u] for i in bundles) for u, unit in enumerate(UNITS)}


def kernel_files(directory: Path, kernel_id: str) -> dict[str, Path]:
    """The three files of one Mosaic kernel (``<id>-<name>-NN-...``), by role."""
    found = {}
    for role, suffix in (("analysis", "-schedule-analysis_final_bundles.txt"), ("bundles", "-final_bundles.txt"),
                         ("utilization", "-final_hlo-static-per-bundle-utilization.txt")):
        paths = [p for p in directory.glob(f"{kernel_id}-*{suffix}")
                 if role != "bundles" or not p.name.endswith("schedule-analysis_final_bundles.txt")]
        if len(paths) != 1:
            raise DumpFormatError(directory / f"{kernel_id}-*{suffix}", f"expected one such file, found {len(paths)}")
        found[role] = paths[0]
    return found


def static_bundles(directory: Path, kernel_id: str) -> int:
    """The scheduled bundles of a program, its loops (if any) counted once: what its schedule analysis says."""
    return _total_bundles(kernel_files(directory, kernel_id)["analysis"])


def read(directory: Path, kernel_id: str) -> Schedule:
    """The schedule of the kernel whose dump files in ``directory`` start with ``kernel_id``."""
    files = kernel_files(directory, kernel_id)
    total = _total_bundles(files["analysis"])
    lines = _bundle_lines(files["bundles"], total)
    capacity, usage = _utilization(files["utilization"], total)
    path = files["bundles"]
    predicates = {m.group(1): m.group(2).strip() for line in lines for m in _PREDICATE.finditer(line)}
    starts = [i for i, line in enumerate(lines) if _BUNDLE.match(line).group(2) == "LB"]
    if len(starts) > 1:
        raise ValueError(f"{path}: {len(starts)} loops; a kernel with a loop inside its grid step (fori_loop) "
                         f"is not measured: its bundles per step would not count the inner loop's trips")
    if not starts:
        return Schedule(path, total, 0, total - 1, 1, (), capacity, usage)
    first = starts[0]
    back_edge, trips = _back_edge(path, lines, predicates)
    if back_edge < first:
        raise DumpFormatError(path, f"the loop's closing branch (bundle {hex(back_edge)}) comes before its 'LB:' "
                                    f"bundle {hex(first)}")
    last = _body_end(lines, back_edge)
    scalars = {m.group(1): m.group(2).strip() for line in lines for m in _SCALAR.finditer(line)}
    spills = {m.group(1): m.group(2) for line in lines for m in _SPILL_STORE.finditer(line)}
    regions = _regions(path, lines, first, last, back_edge, predicates, lambda reg: _origin(reg, scalars, spills))
    return Schedule(path, total, first, last, trips, regions, capacity, usage)


def _installed_libtpu() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _total_bundles(path: Path) -> int:
    found = re.findall(r"^\s*total scheduled bundles:\s*(\d+)\s*$", path.read_text(), re.MULTILINE)
    if len(found) != 1:
        raise DumpFormatError(path, "expected one line 'total scheduled bundles: N'")
    return int(found[0])


def _bundle_lines(path: Path, total: int) -> list[str]:
    """Each bundle's text (a bundle's DMA descriptors continue over further lines)."""
    text = path.read_text()
    if not text.startswith("= control target key start"):
        raise DumpFormatError(path, "expected it to start with '= control target key start'")
    bundles: list[str] = []
    for line in text.split("= control target key end", 1)[-1].splitlines():
        match = _BUNDLE.match(line)
        if match:
            if int(match.group(1), 16 if match.group(1).startswith("0x") else 10) != len(bundles):
                raise DumpFormatError(path, f"bundle {match.group(1)} out of order (expected {hex(len(bundles))})")
            bundles.append(line)
        elif bundles:
            bundles[-1] += "\n" + line
    if len(bundles) != total:
        raise DumpFormatError(path, f"{len(bundles)} bundles, but the schedule analysis says {total}")
    return bundles


def _utilization(path: Path, total: int) -> tuple[dict[str, int], tuple[tuple[int, ...], ...]]:
    lines = path.read_text().splitlines()
    header = [cell.strip() for cell in lines[1].split("|")] if len(lines) > 4 else []
    if lines[:1] != ["== CAPACTIY:"] or header != list(UNITS) or lines[3:4] != ["== UTILIZATION:"]:
        raise DumpFormatError(path, f"expected '== CAPACTIY:', the units {'|'.join(UNITS)}, their capacities "
                                    f"and '== UTILIZATION:'")
    rows = [line.split() for line in [lines[2], *lines[4:]] if line.strip()]
    if len(rows) != total + 1 or any(len(row) != len(UNITS) or not all(c.isdecimal() for c in row) for row in rows):
        raise DumpFormatError(path, f"expected {total} rows of {len(UNITS)} slot counts (one per bundle)")
    return dict(zip(UNITS, map(int, rows[0]))), tuple(tuple(map(int, row)) for row in rows[1:])


def _back_edge(path: Path, lines: list[str], predicates: dict[str, str]) -> tuple[int, int]:
    """(index of the branch that closes the loop, the loop's trip count): the one branch taken
    unless its predicate, the '/* loop exit test */' compare, holds."""
    back = [(i, int(exit_test.group(1))) for i, line in enumerate(lines) for m in _BRANCH.finditer(line)
            if m.group(1) == "!" and (exit_test := _LOOP_EXIT.match(predicates.get(m.group(2), "")))]
    if len(back) != 1:
        raise DumpFormatError(path, f"expected one branch 'sbr.rel (!%p)' on a '/* loop exit test */' compare "
                                    f"closing the loop, found {len(back)}")
    return back[0]


def _body_end(lines: list[str], back_edge: int) -> int:
    """The last bundle of the loop: the back edge's delay slots are the bundles after it up to the
    last one marked ``>`` before the first non-empty bundle outside the loop."""
    last = back_edge
    for i in range(back_edge + 1, len(lines)):
        match = _BUNDLE.match(lines[i])
        if match.group(3) == ">":
            last = i
        elif not re.search(r"\{\s*\}", lines[i]):
            break
    return last


def _origin(register: str, scalars: dict[str, str], spills: dict[str, str]) -> str:
    """What computed scalar ``register``, through copies and spills to SMEM and back."""
    for _ in range(len(scalars)):
        definition = scalars.get(register, "")
        copy = re.match(r"^smov (%s\d+_s\d+)$", definition)
        reload = re.match(r"^sld \[smem:\[(#allocation\d+_spill)\]\]$", definition)
        if copy:
            register = copy.group(1)
        elif reload and reload.group(1) in spills:
            register = spills[reload.group(1)]
        else:
            return definition
    return ""


def _regions(path: Path, lines: list[str], first: int, last: int, back_edge: int,
             predicates: dict[str, str], origin) -> tuple[Region, ...]:
    """Predicated regions of the body: each forward branch opens one, the next ``PF:`` closes the innermost."""
    open_regions: list[tuple[int, bool, str]] = []  # (first bundle, once per row, branch target)
    regions = []
    for i in range(first, last + 1):
        marker = _BUNDLE.match(lines[i]).group(2)
        if marker == "PF":
            if not open_regions:
                raise DumpFormatError(path, f"bundle {hex(i)}: 'PF:' without a branch before it")
            target = open_regions[-1][2]
            while open_regions and open_regions[-1][2] == target:  # branches to one place share its PF
                start, once, _ = open_regions.pop()
                regions.append(Region(start, i - 1, once))
        elif marker not in (None, "LB"):
            raise DumpFormatError(path, f"bundle {hex(i)}: marker '{marker}:' inside a Mosaic kernel's loop body")
        for match in _BRANCH.finditer(lines[i]):
            if i != back_edge:
                negated, predicate = match.group(1), match.group(2)
                compare = _EQUALS_CONSTANT[negated].match(predicates.get(predicate, ""))
                # A flag (scalar_select of a predicate, 1 or 0; v6e gates the pipeline's steps so) is no grid index.
                once = bool(compare) and not origin(compare.group(1)).startswith("scalar_select ")
                open_regions.append((i + 1, once, match.group(3)))
    if open_regions:
        raise DumpFormatError(path, f"{len(open_regions)} predicated region(s) without 'PF:' before the loop ends")
    return tuple(sorted(regions, key=lambda r: (r.first, -r.last)))
