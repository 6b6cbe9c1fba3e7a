#!/usr/bin/env python3
"""Prints a TCP port on 127.0.0.1 that nothing listens on, for a test's MASTER_PORT.

Below the kernel's ephemeral range, never in it: a port from there (what bind(0) gives) can be taken between this
script and rank 0's bind by another process's outgoing connection (the other tests' Gloo ranks connect by the dozen),
or by a rank's own connect() retried while rank 0 is not listening yet, which the kernel may give that very port as
its source and so connect the socket to itself. Either way rank 0 cannot bind it and the test fails by chance.
"""
import random
import socket


def ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def main():
    low, _ = ephemeral_range()
    first = max(1024, low - 12000)
    if low - first < 100:  # no room below the range on this machine: the kernel's choice, with its small risk
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            print(s.getsockname()[1])
        return
    for _ in range(1000):
        port = random.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        print(port)
        return
    raise SystemExit(f"free_port.py: no free port in {first}..{low - 1}")


main()
