"""Rebuild .fi/, the slim FlashInfer tree that benchmarks/flashinfer_peer.py imports on the GPU
machine (issue 34; carried there, 64 MiB at most, so not the 450 MB wheel), from three wheels:

    python -m pip download --no-deps flashinfer-python==0.7.2 apache-tvm-ffi==0.1.15.post2 ninja==1.13.2 \\
        --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --platform manylinux_2_17_x86_64 -d WHEELS   (ninja is a manylinux_2_17 wheel)
    python benchmarks/flashinfer_slim.py WHEELS [.fi]

flashinfer_slim.txt lists what is kept (about 45 MiB): the Python modules ``import flashinfer``
loads plus the function-level imports of the ragged prefill's call path; the data/ templates,
sources and headers of the fa3 and fa2 AttentionSink batch-prefill JIT modules (nvcc 13.0's own
dependency lists, host and device passes); tvm_ffi (cp312) without its sources, and only the
headers those modules include; ninja's binary as bin/ninja. The other packages FlashInfer imports
(requests, pynvml, numpy, jinja2, ...) are on the GPU machine's image.
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile

LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flashinfer_slim.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", help="folder with the three wheels")
    ap.add_argument("dest", nargs="?", default=".fi")
    args = ap.parse_args()
    want = set(open(LIST).read().split())
    got = set()
    for name in sorted(os.listdir(args.wheels)):
        if not name.endswith(".whl"):
            continue
        with zipfile.ZipFile(os.path.join(args.wheels, name)) as z:
            for info in z.infolist():
                rel = "bin/ninja" if info.filename.endswith(".data/scripts/ninja") else info.filename
                if rel not in want:
                    continue
                out = os.path.join(args.dest, rel)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(info) as src, open(out, "wb") as dst:
                    dst.write(src.read())
                if rel == "bin/ninja" or rel.endswith(".so"):
                    os.chmod(out, 0o755)
                got.add(rel)
    if want - got:
        sys.exit(f"flashinfer_slim: {len(want - got)} listed files not in the wheels of {args.wheels}, "
                 f"e.g. {sorted(want - got)[0]} (want flashinfer-python 0.7.2, apache-tvm-ffi 0.1.15.post2 cp312, ninja)")
    size = sum(os.path.getsize(os.path.join(args.dest, r)) for r in got)
    print(f"{args.dest}: {len(got)} files, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
