"""Compiled kernels kept on disk, so a new process does not compile a kernel it has compiled before.

Every kernel is specialised to its geometry and compiling one takes seconds (numba's front end,
then NVVM), at every new process. ``launch.launch`` asks this cache before it lets numba's
dispatcher compile a kernel, and stores what the dispatcher compiled: the kernel's cubin and its
entry point's name, loaded later into the current context as a module (numba's own
``create_module_image``) and launched through the direct path.

The key of an entry hashes everything that changes the compiled code:

* the kernel's identity: its module and name, and for a kernel made by a factory
  (``kernel_factory``) the factory's arguments (the specialisation constants: dtype, tile,
  tap patterns, ...);
* the numba types of its arguments (dtype, rank, layout of every array);
* the device's compute capability, numba's and numba-cuda's versions, numba's optimisation and
  debug settings;
* the contents of every source file of the package (``source_digest``): a kernel's device
  functions live in other modules too, and a change to any of them must compile afresh. (This
  is why numba's own ``cache=True``, which hashes one file, is not used; it also cannot cache
  the generated device functions.)

Kernels that no key can describe (a closure not made by a ``kernel_factory``) are never cached.
Entries are written to a temporary file and renamed into place, so processes filling the cache
at once never read a partial entry (the temporary files of writes that died are removed after
``STALE_TMP_S``). Where: ``$NUMBA_DECONV_CACHE_DIR``, else
``$XDG_CACHE_HOME/numba_deconv`` (``~/.cache/numba_deconv``); ``NUMBA_DECONV_CACHE=0`` turns
the cache off; ``clear()`` (``python -m numba_deconv cache --clear``) empties it. It holds at
most ``MAX_MB`` megabytes (``$NUMBA_DECONV_CACHE_MAX_MB``), the entries used least recently
removed first. Unused under the CUDA simulator, which compiles nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

ENV_DIR = "NUMBA_DECONV_CACHE_DIR"
ENV_ENABLED = "NUMBA_DECONV_CACHE"
ENV_MAX_MB = "NUMBA_DECONV_CACHE_MAX_MB"
#: the cache's size bound unless ``$NUMBA_DECONV_CACHE_MAX_MB`` says otherwise: past it, the
#: entries used least recently are removed (fuzzing compiles hundreds of geometries)
MAX_MB = 2048
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
#: the attribute under which a kernel keeps its identity (``kernel_factory``)
IDENTITY = "_numba_deconv_identity"


def enabled() -> bool:
    return os.environ.get(ENV_ENABLED, "1") not in ("0", "false", "no", "off", "")


def directory() -> Path:
    """Where entries live (see the module docstring)."""
    where = os.environ.get(ENV_DIR)
    if where:
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "numba_deconv"


#: a temporary file this old is a write that died (a killed process), not one in flight
STALE_TMP_S = 600


def clear() -> int:
    """Remove every entry and record (and dead temporary files; writes in flight finish);
    returns how many files were removed."""
    removed = 0
    root = directory()
    if root.is_dir():
        for path in root.iterdir():
            if path.suffix in (".cubin", ".json", ".ready", *RECORDS) or _dead_tmp(path):
                path.unlink(missing_ok=True)
                removed += 1
    return removed


def _dead_tmp(path: Path) -> bool:
    import time

    try:
        return path.suffix == ".tmp" and time.time() - path.stat().st_mtime > STALE_TMP_S
    except OSError:  # gone meanwhile
        return False


def entries() -> list[Path]:
    root = directory()
    return sorted(root.glob("*.json")) if root.is_dir() else []


def source_digest(root: Path = PACKAGE_ROOT) -> str:
    """SHA-256 over the relative path and contents of every ``.py`` file of the package."""
    return _digest(str(root))


@functools.lru_cache(maxsize=4)
def _digest(root: str) -> str:
    h = hashlib.sha256()
    for path in sorted(Path(root).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def kernel_factory(fn):
    """A cached kernel factory (``functools.lru_cache``) whose kernels remember the factory and
    its arguments: their identity in the disk cache. The arguments' ``repr`` must spell every
    specialisation constant (ints, strings, bools, tuples of them)."""
    @functools.lru_cache(maxsize=None)
    @functools.wraps(fn)
    def make(*args, **kwargs):
        kernel = fn(*args, **kwargs)
        setattr(kernel, IDENTITY, (fn.__module__, fn.__qualname__, repr(args),
                                   repr(sorted(kwargs.items()))))
        return kernel

    return make


def identity(kernel):
    """A kernel's identity: a ``kernel_factory``'s record, or a module-level kernel's module and
    name; None for anything else (a closure of unknown constants: never cached)."""
    ident = getattr(kernel, IDENTITY, None)
    if ident is not None:
        return ident
    fn = getattr(kernel, "py_func", None)
    if fn is None or "<locals>" in fn.__qualname__:
        return None
    return (fn.__module__, fn.__qualname__)


def key(ident, argtypes, cc, versions, digest: str) -> str:
    """The entry name for a kernel identity, its argument types (strings), the device's compute
    capability, the compiler versions and settings, and the sources' digest."""
    text = repr((ident, tuple(argtypes), tuple(cc), tuple(versions), digest))
    return hashlib.sha256(text.encode()).hexdigest()


