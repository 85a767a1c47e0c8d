"""`driftgate bench load`: what loading a checkpoint costs — seconds, peak memory, memory kept.

Each load runs in a fresh process (what `serve` pays at start-up), checkpoints interleaved across
`--runs` so machine noise hits each alike; medians. Peak RSS is the kernel's high-water mark of
the child (`wait4`'s ru_maxrss), which counts the checkpoint's pages read through the memory map
as well; peak anonymous memory (sampled every millisecond) is what the process itself allocated,
the part that cannot be paged back to the file under pressure (a spike inside one call that
holds the GIL can slip between samples; before and after alike).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.output import medians, save_result
from bench.schemes import Checkpoint, size_on_disk

_MARK = "bench-load-result "  # the child's result line, among whatever else it prints
# runs in the child: samples anonymous memory while an engine loads, then reports
_CHILD = r"""
import json, os, sys, threading, time

def anon_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0

peak = [anon_mib()]
def sample():
    while True:
        peak[0] = max(peak[0], anon_mib())
        time.sleep(0.001)

from engine import LLM
threading.Thread(target=sample, daemon=True).start()
before = anon_mib()
start = time.perf_counter()
llm = LLM(sys.argv[1], dtype=sys.argv[2], kv_cache_memory_bytes=16 << 20)  # held while measured
seconds = time.perf_counter() - start
with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
print("bench-load-result " + json.dumps({"load_s": seconds, "rss_after_mib": rss, "anon_after_mib": anon_mib(),
                  "anon_peak_mib": max(peak[0], anon_mib()), "anon_before_mib": before}), flush=True)
"""


def add_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", type=Checkpoint.parse, metavar="NAME=DIR[@DTYPE]")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def load_once(ckpt: Checkpoint) -> dict[str, float]:
    """Load `ckpt` into an engine in a fresh process; its seconds and memory (MiB)."""
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(ckpt.path), ckpt.dtype],
                                 stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            out = child.stdout.read()
            _, status, usage = os.wait4(child.pid, 0)  # reaped here, for its rusage (Popen.wait would not give it)
        except BaseException:  # interrupted: no child outlives the bench
            child.kill()
            child.wait()
            raise
        finally:
            child.stdout.close()
        child.returncode = code = os.waitstatus_to_exitcode(status)
        if code != 0:
            err.seek(0)
            last = err.read().strip().splitlines()
            why = last[-1] if last else f"killed by signal {-code} (out of memory?)" if code < 0 else f"exit code {code}"
            raise ValueError(f"{ckpt.name}: loading {ckpt.path} failed: {why}")
    results = [line.removeprefix(_MARK) for line in out.splitlines() if line.startswith(_MARK)]
    if not results:
        raise ValueError(f"{ckpt.name}: the loading process printed no result")
    row = json.loads(results[-1])
    row["peak_rss_mib"] = usage.ru_maxrss / 1024  # KiB on Linux
    return row


def run_load(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict]] = {c.name: [] for c in args.checkpoints}
    for i in range(args.runs):
        for ckpt in args.checkpoints:
            runs[ckpt.name].append(load_once(ckpt))
            print(f"run {i + 1}/{args.runs} {ckpt.name}: {runs[ckpt.name][-1]}", flush=True)
    rows = [{"name": c.name, "path": str(c.path), "dtype": c.dtype, "size_bytes": size_on_disk(c.path),
             **medians(runs[c.name]), "runs": runs[c.name]}
            for c in args.checkpoints]
    result = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "runs": args.runs, "rows": rows}
    print(f"\n{'':16s} {'size MB':>8s} {'load s':>7s} {'peak RSS':>9s} {'peak anon':>10s} {'RSS after':>10s}")
    for row in rows:
        print(f"{row['name']:16s} {row['size_bytes'] / 1e6:8.0f} {row['load_s']:7.2f} {row['peak_rss_mib']:9.0f} "
              f"{row['anon_peak_mib']:10.0f} {row['rss_after_mib']:10.0f}")
    save_result(result, args.result_json, args.plot, _plot)
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, (key, label) in enumerate((("peak_rss_mib", "peak RSS"), ("anon_peak_mib", "peak anonymous"),
                                      ("anon_after_mib", "anonymous after load"))):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [r[key] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), names)
    ax.set_ylabel("MiB")
    ax.set_title(f"Loading a checkpoint into an engine (medians of {result['runs']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
