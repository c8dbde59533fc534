"""Per-phase CPU profile of the Numba engine, sampled by Linux ``perf``.

perf sees the JIT-compiled kernels as anonymous memory and names such code only from
``/tmp/perf-<pid>.map``. Numba loads cached kernels as ELF object code into one MCJIT
engine, so the map is built from that object code:

- in the process to profile, ``capture_objects`` (called before the engine is imported)
  keeps each library's object bytes as Numba loads or compiles it; after one replay has
  loaded everything, ``write_perf_map`` lists each object's code symbols (``nm``) at the
  address the engine placed them;
- in the parent, ``sample`` attaches ``perf record`` to that process while it replays and
  returns perf's self samples per symbol; ``phase_of`` and ``phase_table`` group them into
  the engine's phases (by module) and ``top_functions`` names the hottest.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

PERF_HZ = 4000  # samples per second of CPU time
ATTACH_S = 1.0  # perf record -p needs a moment to attach before the sampled section starts

# Phases by the module of the demangled symbol, first match wins (names are prefixes).
MODULE_PHASES = (
    ("boundary events", ("policies::engine::events::",)),
    ("batch formation and admission",
     ("policies::engine::formation::", "policies::engine::admission::", "policies::engine::batch::",
      "policies::engine::preemption::", "policies::queues::", "policies::fairness::")),
    ("step timing", ("costmodels::steptable::",)),
    ("step end", ("policies::engine::step_end::", "policies::engine::pipeline::", "policies::engine::state::")),
    ("fast-forward", ("policies::engine::fast_forward::",)),
    ("prefix cache", ("policies::prefix_cache::",)),
    ("the loop", ("policies::engine::replica::", "policies::engine::run::")),
)
MEMORY = "allocation, refcounts, page faults, memset"
OTHER_ENGINE = "other engine code"
OTHER = "Python and other"
PHASES = (*(name for name, _ in MODULE_PHASES), MEMORY, OTHER_ENGINE, OTHER)
LIBC_MEMORY = re.compile(r"mem(set|cpy|move)|malloc|calloc|realloc|free|unlink_chunk")
KERNEL_MEMORY = re.compile(r"page|fault|folio|memcg|lruvec|pte|pmd|mm|alloc|free|unmap|charge|lru")


class Sample(NamedTuple):
    """perf's self samples of one symbol in one shared object (``[JIT] tid N`` for kernels)."""
    dso: str
    symbol: str
    samples: int


def missing_tools() -> str | None:
    """Why a profile cannot run here (a missing tool), or None."""
    missing = [tool for tool in ("perf", "nm", "c++filt") if shutil.which(tool) is None]
    return f"{', '.join(missing)} not on PATH" if missing else None


def capture_objects() -> list[tuple[str, bytes]]:
    """From now on keep (library name, object code) of every Numba library loaded from cache or
    compiled (e.g. the runtime's refcount functions). Call before importing jitted code."""
    import numba.core.codegen as codegen

    objects: list[tuple[str, bytes]] = []
    set_compiled = codegen.CodeLibrary._set_compiled_object
    compiled_hook = codegen.CPUCodeLibrary._object_compiled_hook  # bound to the class

    def keep_cached(self, value):
        objects.append((self.name, value))
        return set_compiled(self, value)

    def keep_compiled(cls, ll_module, buf):
        library = getattr(ll_module, "_CPUCodeLibrary__library", None)  # set by Numba on finalizing
        if library is not None:
            objects.append((library.name, buf))
        return compiled_hook(ll_module, buf)

    codegen.CodeLibrary._set_compiled_object = keep_cached
    codegen.CPUCodeLibrary._object_compiled_hook = classmethod(keep_compiled)
    return objects


