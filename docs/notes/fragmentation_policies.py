import random, math, bisect, sys
from fragmentation_trace import trace, KiB, MiB, GiB
PAGE=2*MiB
class Pool:
    """VA free list + physical handles. Growth creates handles; remap moves whole free handles."""
    def __init__(s, decompose, remap=True, big=None):
        s.decompose=decompose; s.remap=remap; s.big=big
        s.free={}; s.addrs=[]; s.bysize=[]
        s.handles={}   # va start -> size (mapped handles)
        s.hstarts=[]
        s.frontier=0; s.reserved=0; s.hwm=0; s.alloc={}
        s.moved=0; s.created=0; s.remaps=0
    def _ins(s,a,n): bisect.insort(s.addrs,a); s.free[a]=n; bisect.insort(s.bysize,(n,a))
    def _rm(s,a):
        n=s.free.pop(a); s.addrs.pop(bisect.bisect_left(s.addrs,a)); s.bysize.pop(bisect.bisect_left(s.bysize,(n,a))); return n
    def _add(s,a,n):
        i=bisect.bisect_left(s.addrs,a)
        if i>0:
            pa=s.addrs[i-1]
            if pa+s.free[pa]==a: n+=s._rm(pa); a=pa
        i=bisect.bisect_left(s.addrs,a)
        if i<len(s.addrs) and s.addrs[i]==a+n: n+=s._rm(a+n)
        s._ins(a,n)
    def _fit(s,n):
        i=bisect.bisect_left(s.bysize,(n,-1))
        return s.bysize[i] if i<len(s.bysize) else None
    def _tail(s):
        if s.addrs:
            la=s.addrs[-1]
            if la+s.free[la]==s.frontier: return s.free[la]
        return 0
    def _map(s,size):
        a=s.frontier; s.handles[a]=size; bisect.insort(s.hstarts,a); s.frontier+=size; s._add(a,size)
    def allocate(s,k,n):
        n=(n+255)//256*256
        f=s._fit(n)
        if f is None and s.remap:
            tail=s._tail(); need=n-tail
            # movable handles: entirely inside a free block, not touching the frontier tail block
            cand=[]
            for a in s.addrs:
                sz=s.free[a]
                if a+sz==s.frontier: continue
                i=bisect.bisect_left(s.hstarts,a)
                while i<len(s.hstarts) and s.hstarts[i]+s.handles[s.hstarts[i]]<=a+sz:
                    cand.append((s.handles[s.hstarts[i]],s.hstarts[i],a)); i+=1
            if sum(c[0] for c in cand)>=need:
                # take smallest handles first? take largest first to minimise moves
                cand.sort(reverse=True)
                got=0; take=[]
                for c in cand:
                    if got>=need: break
                    take.append(c); got+=c[0]
                for hsz,ha,blk in take:
                    # cut [ha,ha+hsz) out of the free block containing it
                    i=bisect.bisect_right(s.addrs,ha)-1; ba=s.addrs[i]; bn=s._rm(ba)
                    if ha>ba: s._ins(ba,ha-ba)
                    if ba+bn>ha+hsz: s._ins(ha+hsz,ba+bn-ha-hsz)
                    del s.handles[ha]; s.hstarts.pop(bisect.bisect_left(s.hstarts,ha))
                    s._map(hsz); s.moved+=1
                s.remaps+=1
                f=s._fit(n)
        if f is None:
            tail=s._tail(); need=-(-(n-tail)//PAGE)*PAGE
            for h in s.decompose(need, n):
                s._map(h); s.reserved+=h; s.created+=1
            s.hwm=max(s.hwm,s.reserved)
            f=s._fit(n)
        sz,a=f; s._rm(a)
        if sz>n: s._ins(a+n,sz-n)
        s.alloc[k]=(a,n)
    def free_(s,k):
        a,n=s.alloc.pop(k); s._add(a,n)
def pages(need,n): return [PAGE]*(need//PAGE)
def buddy(maxh):
    def d(need,n):
        out=[]; left=need; h=maxh
        while left>0:
            while h>left: h//=2
            out.append(h); left-=h
        return out
    return d
def chunked(c):
    def d(need,n): return [max(c, need)]
    return d
def run(ops, **kw):
    p=Pool(**kw)
    for op,k,n in ops:
        if op=='a': p.allocate(k,n)
        else: p.free_(k)
    return p
if __name__=='__main__':
    steps=int(sys.argv[1])
    res={}
    for seed in [1,2]:
        ops=trace(seed=seed,steps=steps)
        cur=0;peak=0;sz={}
        for op,k,n in ops:
            if op=='a': sz[k]=n;cur+=n;peak=max(peak,cur)
            else: cur-=sz.pop(k)
        for name,kw in [("2MiB handles",dict(decompose=pages)),("buddy<=8MiB",dict(decompose=buddy(8*MiB))),("buddy<=32MiB",dict(decompose=buddy(32*MiB))),("buddy<=64MiB",dict(decompose=buddy(64*MiB))),("exact one handle",dict(decompose=lambda need,n:[need])),("64MiB chunks",dict(decompose=chunked(64*MiB)))]:
            p=run(ops,**kw)
            print(seed,"%-18s hwm/peak %.3f  handles created %5d  moved %5d remaps %4d"%(name,p.hwm/peak,p.created,p.moved,p.remaps))
