"""Whether two builds compiled the same machine code: each cubin of one ``compile_sm90.py --dump``
directory against the cubin of the same name in another, as SASS with addresses and hex
immediates left out (a kernel that moved in the file, or a constant buffer laid out anew, reads
the same).  A source change whose kernels come out the same carries over whatever the other
build was measured to do on the GPU.

    python scripts/sass_same.py DUMP_A DUMP_B
"""
import argparse
import pathlib
import re

from sass_loops import sass

_HEX = re.compile(r"0x[0-9a-f]+")


def normalized(cubin: pathlib.Path):
    return [_HEX.sub("X", text) for _, text in sass(cubin.read_bytes())]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=pathlib.Path)
    ap.add_argument("b", type=pathlib.Path)
    args = ap.parse_args()
    for cubin in sorted(args.a.rglob("*.cubin")):
        name = cubin.relative_to(args.a)
        other = args.b / name
        if not other.exists():
            print(f"{name}: only in {args.a}")
            continue
        mine, theirs = normalized(cubin), normalized(other)
        verdict = "same" if mine == theirs else f"different ({len(mine)} / {len(theirs)} instructions)"
        print(f"{name}: {verdict}")


if __name__ == "__main__":
    main()
