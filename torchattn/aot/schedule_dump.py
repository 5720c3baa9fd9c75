"""Reading one Mosaic kernel's final VLIW schedule from libtpu 0.0.21's or 0.0.52's ``--xla_jf_dump_to`` files.

A compile writes, per kernel, ``<id>-<name>-NN-<pass>.txt`` files; three are read here:

- ``*-schedule-analysis_final_bundles.txt``: "total scheduled bundles: N";
- ``*-final_bundles.txt``: one VLIW bundle per line (``0x17 LB: > { ... }``) with the markers
  ``LB:`` (the first bundle of a loop body) and ``PF:`` (where a predicated region's skip lands),
  and ``sbr.rel (%p) target ...`` branches (a forward one skips a predicated region:
  ``pl.when``, up to the next ``PF:``, which also ends the enclosing regions whose skips land there;
  the one on the ``/* loop exit test */`` closes the loop). ``>`` marks a non-empty bundle
  inside the loop. A region's first bundles are its branch's delay slots, counted with it;
- ``*-final_hlo-static-per-bundle-utilization.txt``: the slots each unit has and uses per bundle.

The two versions differ in a branch's target (0.0.21: ``bundleno = 300 (0x12c), region = 48``, a number
that is not the bundle's index but one for all the skips landing at one ``PF:``; 0.0.52: ``$region48``, one
per branch, each named where it lands: ``PF: ... /* Start/End empty region 48 */``), in how they write a
copy, and in the utilization file's units (0.0.52 splits them finer: :data:`_FORMATS` says which of its
columns each of :data:`UNITS` is). The utilization file's header tells which version wrote a kernel's files.

A ``pallas_call``'s grid is one loop, its body one grid step (the pipeline adds two iterations
that only move blocks). A region entered only when a grid index equals a constant
(``pl.when(j == 0)``, ``pl.when(j == last)``: its skip predicate is ``scmp.ne <index>, <constant>``)
runs once per row of tiles; every other region (e.g. the mask's tile skipping) counts as
every-step work. Anything that does not look as the version of the kernel's utilization file writes it
raises :class:`DumpFormatError`.

A loop inside the program's loop (an XLA fusion's: 0.0.52 zeroes an accumulator so; a Mosaic kernel has
none, :mod:`.schedule` refuses one that has) is marked ``>>``, and its back edge targets a region its ``LB:``
bundle names (``Start region N``). 0.0.52 writes no trip count for it: it is read from the exit compare on
an induction variable, whose start and bound must evaluate to constants (:func:`_inner_loops`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from pathlib import Path

UNITS = ("MXU", "XLU", "VALU", "EUP", "LOAD", "STORE", "SALU")  # a Schedule's units, in the order of its usage


@dataclasses.dataclass(frozen=True)
class _Format:
    """What differs between the libtpu versions whose files are read."""

    libtpu: str
    separator: str  # between the names of the utilization file's columns
    columns: tuple[str, ...]  # their names, in order
    units: tuple[str, ...]  # the column each of UNITS is read from
    branch: re.Pattern  # an sbr.rel: (negated, its predicate, its target)
    landing: re.Pattern | None  # the targets a 'PF:' names as landing there (None: those equal to the innermost's)
    loop_start: re.Pattern | None  # the back-edge targets an 'LB:' names (None: loops inside a loop are not read)
    parts: tuple[tuple[str, str], ...] = ()  # (a column, the column whose slots it counts a part of)


_FORMATS = (
    _Format("0.0.21", "|", UNITS, UNITS,
            re.compile(r"sbr\.rel \((!?)(%p\d+_p\d+)\) target bundleno = (\d+) \(0x[0-9a-f]+\), region = \d+"),
            None, None),
    # Read from the same v5e kernel under both (schedules one bundle apart): 0.0.21's MXU column is 0.0.52's
    # MATMUL bundle for bundle, its LOAD VLOAD and its STORE VSTORE. MATPUSH (weight pushes, counted nowhere by
    # 0.0.21) is other slots: with MATMUL it exceeds the MXUs in most bundles that push. VLOAD:FILL and
    # VSTORE:SPILL are the spill part of VLOAD and VSTORE (never above them, and with them above the slots):
    # adding them would count a spill twice. VPOP (results popped off the MXUs, counted nowhere by 0.0.21) is
    # not read either.
    _Format("0.0.52", ",", ("MATMUL", "MATPUSH", "XLU", "VALU", "VPOP", "EUP", "VLOAD", "VLOAD:FILL", "VSTORE",
                            "VSTORE:SPILL", "SALU"),
            ("MATMUL", "XLU", "VALU", "EUP", "VLOAD", "VSTORE", "SALU"),
            re.compile(r"sbr\.rel \((!?)(%p\d+_p\d+)\) target = \$region(\d+)"),
            re.compile(r"Start/End empty region (\d+)\b"), re.compile(r"\bStart region (\d+)\b"),
            parts=(("VLOAD:FILL", "VLOAD"), ("VSTORE:SPILL", "VSTORE"))),
)

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|0)\s+(LH|LB|LE|PB|PF|CT)?:\s*(>*)\s*\{")  # '>' per enclosing loop
_PREDICATE = re.compile(r"(%p\d+_p\d+) = ([^;}]*)")
_EQUALS_CONSTANT = {"": re.compile(r"^scmp\.ne\.s32\.totalorder (%s\d+_s\d+), -?\d+$"),  # skip unless == C
                    "!": re.compile(r"^scmp\.eq\.s32\.totalorder (%s\d+_s\d+), -?\d+$")}
_SCALAR = re.compile(r"(%s\d+_s\d+) = ([^;}]*)")
_SPILL_STORE = re.compile(r"= sst \[smem:\[(#allocation\d+_spill)\]\] (%s\d+_s\d+)")
_LOOP_EXIT = re.compile(r"^scmp\.ge\.s32\.totalorder %s\w+, (\d+) /\* loop exit test \*/$")
# A loop whose trip count is data (a Pallas grid sized at run time, as Tokamax's splash sizes its grid by the
# visible blocks): its closing compare is against a register, with no "loop exit test" note.
_DYNAMIC_LOOP_EXIT = re.compile(r"^scmp\.ge\.s32\.totalorder %s\w+, %s\w+$")
# An inner loop's exit compare, the induction variable's step and phi, and the scalar arithmetic its start and
# bound may be computed with (an operand: a register, a constant or a VMEM address).
_INDUCTION_EXIT = re.compile(r"^scmp\.(gt|ge)\.s32\.totalorder (%s\d+_s\d+), (%s\d+_s\d+)$")
_STEP = re.compile(r"^sadd\.s32 (?:(\d+), (%s\d+_s\d+)|(%s\d+_s\d+), (\d+))$")
_PHI = re.compile(r"^sphi (%s\d+_s\d+), (%s\d+_s\d+)$")
_COPY = re.compile(r"^smov\.u32 (%s\d+_s\d+)$")
_OPERAND = r"%s\d+_s\d+|-?\d+|\[#allocation\d+(?: \+ \$0x[0-9a-f]+)?\]"
_ARITHMETIC = re.compile(rf"^(smov\.u32|sadd\.s32|ssub\.s32)(?: \((!?%p\d+_p\d+)\),)? ({_OPERAND})(?:, ({_OPERAND}))?$")
_ADDRESS = re.compile(r"^\[(#allocation\d+)(?: \+ \$(0x[0-9a-f]+))?\]$")


class DumpFormatError(ValueError):
    """A dump file is not what libtpu 0.0.21 or 0.0.52 writes: nothing is read from it."""

    def __init__(self, path: Path, what: str):
        versions = " and ".join(f"{f.libtpu}'s" for f in _FORMATS)
        super().__init__(f"{path}: {what} (installed libtpu {_installed_libtpu()}; this reader knows the formats "
                         f"of libtpu {versions} --xla_jf_dump_to files)")


@dataclasses.dataclass(frozen=True)
class Region:
    """A predicated region of the loop body: bundles [first, last] (indices into the program)."""

    first: int
    last: int
    once_per_row: bool
    when: str  # what holds whenever it runs: its skip's predicate ('%p1_p2') or its negation ('!%p1_p2')

    @property
    def bundles(self) -> int:
        return self.last - self.first + 1


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop inside the program's loop: bundles [first, last], closed by the branch at ``back_edge``, run
    ``trips`` times on each iteration of the program's loop that reaches it."""

    first: int
    last: int
    back_edge: int
    trips: int

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
    # iterations of the grid loop (grid steps + 2 for a pipelined pallas_call); 1 without a loop; None when the
    # count is data (a grid sized at run time)
    loop_trips: int | None
    regions: tuple[Region, ...]  # every predicated region in the body, outer before inner
    capacity: dict[str, int]  # slots per bundle of each unit
    usage: tuple[tuple[int, ...], ...]  # per bundle, slots used per unit (in UNITS order)
    inner_loops: tuple[Loop, ...] = ()  # loops inside the body, in program order (an XLA fusion's)

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

    def path_regions(self, with_once: bool = False) -> list[Region]:
        """The alternative paths of the every-step work, in program order (e.g. a tile's mask-free and masked
        work, each run on some of the steps): the outermost regions that are not once per row (``with_once``:
        those too), looking inside a region that is alone at its level (a guard every step takes, such as the
        pipeline's)."""
        level = self.children(None, with_once)
        while len(level) == 1 and self.children(level[0], with_once):
            level = self.children(level[0], with_once)
        return level

    def children(self, parent: Region | None, with_once: bool = False) -> list[Region]:
        """The regions directly inside ``parent`` (None: the body) that are not once per row (``with_once``:
        all of them)."""
        inside = [r for r in self.regions if parent is None
                  or (r != parent and parent.first <= r.first and r.last <= parent.last)]
        direct = [r for r in inside if not any(o is not r and o.first <= r.first and r.last <= o.last
                                               for o in inside)]
        return [r for r in direct if with_once or not r.once_per_row]

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
    dump_format, capacity, usage = _utilization(files["utilization"], total)
    path = files["bundles"]
    branch = dump_format.branch
    if sum(len(branch.findall(line)) for line in lines) != sum(line.count("sbr.") for line in lines):
        raise DumpFormatError(path, f"a branch ('sbr.') not written as libtpu {dump_format.libtpu}'s are (the "
                                    f"version its utilization file is of)")
    predicates = {m.group(1): m.group(2).strip() for line in lines for m in _PREDICATE.finditer(line)}
    starts = [i for i, line in enumerate(lines) if _BUNDLE.match(line).group(2) == "LB"]
    if not starts:
        return Schedule(path, total, 0, total - 1, 1, (), capacity, usage)
    first = starts[0]
    back_edge, trips = _back_edge(path, lines, predicates, branch)
    if back_edge < first:
        raise DumpFormatError(path, f"the loop's closing branch (bundle {hex(back_edge)}) comes before its 'LB:' "
                                    f"bundle {hex(first)}")
    last = _body_end(lines, back_edge)
    spans = _loop_spans(path, lines, first, last, starts[1:], dump_format)
    scalars = {m.group(1): m.group(2).strip() for line in lines for m in _SCALAR.finditer(line)}
    spills = {m.group(1): m.group(2) for line in lines for m in _SPILL_STORE.finditer(line)}
    regions = _regions(path, lines, first, last, {back_edge, *(span[1] for span in spans)}, dump_format,
                       predicates, lambda reg: _origin(reg, scalars, spills))
    inner = _inner_loops(path, lines, spans, regions, predicates)
    return Schedule(path, total, first, last, trips, regions, capacity, usage, inner)


