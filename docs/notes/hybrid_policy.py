# One more policy for docs/pool.md's random trace, tried on 2026-11-22: fast growth (one
# handle of the request's own size, ~450 handles to fill 8 GiB instead of ~4,100 pages) with
# compact's remapping afterwards (a freed handle that a smaller request would take only part
# of is first split into 2 MiB pages, so its rest stays movable).
#
#   python3 hybrid_policy.py [legal]     legal=1 (default): split only handles nothing lives in
#
# legal=0 splits a handle whatever lives in it, which the driver cannot do (a physical
# allocation is released whole, and its contents with it): 1.07, as good as 2 MiB pages.
# legal=1, the only one that can be built: 1.15 to 1.17, because small allocations placed in
# the rest of a big handle pin it as before.
import bisect, sys
import fragmentation_policies as fp
from fragmentation_trace import trace, MiB

PAGE = fp.PAGE


class Hybrid(fp.Pool):
    def __init__(s, legal):
        super().__init__(decompose=None)
        s.legal = legal; s.split = 0; s.pages_made = 0

    def _handles_in(s, a, n):
        i = max(0, bisect.bisect_right(s.hstarts, a) - 1); out = []
        while i < len(s.hstarts) and s.hstarts[i] < a + n:
            h = s.hstarts[i]
            if h + s.handles[h] > a: out.append(h)
            i += 1
        return out

    def _free_in(s, h, hs):
        fr = 0; i = max(0, bisect.bisect_right(s.addrs, h) - 1)
        while i < len(s.addrs) and s.addrs[i] < h + hs:
            fa = s.addrs[i]; fr += max(0, min(fa + s.free[fa], h + hs) - max(fa, h)); i += 1
        return fr

    def _to_pages(s, h):
        hs = s.handles.pop(h); s.hstarts.pop(bisect.bisect_left(s.hstarts, h))
        for q in range(h, h + hs, PAGE):
            s.handles[q] = PAGE; bisect.insort(s.hstarts, q)
        s.split += 1; s.pages_made += hs // PAGE

    def _remap(s, n):
        need = n - s._tail(); cand = []
        for a in s.addrs:
            sz = s.free[a]
            if a + sz == s.frontier: continue
            i = bisect.bisect_left(s.hstarts, a)
            while i < len(s.hstarts) and s.hstarts[i] + s.handles[s.hstarts[i]] <= a + sz:
                cand.append((s.handles[s.hstarts[i]], s.hstarts[i])); i += 1
        if sum(c[0] for c in cand) < need: return
        cand.sort(reverse=True); got = 0
        for hsz, ha in cand:
            if got >= need: break
            got += hsz
            i = bisect.bisect_right(s.addrs, ha) - 1; ba = s.addrs[i]; bn = s._rm(ba)
            if ha > ba: s._ins(ba, ha - ba)
            if ba + bn > ha + hsz: s._ins(ha + hsz, ba + bn - ha - hsz)
            del s.handles[ha]; s.hstarts.pop(bisect.bisect_left(s.hstarts, ha))
            s._map(hsz); s.moved += 1

    def allocate(s, k, n):
        n = (n + 255) // 256 * 256
        f = s._fit(n)
        if f is None:
            s._remap(n); f = s._fit(n)
        if f is None:  # grow: a page run after the tail for small requests, a handle of its own for large
            if n < PAGE:
                need = -(-(n - s._tail()) // PAGE) * PAGE
            else:
                need = -(-n // PAGE) * PAGE; s.frontier += 64 * PAGE  # not after the tail
            s._map(need); s.reserved += need; s.created += 1; s.hwm = max(s.hwm, s.reserved)
            f = s._fit(n)
        sz, a = f
        if s.legal:  # only a handle wholly free before this allocation may be split
            for h in s._handles_in(a, n):
                hs = s.handles[h]
                if hs > PAGE and h >= a and h + hs <= a + sz and hs - (min(h + hs, a + n) - max(h, a)) >= PAGE:
                    s._to_pages(h)
        s._rm(a)
        if sz > n: s._ins(a + n, sz - n)
        if not s.legal:
            for h in s._handles_in(a, n):
                hs = s.handles[h]
                if hs > PAGE and not (h >= a and h + hs <= a + n) and s._free_in(h, hs) >= PAGE:
                    s._to_pages(h)
        s.alloc[k] = (a, n)


if __name__ == '__main__':
    legal = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for seed in [1, 2]:
        ops = trace(seed=seed, steps=20000)
        cur = peak = 0; sz = {}; fill = None
        for i, (op, k, n) in enumerate(ops):
            if op == 'a': sz[k] = n; cur += n; peak = max(peak, cur)
            else:
                cur -= sz.pop(k)
                if fill is None: fill = i
        p = Hybrid(legal); at_fill = None
        for i, (op, k, n) in enumerate(ops):
            if i == fill: at_fill = p.created
            if op == 'a': p.allocate(k, n)
            else: p.free_(k)
        print("seed %d legal=%d: reserved high / peak live %.3f; handles made to fill %d; pages from splits %d; moved %d"
              % (seed, legal, p.hwm / peak, at_fill, p.pages_made, p.moved))
