"""A port for a launch script's MASTER_PORT, free now and unlikely to be taken before torchrun binds it."""
import random
import socket

# Where the kernel picks ports for bind(0) and outgoing connections (Linux's default range when
# /proc cannot say): a port from there, freed and handed on, can be taken by any process's next
# connection before torchrun binds it. Below it only a process that names a port can take one.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL = (32768, 60999)
LOWEST = 10000  # below: well-known and registered services


def ephemeral_range() -> tuple:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def free_port(tries: int = 100) -> int:
    """A random port outside the kernel's ephemeral range that 127.0.0.1 can bind now."""
    low, _ = ephemeral_range()
    for port in random.sample(range(LOWEST, max(low, LOWEST + tries)), tries):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among {tries} tried below {low}")
