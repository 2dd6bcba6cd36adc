"""Convert throughput and peak memory, beside the disk's own bandwidth measured in the same run.

    python benchmarks/convert_bench.py SRC [--device cuda] [--work DIR] [--keep]

Prints: disk sequential write MB/s (dd-like, fsync'd) and a plain read+write copy of SRC's
weights; then the conversion's input MB/s, output MB/s, their ratio to the disk's write bandwidth,
and the converter's peak RSS (measured in a child process, so this script's own memory is out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 64 * 1024 * 1024


def disk_write_mb_s(path: Path, nbytes: int) -> float:
    buf = os.urandom(CHUNK)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // CHUNK):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return nbytes / dt / 1e6


def copy_mb_s(src: Path, dst: Path) -> tuple[float, int]:
    """Plain read + write (fsync'd) of every safetensors file of src: the I/O floor of a conversion."""
    dst.mkdir(parents=True, exist_ok=True)
    total = 0
    t = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb") as a, open(dst / f.name, "wb") as b:
            while chunk := a.read(CHUNK):
                b.write(chunk)
                total += len(chunk)
            b.flush()
            os.fsync(b.fileno())
    dt = time.perf_counter() - t
    shutil.rmtree(dst)
    return total / dt / 1e6, total


def drop_page_cache_hint(src: Path) -> None:
    # Not root-only tricks: just advise the kernel that SRC's pages are not needed, best effort.
    for f in src.glob("*.safetensors"):
        with open(f, "rb") as fh:
            try:
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            except (AttributeError, OSError):
                pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory on the disk to measure (default: next to SRC)")
    ap.add_argument("--keep", action="store_true", help="keep the converted checkpoint")
    a = ap.parse_args()
    work = a.work or a.src.parent
    out = work / "convert-bench-out"
    shutil.rmtree(out, ignore_errors=True)

    src_bytes = sum(f.stat().st_size for f in a.src.glob("*.safetensors"))
    write_bw = disk_write_mb_s(work / "ddtest.bin", 4 * 1024**3)
    print(f"disk sequential write: {write_bw:.0f} MB/s (4 GiB, fsync)")
    drop_page_cache_hint(a.src)
    copy_bw, _ = copy_mb_s(a.src, work / "copy-bench")
    print(f"plain read+write copy of the source weights ({src_bytes / 1e9:.2f} GB): {copy_bw:.0f} MB/s, "
          f"{src_bytes / copy_bw / 1e6:.1f} s")
    drop_page_cache_hint(a.src)

    cmd = [sys.executable, "-m", "gptoss_fp8.cli.main", "convert", str(a.src), str(out), "--device", a.device]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    dt = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    rep = json.loads((out / "conversion.json").read_text())["exactness"]["overall"]
    print(f"convert --device {a.device}: {dt:.1f} s; in {src_bytes / 1e9:.2f} GB at {src_bytes / dt / 1e6:.0f} MB/s, "
          f"out {out_bytes / 1e9:.2f} GB at {out_bytes / dt / 1e6:.0f} MB/s")
    print(f"ratio of output MB/s to disk write bandwidth: {out_bytes / dt / 1e6 / write_bw:.2f}x; "
          f"(in+out) MB/s: {(src_bytes + out_bytes) / dt / 1e6 / write_bw:.2f}x; "
          f"conversion time vs plain copy of the source: {dt / (src_bytes / copy_bw / 1e6):.2f}x")
    print(f"peak RSS of the converter: {rss / 1e9:.2f} GB")
    print(f"exactness: {100 * rep['exact_fraction']:.4f}% exact, max rel err {rep['max_rel_err']:.3g}")
    if not a.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
