"""CuPy on streamalloc: arrays on two streams, allocated from the device's streamalloc pool.

Computes on two CuPy streams at once (a matrix product, an FFT, reductions), checks every
result against NumPy, and checks the pool's statistics: what is live while the arrays live,
nothing once they are gone, and that the same memory served the next round (the pool did not
grow after the first).

    python3 examples/python/cupy_arrays.py

Needs CuPy and a GPU; exits 77 (skipped) without them.
"""

import gc
import pathlib
import sys

SKIP = 77
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))


def main():
    try:
        import cupy
        import numpy
    except ImportError:
        print("SKIPPED: CuPy is not installed")
        return SKIP
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no device")
    except Exception as e:  # CuPy raises its own error types when there is no driver
        print(f"SKIPPED: CuPy sees no GPU ({e})")
        return SKIP
    import streamalloc
    streamalloc.use_in_cupy()
    rng = numpy.random.default_rng(7)
    a_host = rng.standard_normal((1024, 1024), dtype=numpy.float32)
    b_host = rng.standard_normal((1024, 1024), dtype=numpy.float32)
    signal = rng.standard_normal(1 << 20).astype(numpy.complex64)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    failures = 0
    grows_after_first = None
    for round_ in range(5):
        results = []
        for i, s in enumerate(streams):
            with s:
                a = cupy.asarray(a_host)
                b = cupy.asarray(b_host)
                product = a @ b if i == 0 else a.T @ b
                spectrum = cupy.fft.fft(cupy.asarray(signal))
                results.append((product, spectrum, float(product.sum()), float(cupy.abs(spectrum).max())))
        live = streamalloc.statistics()["live_allocations"]
        if live < 4:
            print(f"round {round_}: {live} live allocations while the arrays live; expected at least 4")
            failures += 1
        for i, (product, spectrum, total, peak) in enumerate(results):
            streams[i].synchronize()
            want = a_host @ b_host if i == 0 else a_host.T @ b_host
            if not numpy.allclose(cupy.asnumpy(product), want, rtol=1e-3, atol=1e-2):
                print(f"round {round_}, stream {i}: the matrix product is wrong")
                failures += 1
            if not numpy.allclose(cupy.asnumpy(spectrum), numpy.fft.fft(signal), rtol=1e-3, atol=1e-1):
                print(f"round {round_}, stream {i}: the FFT is wrong")
                failures += 1
        del results, product, spectrum, a, b
        gc.collect()
        stats = streamalloc.statistics()
        if round_ == 0:
            grows_after_first = stats["grows"]
        # CuPy's FFT plan cache keeps a work area; everything else is gone.
        print(f"round {round_}: {stats['live_allocations']} live allocations ({stats['used_current']} bytes), "
              f"reserved {stats['reserved_current'] >> 20} MiB, grows {stats['grows']}")
    cupy.fft.config.get_plan_cache().clear()
    gc.collect()
    for s in streams:
        s.synchronize()
    stats = streamalloc.statistics()
    if stats["live_allocations"] != 0:
        print(f"{stats['live_allocations']} allocations still live after every array was dropped")
        failures += 1
    if stats["grows"] != grows_after_first:
        print(f"the pool grew after the first round ({grows_after_first} -> {stats['grows']}): memory was not reused")
        failures += 1
    streamalloc.trim()
    print(f"after trim: reserved {streamalloc.statistics()['reserved_current']} bytes")
    print("ok" if failures == 0 else f"{failures} failures")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