def _installed_libtpu() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _total_bundles(path: Path) -> int:
    text = path.read_text()
    if not text.strip():  # a program with nothing to schedule (lax.empty's) writes an empty analysis
        return 0
    found = re.findall(r"^\s*total scheduled bundles:\s*(\d+)\s*$", text, re.MULTILINE)
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


def _utilization(path: Path, total: int) -> tuple[_Format, dict[str, int], tuple[tuple[int, ...], ...]]:
    """(the format of the libtpu that wrote it, each unit's slots, per bundle the slots used of each unit)."""
    lines = path.read_text().splitlines()
    header = lines[1] if len(lines) > 4 else ""
    formats = [f for f in _FORMATS if [cell.strip() for cell in header.split(f.separator)] == list(f.columns)]
    if lines[:1] != ["== CAPACTIY:"] or not formats or lines[3:4] != ["== UTILIZATION:"]:
        known = " or ".join(f"{f.libtpu}'s {f.separator.join(f.columns)}" for f in _FORMATS)
        raise DumpFormatError(path, f"expected '== CAPACTIY:', the units (libtpu {known}), their capacities "
                                    f"and '== UTILIZATION:'")
    [dump_format] = formats
    width = len(dump_format.columns)
    rows = [line.split() for line in [lines[2], *lines[4:]] if line.strip()]
    if len(rows) != total + 1 or any(len(row) != width or not all(c.isdecimal() for c in row) for row in rows):
        raise DumpFormatError(path, f"expected {total} rows of {width} slot counts (one per bundle)")
    column = {name: i for i, name in enumerate(dump_format.columns)}
    for part, whole in dump_format.parts:  # what the columns were read as
        if any(int(row[column[part]]) > int(row[column[whole]]) for row in rows[1:]):
            raise DumpFormatError(path, f"a bundle uses more {part} slots than {whole} slots, of which they were "
                                        f"read as a part")
    picked = [tuple(int(row[column[name]]) for name in dump_format.units) for row in rows]
    return dump_format, dict(zip(UNITS, picked[0])), tuple(picked[1:])


