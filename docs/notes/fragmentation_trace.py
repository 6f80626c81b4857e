import random, math, bisect, sys
KiB=1024; MiB=1<<20; GiB=1<<30
def trace(seed=1, live_target=8*GiB, steps=20000):
    r=random.Random(seed); ops=[]; live={}; nid=0; cur=0
    def size(): return int(math.exp(r.uniform(math.log(4*KiB), math.log(64*MiB))))
    while cur<live_target:
        s=size(); ops.append(('a',nid,s)); live[nid]=s; cur+=s; nid+=1
    ids=list(live)
    for _ in range(steps):
        i=r.randrange(len(ids)); k=ids[i]; ids[i]=ids[-1]; ids.pop()
        ops.append(('f',k,0)); cur-=live.pop(k)
        while cur<live_target:
            s=size(); ops.append(('a',nid,s)); live[nid]=s; ids.append(nid); cur+=s; nid+=1
    return ops

class BestFit:
    """free blocks keyed by address; best fit by size; growth at frontier in chunks"""
    def __init__(s, chunk, gran=2*MiB, align=256):
        s.chunk=chunk; s.gran=gran; s.align=align
        s.free={}  # addr->size
        s.bysize=[] # sorted (size,addr)
        s.frontier=0; s.reserved=0; s.hwm=0; s.live=0; s.peaklive=0; s.alloc={}
    def _add(s,a,n):
        # coalesce
        # find prev
        keys=s.addrs
        i=bisect.bisect_left(keys,a)
        if i>0:
            pa=keys[i-1]
            if pa+s.free[pa]==a:
                n+=s.free[pa]; s._rm(pa); a=pa; i-=1
        if i<len(keys) and keys[i]==a+n:
            na=keys[i]; n+=s.free[na]; s._rm(na)
        bisect.insort(keys,a); s.free[a]=n; bisect.insort(s.bysize,(n,a))
    def _rm(s,a):
        n=s.free.pop(a); s.addrs.remove(a); s.bysize.remove((n,a))
    def run(s, ops):
        s.addrs=[]
        for op,k,n in ops:
            if op=='a':
                n=(n+s.align-1)//s.align*s.align
                i=bisect.bisect_left(s.bysize,(n,-1))
                if i==len(s.bysize):
                    # grow: extend the tail free block if it touches frontier
                    tail=0
                    if s.addrs:
                        la=s.addrs[-1]
                        if la+s.free[la]==s.frontier: tail=s.free[la]
                    need=n-tail
                    g=max(s.chunk,(need+s.gran-1)//s.gran*s.gran)
                    s._add(s.frontier,g); s.frontier+=g; s.reserved+=g; s.hwm=max(s.hwm,s.reserved)
                    i=bisect.bisect_left(s.bysize,(n,-1))
                sz,a=s.bysize[i]; s._rm(a)
                if sz>n: s._add(a+n,sz-n)
                s.alloc[k]=(a,n); s.live+=n; s.peaklive=max(s.peaklive,s.live)
            else:
                a,n=s.alloc.pop(k); s.live-=n; s._add(a,n)
        return s
ops=trace(steps=int(sys.argv[1]) if len(sys.argv)>1 else 5000)
livepeak=0;cur=0;sz={}
for op,k,n in ops:
    if op=='a': sz[k]=n; cur+=n; livepeak=max(livepeak,cur)
    else: cur-=sz.pop(k)
print("ops",len(ops),"peak live GiB",livepeak/GiB)
for chunk in [2*MiB, 64*MiB]:
    b=BestFit(chunk).run(ops)
    print("bestfit chunk",chunk//MiB,"MiB: reserved hwm/peak live = %.3f"%(b.hwm/livepeak))
