"""The one probe of the privilege NVML needs to change clocks and power limits: CAP_SYS_ADMIN in
the process's effective capability set (root on a host has it; root in a container only with
``--cap-add SYS_ADMIN``). The doctor reports it; the energy controller acts on it."""

from __future__ import annotations

#: CAP_SYS_ADMIN's bit in the capability masks of /proc/<pid>/status.
CAP_SYS_ADMIN_BIT = 21
STATUS_FILE = "/proc/self/status"


def parse_cap_sys_admin(status_text: str) -> bool | None:
    """Whether the ``CapEff`` line of a /proc/<pid>/status text holds CAP_SYS_ADMIN; ``None`` when
    the line is absent or garbled (unknown, which callers treat as not granted)."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool((int(line.split(":", 1)[1].strip(), 16) >> CAP_SYS_ADMIN_BIT) & 1)
            except ValueError:
                return None
    return None


def read_cap_sys_admin(path: str = STATUS_FILE) -> bool | None:
    """:func:`parse_cap_sys_admin` of this process's status; ``None`` when it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return parse_cap_sys_admin(handle.read())
    except OSError:
        return None


def may_set_gpu() -> bool:
    """True only when CAP_SYS_ADMIN is known to be granted. A refusal despite it is handled at the
    controller's first set call."""
    return read_cap_sys_admin() is True
