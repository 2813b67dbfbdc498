"""Free TCP ports on 127.0.0.1 for test servers that need explicitly chosen ports.

Ports are drawn at random from *below* the kernel's ephemeral range (``ip_local_port_range``),
so an outgoing client connection can't grab a server's port while the server is down for a
restart. Every port handed out in this process is remembered and never handed out again.
"""

from __future__ import annotations

import random
import socket
import threading

_LOCK = threading.Lock()
_HANDED_OUT: set[int] = set()
_LOW = 10000  # below this: well-known-ish ports other tools like to use


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if a server could bind host:port now (nothing listens there)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Like the servers do: only a listener (not TIME_WAIT leftovers) makes the port unusable.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError:
        return False
    finally:
        s.close()
    return True


def _os_pick(host: str) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        return int(s.getsockname()[1])
    finally:
        s.close()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports that are free now and were not handed out before in this process."""
    high = _ephemeral_low()
    out: list[int] = []
    with _LOCK:
        if high - _LOW < 1000:  # odd kernel config: fall back to letting the OS choose
            while len(out) < n:
                p = _os_pick(host)
                if p not in _HANDED_OUT and p not in out:
                    out.append(p)
        else:
            rng = random.SystemRandom()
            tries = 0
            while len(out) < n:
                tries += 1
                if tries > 10000:
                    raise RuntimeError(f"could not find {n} free ports in [{_LOW}, {high})")
                p = rng.randrange(_LOW, high)
                if p in _HANDED_OUT or p in out or not port_is_free(p, host):
                    continue
                out.append(p)
        _HANDED_OUT.update(out)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
