"""Build and load the engine's C kernels (engine/csrc/*.c) for the CPU it runs on.

Each kernel is compiled at first use with the system C compiler (`-march=native`, so the
cached library is keyed by the CPU as well as the source and flags) into
`$DRIFTGATE_HOME/kernels/`. Without a compiler, or with `DRIFTGATE_CPU_KERNELS=0`, `kernel()`
gives None and callers keep their torch path. `DRIFTGATE_CPU_MARCH` names another `-march`
(`haswell`: AVX2 without VNNI), to run here the routes an older CPU takes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.model_import import driftgate_home

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent.parent / "csrc"
CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def _has_libmvec() -> bool:
    return ctypes.util.find_library("mvec") is not None


def _flags() -> list[str]:
    """CFLAGS and the target CPU, plus glibc's vector math library where there is one (kernels then
    vectorize expf)."""
    flags = [*CFLAGS, f"-march={os.environ.get('DRIFTGATE_CPU_MARCH', 'native')}"]
    return [*flags, "-fno-math-errno", "-DHAVE_LIBMVEC", "-lmvec"] if _has_libmvec() else flags


def cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build(compiler: str, source: Path) -> Path:
    digest = hashlib.sha256()
    # every source, not just this one: a kernel may #include another (decode_step.c does)
    sources = [path.read_bytes() for path in sorted(SOURCES.glob("*.[ch]"))]
    for part in (source.name.encode(), *sources, " ".join([compiler, *_flags()]).encode(),
                 cpu_signature().encode()):
        digest.update(part)
    target = driftgate_home() / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, str(source), *_flags(), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def compiler() -> str | None:
    """The C compiler kernels are built with ($CC, else cc), or None."""
    return shutil.which(os.environ.get("CC", "cc"))


@functools.cache
def kernel(source: str, symbol: str, argtypes: tuple, restype: type | None) -> ctypes._CFuncPtr | None:
    """Function `symbol` of the compiled engine/csrc/<source>.c, or None (logged) where it cannot be built."""
    if os.environ.get("DRIFTGATE_CPU_KERNELS", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: %s uses the slower torch path", source)
        return None
    try:
        fn = getattr(ctypes.CDLL(str(_build(cc, SOURCES / f"{source}.c"))), symbol)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the %s kernel failed, using the torch path: %s", source, detail)
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
