"""streamalloc from Python: the device's current pool as PyTorch's or CuPy's allocator.

Loads the C interface (libstreamalloc_c.so, built by the CMake target ``streamalloc_c``; see
docs/deep-learning.md) with ctypes. Pure Python; PyTorch and CuPy are imported only by the
function that plugs streamalloc into them.

    import streamalloc
    streamalloc.use_in_pytorch()   # before PyTorch allocates anything on the GPU
    ...
    print(streamalloc.statistics(0)["reserved_high"])

The library is found, in this order, at the path given to ``load``, at ``$STREAMALLOC_LIBRARY``,
on the system's library path, and in the ``build*`` folders of the source tree this package
sits in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import pathlib

__all__ = [
    "load", "library_path", "use_in_pytorch", "use_in_cupy", "statistics", "reset_peaks", "synchronize", "trim",
    "set_release_threshold", "set_reuse_policy", "snapshot", "keep_history", "last_error", "StreamallocError",
]


class StreamallocError(RuntimeError):
    """A streamalloc_* call failed; the message is the library's."""


class _Statistics(ctypes.Structure):
    # The order and types of streamalloc_statistics in include/streamalloc/c_api.h.
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "reserved_current", "reserved_high", "used_current", "used_high", "live_allocations",
        "free_clear", "free_pending", "largest_free_block", "chunks", "remapped_chunks", "grows",
        "graph_reserved_current", "graph_reserved_high", "graph_allocations", "graphs")]


_lib = None
_path = None


def _candidates(explicit):
    if explicit:
        yield pathlib.Path(explicit)
        return
    if os.environ.get("STREAMALLOC_LIBRARY"):
        yield pathlib.Path(os.environ["STREAMALLOC_LIBRARY"])
    found = ctypes.util.find_library("streamalloc_c")
    if found:
        yield pathlib.Path(found)
    root = pathlib.Path(__file__).resolve().parents[2]  # python/streamalloc/__init__.py
    for build in sorted(root.glob("build*")):
        yield build / "libstreamalloc_c.so"


