import collections
rows=[l.split() for l in open('/tmp/p24sched2.log')]
series=collections.defaultdict(list); push=collections.defaultdict(list); role_of={}
for r in rows:
    t=float(r[0]); role,pid,tid,comm=r[1],r[2],r[3],r[4]
    series[(role,pid,tid,comm)].append((t,int(r[5]),int(r[6]),int(r[7])))
    role_of[pid]=role
    if comm.startswith('tern-push'): push[pid].append(t)
for spid,ts in push.items():
    a,b=min(ts),max(ts); variant=role_of[spid].split('-')[1]
    out=[]
    for (role,pid,tid,comm),s in series.items():
        if not role.startswith('receive') or not role.endswith(variant): continue
        w=[x for x in s if a<=x[0]<=b]
        if len(w)<2: continue
        run,wait,sl=(w[-1][i]-w[0][i] for i in (1,2,3))
        name = 'main' if tid==pid else comm
        if name in ('main','tern-faults') or (name=='tern' and sl>1000):
            out.append(f"{name}:{pid}/{tid} wakeups {sl} ({sl/(b-a):.0f}/s) cpu {run/1e7/(b-a):.0f}% rq-wait/wakeup {wait/max(sl,1)/1e3:.0f}us")
    print(f"{variant:6} push window {b-a:.2f}s:", '; '.join(sorted(out)))