def code_symbols(obj: bytes) -> list[tuple[int, int, str, str]]:
    """(offset, size, mangled name, nm kind) of the code symbols of an object file. Numba emits
    all code in one section (.ltext), so one offset per object places every symbol."""
    with tempfile.NamedTemporaryFile(suffix=".o") as f:
        f.write(obj)
        f.flush()
        out = subprocess.run(["nm", "-S", "--defined-only", f.name], capture_output=True, text=True,
                             check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in ("T", "t", "W"):
            rows.append((int(parts[0], 16), int(parts[1], 16), parts[3], parts[2]))
    return rows


def demangle(names: list[str]) -> list[str]:
    """C++-demangled names without Numba's ``[abi:...]`` tags and argument types."""
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return [name.split("[abi:")[0] for name in out]


def write_perf_map(objects: list[tuple[str, bytes]], pid: int) -> int:
    """Write ``/tmp/perf-<pid>.map`` for the captured objects loaded in this process's Numba
    engine; returns the number of symbols mapped."""
    from numba.core.registry import cpu_target

    engine = cpu_target.target_context.codegen()._engine  # one engine holds every library
    entries: dict[int, tuple[int, str]] = {}  # address -> (size, mangled name)
    for _, obj in objects:
        symbols = code_symbols(obj)
        base = None
        for offset, _, name, kind in symbols:
            if kind == "T":
                try:
                    address = engine.get_function_address(name)
                except Exception:  # not (or no longer) in the engine
                    address = 0
                if address:
                    base = address - offset
                    break
        if base is None:
            continue
        for offset, size, name, _ in symbols:
            if size:
                entries[base + offset] = (size, name)  # linked-in copies of a helper keep their own address
    addresses = sorted(entries)
    names = demangle([entries[a][1] for a in addresses])
    Path(f"/tmp/perf-{pid}.map").write_text("".join(f"{a:x} {entries[a][0]:x} {n}\n"
                                                    for a, n in zip(addresses, names, strict=True)))
    return len(addresses)


def sample(command: list[str]) -> tuple[list[Sample], str]:
    """Run ``command``, sample it with ``perf record``, and return the self samples of its main
    thread and the line it printed at the end.

    Handshake: the command writes its perf map, prints one line, waits for a line on stdin, then
    runs the section to sample, prints one line and exits; the samples cover that section.
    """
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    map_path = Path(f"/tmp/perf-{child.pid}.map")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        try:
            if not child.stdout.readline():  # the map is written once it prints
                sys.exit(f"profiled child failed: {' '.join(command)}")
            perf_map = map_path.read_text()
            perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(PERF_HZ), "-p",
                                     str(child.pid), "-o", str(data)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            time.sleep(ATTACH_S)
            child.stdin.write("go\n")
            child.stdin.flush()
            last = child.stdout.read().strip()
            if child.wait() or not last:
                sys.exit(f"profiled child failed: {' '.join(command)}")
            _, err = perf.communicate(timeout=60)  # perf record -p ends with its target
            if perf.returncode:
                sys.exit(f"perf record failed: {err.strip()}")
            map_path.write_text(perf_map)  # again: other profiling on the machine may clear /tmp/perf-*.map
            report = subprocess.run(["perf", "report", "-i", str(data), "--tid", str(child.pid), "--no-children",
                                     "--sort", "dso,sym", "--stdio", "-g", "none", "-n", "-t", "\t"],
                                    capture_output=True, text=True, check=True).stdout
        finally:
            map_path.unlink(missing_ok=True)
    return parse_report(report), last


def parse_report(report: str) -> list[Sample]:
    """Rows of ``perf report -n -t '\\t' --sort dso,sym``: overhead, samples, dso, ``[.] symbol``."""
    rows = []
    for line in report.splitlines():
        parts = line.split("\t")
        if line.startswith("#") or len(parts) != 4:
            continue
        rows.append(Sample(parts[2].strip(), parts[3].strip()[4:], int(parts[1])))
    return rows


def phase_of(dso: str, symbol: str) -> str:
    """The engine phase a sampled symbol belongs to."""
    name = symbol.removeprefix("cpython::")  # Numba's Python-entry wrappers
    if dso.startswith("libm") and "log" in name:  # the step-time table interpolates in log space
        return "step timing"
    if (name.startswith("NRT_") or (dso.startswith("libc") and LIBC_MEMORY.search(name))
            or (dso == "[kernel.kallsyms]" and KERNEL_MEMORY.search(name))):
        return MEMORY  # Numba's runtime, libc, the kernel's page faults on fresh buffers
    for phase, prefixes in MODULE_PHASES:
        if name.startswith(prefixes):
            return phase
    if name.startswith(("policies::", "costmodels::", "numba::")):
        return OTHER_ENGINE
    return OTHER


def phase_table(samples: list[Sample]) -> dict[str, float]:
    """Each phase's share of all samples (shares add to 1)."""
    per_phase = Counter()
    for s in samples:
        per_phase[phase_of(s.dso, s.symbol)] += s.samples
    total = sum(per_phase.values()) or 1
    return {phase: per_phase[phase] / total for phase in PHASES}


def unnamed_jit_share(samples: list[Sample]) -> float:
    """Share of samples in JIT code the map did not name (a check on the map)."""
    total = sum(s.samples for s in samples) or 1
    return sum(s.samples for s in samples if s.dso.startswith("[JIT]") and s.symbol.startswith("0x")) / total


def top_functions(samples: list[Sample], n: int) -> list[tuple[float, str]]:
    """The n symbols with the most self samples: (share of all samples, name)."""
    total = sum(s.samples for s in samples) or 1
    per_symbol = Counter()
    for s in samples:
        per_symbol[s.symbol] += s.samples  # a helper's linked-in copies count as one function
    return [(count / total, name) for name, count in per_symbol.most_common(n)]