def _back_edge(path: Path, lines: list[str], predicates: dict[str, str], branch: re.Pattern) -> tuple[int, int | None]:
    """(index of the branch that closes the loop, the loop's trip count): the one branch taken
    unless its predicate, the '/* loop exit test */' compare, holds. Without one, a loop whose trip count is
    data: the last branch of the program, negated, on a compare of two registers (trip count None)."""
    back = [(i, int(exit_test.group(1))) for i, line in enumerate(lines) for m in branch.finditer(line)
            if m.group(1) == "!" and (exit_test := _LOOP_EXIT.match(predicates.get(m.group(2), "")))]
    if not back:
        branches = [(i, m) for i, line in enumerate(lines) for m in branch.finditer(line)]
        if branches and branches[-1][1].group(1) == "!" and _DYNAMIC_LOOP_EXIT.match(
                predicates.get(branches[-1][1].group(2), "")):
            return branches[-1][0], None
    if len(back) != 1:
        raise DumpFormatError(path, f"expected one branch 'sbr.rel (!%p)' on a '/* loop exit test */' compare "
                                    f"closing the loop (or, for a loop whose trip count is data, the last branch on "
                                    f"a compare of two registers), found {len(back)}")
    return back[0]


def _body_end(lines: list[str], back_edge: int, depth: int = 1) -> int:
    """The last bundle of the loop (``depth`` loops deep): the back edge's delay slots are the bundles after it
    up to the last one marked as deep before the first non-empty bundle outside the loop."""
    last = back_edge
    for i in range(back_edge + 1, len(lines)):
        if _depth(lines[i]) >= depth:
            last = i
        elif not re.search(r"\{\s*\}", lines[i]):
            break
    return last


