"""Wall time and peak memory of the command line: ``finefreeze --help`` and ``finefreeze finetune``.

Each command runs in a fresh Python process (``python -m finefreeze ...``)
with this checkout's ``src`` first on the path, and, with ``--compare
OTHER_SRC``, the same commands from another copy of the sources (for example
a release unpacked with ``git archive``), interleaved round by round after one
warm-up run of each. Reported per command and variant: the median wall time
with the min-max spread over rounds, the median peak resident memory of the
process (``ru_maxrss``), and the ratio of the medians.

    python benchmarks/cli.py [--rounds 5] [--compare /path/to/other/src]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
COMMANDS = {
    "--help": ["--help"],
    "finetune -q": ["finetune", "-q", "--epochs", "4", "--out", "{out}"],
}


def run(src: str, argv: list[str]) -> tuple[float, int]:
    """``(seconds, peak KiB)`` of one run in a fresh process."""
    out = tempfile.mkdtemp()
    shutil.rmtree(out)
    args = [a.format(out=out) for a in argv]
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}
    env["PYTHONPATH"] = src
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "finefreeze", *args], env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} with {src}: exit {proc.returncode}")
    return seconds, usage.ru_maxrss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare", help="another src folder to time side by side")
    a = ap.parse_args()
    variants = {"this": HERE} | ({"other": a.compare} if a.compare else {})
    times = {(v, c): [] for v in variants for c in COMMANDS}
    rss = {(v, c): [] for v in variants for c in COMMANDS}
    for src in variants.values():  # warm-up: file caches, compiled bytecode
        for argv in COMMANDS.values():
            run(src, argv)
    for _ in range(a.rounds):
        for c, argv in COMMANDS.items():
            for v, src in variants.items():
                s, kib = run(src, argv)
                times[v, c].append(s)
                rss[v, c].append(kib)
    print(f"{a.rounds} rounds, interleaved; median wall time [min-max], median peak RSS")
    for c in COMMANDS:
        for v in variants:
            ts = times[v, c]
            print(
                f"  {c:12} {v:6} {statistics.median(ts):6.2f} s [{min(ts):.2f}-{max(ts):.2f}]"
                f"  {statistics.median(rss[v, c]) / 1024:6.0f} MiB"
            )
        if a.compare:
            r = statistics.median(times["this", c]) / statistics.median(times["other", c])
            m = statistics.median(rss["this", c]) / statistics.median(rss["other", c])
            print(f"  {c:12} this/other: time {r:.2f}, memory {m:.2f}")


if __name__ == "__main__":
    main()