def load(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Loads the C library (once; later calls return it). Raises FileNotFoundError naming
    where it looked when none is found."""
    global _lib, _path
    if _lib is not None:
        return _lib
    tried = []
    for candidate in _candidates(path):
        tried.append(str(candidate))
        try:
            lib = ctypes.CDLL(str(candidate))
        except OSError:
            continue
        _declare(lib)
        _lib, _path = lib, str(candidate)
        return lib
    raise FileNotFoundError(
        "streamalloc: libstreamalloc_c.so not found (looked at: " + ", ".join(tried or ["nothing"]) +
        "); build it with `cmake --build <build> --target streamalloc_c` and set STREAMALLOC_LIBRARY "
        "to its path")


def library_path() -> str:
    """The path of the C library ``load`` found."""
    load()
    return _path


def _declare(lib):
    size_t, c_int, vp = ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
    signatures = {
        "streamalloc_version": (c_int, []),
        "streamalloc_malloc": (vp, [size_t, c_int, vp]),
        "streamalloc_free": (None, [vp, size_t, c_int, vp]),
        "streamalloc_get_statistics": (c_int, [c_int, ctypes.POINTER(_Statistics), size_t]),
        "streamalloc_reset_peaks": (c_int, [c_int]),
        "streamalloc_synchronize": (c_int, [c_int]),
        "streamalloc_trim": (c_int, [c_int, size_t]),
        "streamalloc_set_release_threshold": (c_int, [c_int, size_t]),
        "streamalloc_set_reuse_policy": (c_int, [c_int, c_int, c_int, c_int]),
        "streamalloc_snapshot": (ctypes.c_longlong, [c_int, ctypes.c_char_p, size_t]),
        "streamalloc_keep_history": (c_int, [c_int, size_t]),
        "streamalloc_last_error": (ctypes.c_char_p, []),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


def last_error() -> str:
    """The last error of a streamalloc call on this thread ("" if none)."""
    return load().streamalloc_last_error().decode()


def _check(status):
    if status < 0:
        raise StreamallocError(last_error())
    return status


def _device(device):
    if device is not None:
        return int(device)
    # The device the caller's framework considers current, as its allocations would use.
    try:
        import torch
        if torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except ImportError:
        pass
    return 0


def statistics(device: int | None = None) -> dict:
    """What the device's current pool holds (the fields of streamalloc::pool_statistics)."""
    s = _Statistics()
    _check(load().streamalloc_get_statistics(_device(device), ctypes.byref(s), ctypes.sizeof(s)))
    return {name: getattr(s, name) for name, _ in _Statistics._fields_}


def reset_peaks(device: int | None = None) -> None:
    """Resets reserved_high and used_high to the current values."""
    _check(load().streamalloc_reset_peaks(_device(device)))


def synchronize(device: int | None = None) -> None:
    """Waits for the device's work through streamalloc, so its pool learns that every pending
    free has run (``torch.cuda.synchronize()`` and ``cupy.cuda.Device().synchronize()`` go
    around it and tell it nothing)."""
    _check(load().streamalloc_synchronize(_device(device)))


def trim(device: int | None = None, keep: int = 0) -> None:
    """Waits for the device's work, then gives free physical memory back to it, down to
    ``keep`` bytes held: what ``torch.cuda.empty_cache()`` does for PyTorch's allocator."""
    dev = _device(device)
    _check(load().streamalloc_synchronize(dev))
    _check(load().streamalloc_trim(dev, keep))


def set_release_threshold(bytes_kept: int, device: int | None = None) -> None:
    """How much free memory the pool keeps at synchronizations (-1: everything)."""
    value = ctypes.c_size_t(bytes_kept).value  # -1 becomes SIZE_MAX
    _check(load().streamalloc_set_release_threshold(_device(device), value))


def set_reuse_policy(follow_event_dependencies: bool = True, opportunistic: bool = True,
                     internal_dependencies: bool = True, device: int | None = None) -> None:
    """Which free memory a stream may reuse, from now on (the C++ ``reuse_policy``; the
    defaults are the pool's)."""
    _check(load().streamalloc_set_reuse_policy(_device(device), int(follow_event_dependencies), int(opportunistic),
                                               int(internal_dependencies)))


def snapshot(device: int | None = None) -> dict:
    """What the pool holds, as a dict: properties, statistics, reservations, chunks, blocks,
    streams and, when kept (``keep_history``), the recent history (docs/observability.md)."""
    lib, dev = load(), _device(device)
    need = _check(lib.streamalloc_snapshot(dev, None, 0))
    while True:
        # Other threads may allocate between the two calls: the document can grow meanwhile.
        capacity = need + need // 8 + 4096
        buf = ctypes.create_string_buffer(capacity)
        need = _check(lib.streamalloc_snapshot(dev, buf, capacity))
        if need < capacity:
            return json.loads(buf.value.decode())


def keep_history(events: int, device: int | None = None) -> None:
    """Keeps the pool's last ``events`` allocations, frees, growths, releases and remaps for
    ``snapshot`` (0: none); scripts/plot_snapshot.py draws them. Each call starts a new
    history. While kept, each allocation and free costs about 200 ns more."""
    _check(load().streamalloc_keep_history(_device(device), events))


def use_in_pytorch() -> None:
    """Makes streamalloc PyTorch's CUDA allocator (``CUDAPluggableAllocator``). Call it before
    PyTorch allocates GPU memory: PyTorch refuses to change allocators afterwards. Tensors are
    allocated on PyTorch's current stream and freed on the stream they were allocated on; an
    out-of-memory error is a RuntimeError naming the request and the pool's state.
    ``Tensor.record_stream`` is not forwarded by PyTorch to pluggable allocators: order the
    freeing stream after the others with events instead (docs/deep-learning.md)."""
    import torch
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "streamalloc_torch_malloc",
                                                         "streamalloc_free")
    torch.cuda.memory.change_current_allocator(allocator)


class _CupyBlock:
    """Owns one allocation for CuPy: freed, on the stream it was allocated on, when CuPy lets
    go of the memory."""
    __slots__ = ("ptr", "size", "device", "stream", "lib")

    def __init__(self, lib, ptr, size, device, stream):
        self.lib, self.ptr, self.size, self.device, self.stream = lib, ptr, size, device, stream

    def __del__(self):
        if self.ptr and self.lib is not None:
            self.lib.streamalloc_free(self.ptr, self.size, self.device, self.stream)
            self.ptr = None


def use_in_cupy() -> None:
    """Makes streamalloc CuPy's device allocator (``cupy.cuda.set_allocator``). Memory is
    allocated on CuPy's current stream and freed on that stream when the array goes away: keep
    a stream alive while arrays allocated on it live."""
    import cupy
    lib = load()

    def allocate(size):
        device = cupy.cuda.runtime.getDevice()
        stream = cupy.cuda.get_current_stream().ptr
        ptr = lib.streamalloc_malloc(size, device, stream)
        if not ptr:
            if size == 0:
                return cupy.cuda.memory.MemoryPointer(cupy.cuda.memory.UnownedMemory(0, 0, None, device), 0)
            raise MemoryError(f"streamalloc: {size} bytes on device {device}: {last_error()}")
        owner = _CupyBlock(lib, ptr, size, device, stream)
        return cupy.cuda.memory.MemoryPointer(cupy.cuda.memory.UnownedMemory(ptr, size, owner, device), 0)

    cupy.cuda.set_allocator(allocate)
