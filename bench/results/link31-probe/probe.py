import socket, threading, time, fcntl, struct, sys, os
SIOCOUTQ = 0x5411
def outq(s):
    return struct.unpack("i", fcntl.ioctl(s.fileno(), SIOCOUTQ, b"\0\0\0\0"))[0]
pkt = int(sys.argv[1]); gap = float(sys.argv[2]); chans = int(sys.argv[3]); dur = 1.5
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(8); port = ls.getsockname()[1]
def reader(c):
    while c.recv(1 << 20): pass
def acc():
    for _ in range(chans):
        c, _ = ls.accept(); threading.Thread(target=reader, args=(c,), daemon=True).start()
threading.Thread(target=acc, daemon=True).start()
res = []
def sender(i):
    s = socket.create_connection(("127.0.0.1", port)); buf = b"x" * pkt
    afters = []; drained = 0; dt = 0.0; emptied = 0; n = 0; qa = None; ta = None; lows = []
    end = time.time() + dur
    while time.time() < end:
        qb = outq(s); tb = time.perf_counter()
        if qa is not None:
            n += 1; lows.append(qb)
            if qb >= 65536:
                drained += qa - qb; dt += tb - ta
            else:
                emptied += 1
        s.sendall(buf); qa = outq(s); ta = time.perf_counter(); afters.append(qa)
        time.sleep(gap)
    lows.sort(); afters.sort(); print(i, "qafter p10 %d median %d p90 %d" % (afters[len(afters)//10], afters[len(afters)//2], afters[9*len(afters)//10]))
    res.append((i, n, emptied, drained / dt / 1e6 if dt else None, dt, lows[len(lows)//2], lows[len(lows)//10], lows[-1]))
ts = [threading.Thread(target=sender, args=(i,)) for i in range(chans)]
[t.start() for t in ts]; [t.join() for t in ts]
for r in res: print("chan %d intervals %d emptied %d drain %s MB/s over %.3fs qbefore median %d p10 %d max %d" % r)