def store(name: str, cubin: bytes, meta: dict) -> None:
    """Write entry ``name`` (the cubin, then its metadata: an entry is complete once its
    ``.json`` exists), each file renamed into place."""
    root = directory()
    root.mkdir(parents=True, exist_ok=True)
    _write(root / f"{name}.cubin", bytes(cubin))
    _write(root / f"{name}.json", json.dumps(meta, sort_keys=True).encode())
    trim(float(os.environ.get(ENV_MAX_MB, MAX_MB)) * 1e6)


def size_bytes() -> int:
    return sum(p.stat().st_size for p in directory().glob("*") if p.is_file()) \
        if directory().is_dir() else 0


def trim(limit: float) -> None:
    """Remove the entries used least recently until the cache holds at most ``limit`` bytes
    (``load`` marks an entry used)."""
    root = directory()
    for tmp in root.glob("*.tmp"):  # writes that died leave these; nothing else removes them
        if _dead_tmp(tmp):
            tmp.unlink(missing_ok=True)
    found = []
    for meta in root.glob("*.json"):
        cubin = meta.with_suffix(".cubin")
        try:
            found.append((meta.stat().st_mtime, meta.stat().st_size
                          + (cubin.stat().st_size if cubin.exists() else 0), meta, cubin))
        except OSError:  # removed by another process meanwhile
            continue
    total = sum(f[1] for f in found)
    for _, size, meta, cubin in sorted(found, key=lambda f: f[0]):
        if total <= limit:
            break
        meta.unlink(missing_ok=True)  # first: an entry without its .json is no entry
        cubin.unlink(missing_ok=True)
        total -= size


def load(name: str) -> tuple[bytes, dict] | None:
    """Entry ``name``'s (cubin, metadata), or None if there is no complete entry."""
    root = directory()
    try:
        meta = json.loads((root / f"{name}.json").read_bytes())
        cubin = (root / f"{name}.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if len(cubin) != meta.get("size"):
        return None
    try:
        os.utime(root / f"{name}.json")  # used now: the last to go when the cache is trimmed
    except OSError:
        pass
    return cubin, meta


#: the suffixes of the small JSON records other modules keep here (``store_record``):
#: ``.grads``, the backward's measured gradient paths (``grad_choice``), a few hundred bytes
#: per measured shape; removed by ``clear()``, not counted out by ``trim``
RECORDS = (".grads",)


def store_record(name: str, suffix: str, record: dict) -> None:
    """Keep ``record`` (JSON) as ``name + suffix``, renamed into place."""
    if suffix not in RECORDS:
        raise ValueError(f"unknown record suffix {suffix!r}; known: {RECORDS}")
    root = directory()
    root.mkdir(parents=True, exist_ok=True)
    _write(root / f"{name}{suffix}", json.dumps(record).encode())


def load_record(name: str, suffix: str) -> dict | None:
    """The record ``store_record`` kept as ``name + suffix``, or None."""
    try:
        return json.loads((directory() / f"{name}{suffix}").read_bytes())
    except (OSError, ValueError):
        return None


def _write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
