import os, time, sys
out = open('/tmp/p24sched.log', 'a')
while True:
    now = time.time()
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            cmd = open(f'/proc/{pid}/cmdline','rb').read().split(b'\0')
        except OSError: continue
        if len(cmd) < 3 or not cmd[0].endswith(b'/tern') or cmd[1] != b'vm' or cmd[2] not in (b'migrate', b'receive'):
            continue
        role = cmd[2].decode()
        try:
            tids = os.listdir(f'/proc/{pid}/task')
        except OSError: continue
        for tid in tids:
            try:
                comm = open(f'/proc/{pid}/task/{tid}/comm').read().strip()
                ss = open(f'/proc/{pid}/task/{tid}/schedstat').read().split()
            except OSError: continue
            out.write(f"{now:.3f} {role} {pid} {tid} {comm} {ss[0]} {ss[1]} {ss[2]}\n")
    out.flush()
    time.sleep(0.05)
