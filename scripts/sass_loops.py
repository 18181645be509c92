"""The hot loops of a compiled kernel's SASS: the innermost loops that issue warpgroup MMAs.

Disassembles a cubin with the cuobjdump Triton ships (no GPU needed) and reports, for each
innermost loop holding a warpgroup MMA (HGMMA; QGMMA for float8), its instruction count, its MMAs, its local-memory (spill)
traffic and its commonest opcodes: what the per-block cost of a K/V loop is made of.

    python scripts/sass_loops.py DUMP/v3.fwd_gluon_causal_d64.cubin   (compile_sm90.py --dump)
"""
import argparse
import collections
import pathlib
import re
import subprocess
import tempfile

import triton.backends.nvidia

CUOBJDUMP = pathlib.Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
MMA = ("HGMMA", "QGMMA")  # warpgroup MMA: 16-bit and float8 operands
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def sass(cubin: bytes):
    """[(address, instruction)] of the cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, text.splitlines()) if m]


def opcode(instruction):
    """The opcode without its modifiers or predicate: "@!P0 BRA 0x10" -> "BRA"."""
    words = instruction.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def hot_loops(instructions):
    """The innermost loops (a predicated backward branch and the instructions from its target)
    that issue a warpgroup MMA, each as its list of (address, instruction).  Unpredicated backward
    branches are not loops here: ptxas places mbarrier retry stubs after the kernel's end, and
    they jump back into it."""
    index = {address: i for i, (address, _) in enumerate(instructions)}
    spans = []
    for i, (address, text) in enumerate(instructions):
        branch = _BRANCH.search(text)
        if branch and opcode(text) == "BRA" and text.startswith("@"):
            target = int(branch.group(1), 16)
            if target < address and target in index:
                spans.append((index[target], i))
    spans = [s for s in spans if any(opcode(t) in MMA for _, t in instructions[s[0]:s[1] + 1])]
    innermost = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [instructions[a:b + 1] for a, b in sorted(set(innermost))]


def loop_stats(loop):
    """(instructions, warpgroup MMAs, local loads and stores, opcode counts) of one loop."""
    ops = collections.Counter(opcode(t) for _, t in loop)
    return len(loop), ops["HGMMA"] + ops["QGMMA"], ops["LDL"] + ops["STL"], ops


_REGISTER = re.compile(r"\bR(\d+)\b")


def longest_chain(loop, op):
    """The longest run of ``op`` instructions (FMNMX, FADD) in the loop each reading the previous
    one's result: a reduction's depth, as ptxas laid it out (a chain as long as its inputs, or a
    tree's log2 of them)."""
    depth, longest = {}, 0
    for _, text in loop:
        registers = _REGISTER.findall(text)
        if not registers:
            continue
        if opcode(text) == op:
            d = 1 + max((depth.get(r, 0) for r in registers[1:]), default=0)
            depth[registers[0]] = d
            longest = max(longest, d)
        else:
            depth.pop(registers[0], None)
    return longest


def describe(cubin: bytes, top=8):
    """One line per hot loop."""
    lines = []
    for loop in hot_loops(sass(cubin)):
        size, mma, spills, ops = loop_stats(loop)
        common = ", ".join(f"{op} {n}" for op, n in ops.most_common(top))
        lines.append(f"loop at {loop[0][0]:#x}: {size} instructions, {mma} MMA, {spills} spill loads/stores; {common}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cubins", nargs="+", type=pathlib.Path)
    args = ap.parse_args()
    for path in args.cubins:
        print(path.name)
        for line in describe(path.read_bytes()):
            print("  " + line)


if __name__ == "__main__":
    main()