def _depth(line: str) -> int:
    """How many loops a bundle is inside (its '>' marks)."""
    return len(_BUNDLE.match(line).group(3))


def _loop_spans(path: Path, lines: list[str], first: int, last: int, starts: list[int],
                dump_format: _Format) -> list[tuple[int, int, int, re.Match]]:
    """(first bundle, back edge, last bundle, the back edge's branch) of each loop inside the program's loop
    [first, last]: marked '>>', closed by the one branch to a region its 'LB:' bundle starts."""
    spans = []
    for start in starts:
        if dump_format.loop_start is None:
            raise DumpFormatError(path, f"bundle {hex(start)}: a second loop ('LB:'); loops inside a loop are "
                                        f"read only from libtpu 0.0.52's files, whose branches name their target")
        if not first < start <= last or _depth(lines[start]) != 2:
            raise DumpFormatError(path, f"bundle {hex(start)}: a loop ('LB:') that is not directly inside the "
                                        f"program's loop (not marked '>>' inside it): not read")
        named = set(dump_format.loop_start.findall(lines[start]))
        back = [(i, m) for i in range(first, last + 1) for m in dump_format.branch.finditer(lines[i])
                if m.group(3) in named]
        if len(back) != 1 or back[0][0] < start:
            raise DumpFormatError(path, f"the loop at bundle {hex(start)}: expected one branch after it back to a "
                                        f"region it starts, found {len(back)}")
        back_edge, branch = back[0]
        if any(_depth(lines[i]) < 2 for i in range(start, back_edge)):
            raise DumpFormatError(path, f"the loop at bundle {hex(start)}: a bundle before its closing branch "
                                        f"(bundle {hex(back_edge)}) is not marked '>>'")
        spans.append((start, back_edge, _body_end(lines, back_edge, 2), branch))
    return spans


