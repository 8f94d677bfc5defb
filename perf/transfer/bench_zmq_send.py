"""What one ZMQ message costs on this machine: a DEALER sends small messages over loopback TCP to a
ROUTER drained by another thread, back to back and with an idle millisecond before each (the
case of a paced engine: every message wakes ZMQ's I/O thread and the receiver from sleep).
Reports the sending thread's CPU per send and the whole process's CPU per message (sender, ZMQ
I/O threads and receiver). Writes perf/results/zmq_send.md.

    .venv/bin/python perf/transfer/bench_zmq_send.py
"""

from __future__ import annotations

import os
import threading
import time

import zmq

N = 2000
PAYLOAD = [b"\x08", b"\x91\x01"]  # a Credit message's frames


def measure(gap_s: float) -> tuple[float, float]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    got = 0
    done = threading.Event()

    def drain() -> None:
        nonlocal got
        while got < N + 1:
            router.recv_multipart()
            got += 1
        done.set()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    dealer.send_multipart(PAYLOAD)  # connect and warm up
    time.sleep(0.2)
    thread_cpu = 0.0
    p0 = time.process_time()
    for _ in range(N):
        c0 = time.thread_time()
        dealer.send_multipart(PAYLOAD, flags=zmq.NOBLOCK)
        thread_cpu += time.thread_time() - c0
        if gap_s:
            time.sleep(gap_s)
    if not done.wait(10):
        raise RuntimeError("the receiver did not get every message")
    process_cpu = time.process_time() - p0
    dealer.close(linger=0)
    router.close(linger=0)
    ctx.term()
    return thread_cpu / N * 1e6, process_cpu / N * 1e6


def main() -> None:
    rows = []
    for gap in (0.0, 0.001):
        send_us, proc_us = measure(gap)
        rows.append((gap, send_us, proc_us))
        print(f"idle before each send {gap * 1e3:.0f} ms: sending thread {send_us:.1f} µs/send, "
              f"process {proc_us:.1f} µs/message")
    out = os.path.join(os.path.dirname(os.path.dirname(__file__)), "results", "zmq_send.md")
    with open(out, "w") as f:
        f.write("# One ZMQ message on this machine (perf/transfer/bench_zmq_send.py)\n\n")
        f.write(f"{N} NOBLOCK sends DEALER -> ROUTER over loopback TCP, receiver in a thread of "
                f"the same process; pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
                f"{os.cpu_count()} CPUs.\n\n")
        f.write("| idle before each send | sending thread CPU per send | process CPU per message "
                "(sender + ZMQ I/O threads + receiver) |\n|---|---:|---:|\n")
        for gap, send_us, proc_us in rows:
            f.write(f"| {gap * 1e3:.0f} ms | {send_us:.1f} µs | {proc_us:.1f} µs |\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
