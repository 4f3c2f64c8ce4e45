"""What a kernel's PTX touches before `griddepcontrol.wait` (the PDL wait): the global loads
and stores issued before the wait, each with the kernel parameters its address derives from.

A PDL kernel may start while earlier kernels of the chain still run; before its wait it may
read only what no kernel of the step writes (weights, host-copied inputs) and write nothing
(`pagoda/kernels/pdl.py`). The check is a forward taint pass over the PTX text up to the wait:
`ld.param` gives a register its parameter; every instruction's destination (its first register
operand) takes the union of its sources' parameters, so address arithmetic, conversions and
moves carry them. Textual order is execution order up to the wait in these kernels (the wait is
in straight-line code; loops before it close before it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_REG = re.compile(r"%[a-z]+\d+")
_PARAM = re.compile(r"(\w+_param_(\d+))")


@dataclass(frozen=True)
class Access:
    kind: str  # "load" | "store" | "prefetch"
    line: str
    params: frozenset[int]  # parameter indices the address derives from


def pre_wait_accesses(ptx: str) -> list[Access]:
    """The global accesses before the kernel's (single) `griddepcontrol.wait`."""
    body = ptx.splitlines()
    waits = [i for i, line in enumerate(body) if "griddepcontrol.wait" in line]
    if len(waits) != 1:
        raise ValueError(f"expected one griddepcontrol.wait, found {len(waits)}")
    names = {m.group(1): int(m.group(2)) for m in _PARAM.finditer(ptx)}
    taint: dict[str, frozenset[int]] = {}
    out: list[Access] = []
    for raw in body[: waits[0]]:
        line = raw.split("//")[0].strip()
        if not line or line.endswith(":") or line.startswith("."):
            continue
        if line.startswith("@"):  # predicate guard
            line = line.split(None, 1)[1] if " " in line else ""
        if line.startswith("ld.param"):
            reg = _REG.search(line)
            name = re.search(r"\[\s*(\w+)", line)
            if reg and name and name.group(1) in names:
                taint[reg.group(0)] = frozenset({names[name.group(1)]})
            continue
        regs = _REG.findall(line)
        if not regs:
            continue
        opcode = line.split()[0]
        if opcode.startswith(("ld.global", "st.global", "cp.async.bulk.prefetch", "atom.global",
                              "red.global", "prefetch.global")):  # fmt: skip
            addr = re.search(r"\[\s*(%[a-z]+\d+)", line)
            params = taint.get(addr.group(1), frozenset()) if addr else frozenset()
            kind = "load" if opcode.startswith(("ld.", "prefetch")) else "store"
            if opcode.startswith("cp.async.bulk.prefetch"):
                kind = "prefetch"
            out.append(Access(kind, line, params))
            if opcode.startswith("ld."):
                for dst in _REG.findall(line.split("[")[0]):
                    taint[dst] = frozenset()  # loaded data carries no address taint
            continue
        if opcode.startswith(("st.", "bar", "setp", "@")):
            continue
        dst, srcs = regs[0], regs[1:]
        taint[dst] = frozenset().union(*(taint.get(s, frozenset()) for s in srcs))
    return out


def check_pre_wait(ptx: str, forbidden: set[int]) -> list[Access]:
    """The pre-wait accesses; raises AssertionError for a global store or an access whose
    address derives from a `forbidden` parameter (an activation another kernel writes)."""
    accesses = pre_wait_accesses(ptx)
    for a in accesses:
        assert a.kind != "store", f"global write before the PDL wait: {a.line}"
        bad = a.params & forbidden
        assert not bad, f"reads parameter(s) {sorted(bad)} before the PDL wait: {a.line}"
    return accesses