def _inner_loops(path: Path, lines: list[str], spans: list[tuple[int, int, int, re.Match]],
                 regions: tuple[Region, ...], predicates: dict[str, str]) -> tuple[Loop, ...]:
    """The loops inside the program's loop, with their trips. 0.0.52 writes no trip count for them: the back
    edge is taken unless ``scmp.gt`` (or ``ge``) of ``next``, the induction variable plus a constant step, and
    a bound. The variable's start and the bound must be computed before the loop, from constants, differences
    of addresses in one allocation (a buffer's size) and an earlier inner loop's final ``next``, each by an
    instruction that runs whenever the loop does (unpredicated, or under a predicate its regions run under)."""
    definitions: dict[str, list[tuple[int, str]]] = {}  # register -> [(bundle, its definition, no comments)]
    for i, line in enumerate(lines):
        for match in _SCALAR.finditer(line):
            definitions.setdefault(match.group(1), []).append((i, re.sub(r"\s*/\*.*?\*/", "", match.group(2))))
    exits: dict[str, tuple[int, set[str]]] = {}  # an earlier loop's next -> (its value after the loop, guards)
    loops = []
    for start, back_edge, last, branch in spans:
        loop = f"the loop at bundle {hex(start)}"
        guards = {region.when for region in regions if region.first <= start <= region.last}

        def defined(register: str, inside: bool) -> str:
            found = definitions.get(register, [])
            if len(found) != 1 or not (start <= found[0][0] <= last if inside else found[0][0] < start):
                raise DumpFormatError(path, f"{loop}: {register} is not defined once {'in' if inside else 'before'} "
                                            f"the loop")
            return found[0][1].strip()

        def value(register: str):  # an int, or an address (allocation, offset)
            if register in exits and exits[register][1] <= guards:  # that loop ran whenever this one runs
                return exits[register][0]
            text = defined(register, inside=False)
            match = _ARITHMETIC.match(text)
            inside_a_loop = any(span[0] <= definitions[register][0][0] <= span[2] for span in spans)
            if not match or inside_a_loop or (match.group(2) and match.group(2) not in guards):
                raise DumpFormatError(path, f"{loop}: its trip count depends on {register} = {text!r}, which is "
                                            f"not read as a constant")
            result = _arithmetic(match.group(1), [operand(o) for o in match.group(3, 4) if o is not None])
            if result is None:
                raise DumpFormatError(path, f"{loop}: {register} = {text!r} is not read as a constant")
            return result

        def operand(text: str):
            address = _ADDRESS.match(text)
            if address:
                return address.group(1), int(address.group(2) or "0", 16)
            return value(text) if text.startswith("%s") else _s32(int(text))

        compare = _INDUCTION_EXIT.match(predicates.get(branch.group(2), ""))
        if branch.group(1) != "!" or not compare:
            raise DumpFormatError(path, f"{loop}: its closing branch is not taken unless 'scmp.gt' or 'scmp.ge' "
                                        f"of its induction variable plus a step and a bound: "
                                        f"{branch.group(2)} = {predicates.get(branch.group(2))!r}")
        kind, following, bound = compare.groups()
        step = _STEP.match(defined(following, inside=True))
        if not step:
            raise DumpFormatError(path, f"{loop}: {following} is not its induction variable plus a constant step")
        increment, variable = _s32(int(step.group(1) or step.group(4))), step.group(2) or step.group(3)
        phi = _PHI.match(defined(variable, inside=True))
        back = phi.group(2) if phi else None  # the value the phi takes on the back edge: next, through copies
        for _ in range(len(definitions)):
            copy = back and back != following and _COPY.match(defined(back, inside=True))
            if not copy:
                break
            back = copy.group(1)
        initial, limit = (value(phi.group(1)), value(bound)) if back == following else (None, None)
        if not (isinstance(initial, int) and isinstance(limit, int) and increment > 0):
            raise DumpFormatError(path, f"{loop}: its induction variable {variable} does not start at a constant "
                                        f"and step up by a constant to {following}, tested against a constant")
        # The body runs before the test: trips is the first n >= 1 with initial + n * step past the bound.
        trips = max(1, (limit - initial) // increment + 1 if kind == "gt" else -((initial - limit) // increment))
        exits[following] = (_s32(initial + trips * increment), guards)
        loops.append(Loop(start, last, back_edge, trips))
    return tuple(loops)


def _arithmetic(op: str, operands: list):
    """smov/sadd/ssub of ints and addresses (allocation, offset); None when it is not a constant or an address
    (an address minus one in the same allocation is a constant)."""
    if op == "smov.u32":
        return operands[0] if len(operands) == 1 else None
    if len(operands) != 2:
        return None
    (a, b), sign = operands, 1 if op == "sadd.s32" else -1
    if isinstance(a, int) and isinstance(b, tuple) and sign == 1:
        a, b = b, a
    if isinstance(b, int):
        return _s32(a + sign * b) if isinstance(a, int) else (a[0], a[1] + sign * b)
    return _s32(a[1] - b[1]) if sign == -1 and isinstance(a, tuple) and a[0] == b[0] else None


def _s32(number: int) -> int:
    """A scalar register's 32 bits as a signed int (0.0.52 writes -56 as 4294967240)."""
    return (number + 2 ** 31) % 2 ** 32 - 2 ** 31


def _origin(register: str, scalars: dict[str, str], spills: dict[str, str]) -> str:
    """What computed scalar ``register``, through copies and spills to SMEM and back."""
    for _ in range(len(scalars)):
        definition = scalars.get(register, "")
        # 0.0.52 writes a copy as smov.u32 and may comment a copy or reload ("/* copy for cssa */").
        copy = re.match(r"^smov(?:\.u32)? (%s\d+_s\d+)(?: /\*[^*]*\*/)?$", definition)
        reload = re.match(r"^sld \[smem:\[(#allocation\d+_spill)\]\](?: /\*[^*]*\*/)?$", definition)
        if copy:
            register = copy.group(1)
        elif reload and reload.group(1) in spills:
            register = spills[reload.group(1)]
        else:
            return definition
    return ""


def _compared(compare: str) -> tuple[str, str]:
    """(register, constant) of an equality compare ``scmp.eq/ne.s32.totalorder %sX, C``."""
    register, constant = compare.rsplit(" ", 2)[-2:]
    return register.rstrip(","), constant


def _runs_unless(lines: list[str], first: int, last: int, back_edges: set[int], dump_format: _Format,
                 predicates: dict[str, str]):
    """(register, constant) of each region of bundles [first, last] that runs exactly when x != C: its branch
    skips it on ``x == C`` (or, negated, unless ``x != C``)."""
    skips_when = {"": "eq", "!": "ne"}  # the compare under which a region runs when x != C
    for i in range(first, last + 1):
        for match in dump_format.branch.finditer(lines[i]):
            compare = re.match(rf"^scmp\.{skips_when[match.group(1)]}\.s32\.totalorder (%s\d+_s\d+), (-?\d+)$",
                               predicates.get(match.group(2), ""))
            if i not in back_edges and compare:
                yield compare.group(1), compare.group(2)


def _regions(path: Path, lines: list[str], first: int, last: int, back_edges: set[int], dump_format: _Format,
             predicates: dict[str, str], origin) -> tuple[Region, ...]:
    """Predicated regions of the body: each forward branch (not one of the loops' ``back_edges``) opens one, the
    next ``PF:`` closes the innermost (and the enclosing ones whose skips land there too)."""
    open_regions: list[tuple[int, bool, str, str]] = []  # (first bundle, once per row, branch target, when)
    regions = []
    runs_unless = set(_runs_unless(lines, first, last, back_edges, dump_format, predicates))
    for i in range(first, last + 1):
        marker = _BUNDLE.match(lines[i]).group(2)
        if marker == "PF":
            if not open_regions:
                raise DumpFormatError(path, f"bundle {hex(i)}: 'PF:' without a branch before it")
            target = open_regions[-1][2]
            landing = set(dump_format.landing.findall(lines[i])) if dump_format.landing else {target}
            if target not in landing:
                raise DumpFormatError(path, f"bundle {hex(i)}: 'PF:' does not name the target of the innermost "
                                            f"region's branch ({target}) as landing there")
            while open_regions and open_regions[-1][2] in landing:
                start, once, _, when = open_regions.pop()
                regions.append(Region(start, i - 1, once, when))
        elif marker not in (None, "LB"):
            raise DumpFormatError(path, f"bundle {hex(i)}: marker '{marker}:' inside a Mosaic kernel's loop body")
        for match in dump_format.branch.finditer(lines[i]):
            if i not in back_edges:
                negated, predicate = match.group(1), match.group(2)
                compare = _EQUALS_CONSTANT[negated].match(predicates.get(predicate, ""))
                # A flag (scalar_select of a predicate, 1 or 0; v6e gates the pipeline's steps so) is no grid index.
                once = bool(compare) and not origin(compare.group(1)).startswith("scalar_select ")
                # A region beside one that runs exactly when it does not (x == C and x != C: a full and a masked
                # block's work, as Tokamax's splash chooses them) is one of two paths each step picks from.
                once = once and _compared(compare.group(0)) not in runs_unless
                # The branch skips the region when its predicate (negated: its negation) holds.
                open_regions.append((i + 1, once, match.group(3), predicate if negated else "!" + predicate))
    if open_regions:
        raise DumpFormatError(path, f"{len(open_regions)} predicated region(s) without 'PF:' before the loop ends")
    return tuple(sorted(regions, key=lambda r: (r.first, -r.last)))
