"""Reading strace's ``connect()`` lines: which calls stay on this machine (the no-network test)."""

from __future__ import annotations

import ipaddress
import re

#: Families that never leave the machine.
LOCAL_FAMILIES = {"AF_UNIX", "AF_LOCAL", "AF_NETLINK"}
_FAMILY = re.compile(r"sa_family=(\w+)")
_PORT = re.compile(r"sin6?_port=htons\((\d+)\)")
#: A name lookup: on loopback too, since a local resolver (127.0.0.53, 127.0.0.11) forwards it out.
DNS_PORT = 53
_INET = re.compile(r'inet_addr\("([^"]*)"\)')
_INET6 = re.compile(r'inet_pton\(AF_INET6,\s*"([^"]*)"')


def is_local(line: str) -> bool:
    """Whether the connect() in one strace line targets this machine only."""
    family = _FAMILY.search(line)
    if family is None:
        return False  # an address strace could not decode is not known to be local
    name = family.group(1)
    if name in LOCAL_FAMILIES:
        return True
    found = _INET.search(line) if name == "AF_INET" else _INET6.search(line) if name == "AF_INET6" else None
    port = _PORT.search(line)
    if found is None or (port is not None and int(port.group(1)) == DNS_PORT):
        return False
    try:
        address = ipaddress.ip_address(found.group(1))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def connect_lines(trace: str) -> list[str]:
    """Every connect() call in strace's output (a resumed call repeats no address and is skipped)."""
    return [line for line in trace.splitlines() if "connect(" in line and "resumed>" not in line]
