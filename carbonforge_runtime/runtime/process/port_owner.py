"""Who listens on a TCP port: the check that the server answering the API port is our own engine.

A ``/health`` answer alone proves only that *something* serves the port. Linux lists every listening
socket with its inode in ``/proc/net/tcp`` and ``/proc/net/tcp6``, and every process's open sockets
as ``socket:[inode]`` links under ``/proc/<pid>/fd``; a listener is the engine's when a process of
the engine's process group holds it. Reads ``/proc`` only; starts nothing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    inode: int


def _address(hex_text: str) -> str:
    """``/proc/net/tcp*`` addresses: IPv4 as one little-endian 32-bit word, IPv6 as four of them."""
    raw = bytes.fromhex(hex_text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listeners(port: int, proc: Path = Path("/proc")) -> list[Listener]:
    """Every socket listening on ``port`` (any address, IPv4 and IPv6) in this network namespace."""
    found: list[Listener] = []
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            address, _, port_hex = fields[1].partition(":")
            if int(port_hex, 16) != port:
                continue
            with contextlib.suppress(ValueError):
                found.append(Listener(_address(address), port, int(fields[9])))
    return found


def _serves(listener: Listener, host: str) -> bool:
    """Whether a connection to ``host`` (as the readiness probe makes it) can reach ``listener``."""
    try:
        wanted = ipaddress.ip_address(host)
        bound = ipaddress.ip_address(listener.address)
    except ValueError:
        return True  # a host name: any listener on the port may be the one it resolves to
    if bound.is_unspecified:
        return True
    if isinstance(bound, ipaddress.IPv6Address) and bound.ipv4_mapped is not None:
        bound = bound.ipv4_mapped
    return bound == wanted


def process_group(pid: int, proc: Path = Path("/proc")) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[2])


def socket_holders(inodes: set[int], proc: Path = Path("/proc")) -> dict[int, set[int]]:
    """inode -> the pids holding it, among the processes whose descriptors this user may read."""
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    holders: dict[int, set[int]] = {inode: set() for inode in inodes}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            names = os.listdir(entry / "fd")
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(entry / "fd" / name)
            except OSError:
                continue
            if target in wanted:
                holders[wanted[target]].add(int(entry.name))
    return holders


def describe_process(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        command = " ".join(raw.split())
    except OSError:
        command = ""
    if len(command) > 160:  # keep both ends: the program, and the script or arguments it was given
        command = f"{command[:70]} ... {command[-85:]}"
    return f"pid {pid} ({command})" if command else f"pid {pid}"


def foreign_listener_problem(port: int, host: str, engine_pgid: int, proc: Path = Path("/proc")) -> str | None:
    """``None`` when every listener ``host:port`` can reach is held by the engine's process group;
    otherwise one sentence saying who else holds the port (or that its holder is not visible)."""
    found = [listener for listener in listeners(port, proc) if _serves(listener, host)]
    if not found:
        return (f"port {port} answered, but no socket listening on it is visible in /proc/net/tcp: the answer "
                "cannot be shown to come from this runtime's vLLM")
    holders = socket_holders({listener.inode for listener in found}, proc)
    ours = {inode for inode, pids in holders.items() if any(process_group(pid, proc) == engine_pgid for pid in pids)}
    others = [listener for listener in found if listener.inode not in ours]
    if not others:
        return None
    strangers = sorted({pid for listener in others for pid in holders[listener.inode]})
    who = ", ".join(describe_process(pid, proc) for pid in strangers) if strangers else \
        "a process whose descriptors this user cannot read"
    if ours:
        return (f"vLLM shares port {port} with another process ({who}), e.g. through SO_REUSEPORT: requests "
                "would be split between them")
    return f"port {port} is served by another process, not by this runtime's vLLM: {who}"
