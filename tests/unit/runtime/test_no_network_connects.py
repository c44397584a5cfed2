"""The reader of strace's connect() lines that the end-to-end no-network test relies on."""

from __future__ import annotations

from tests.support.connects import connect_lines, is_local


def test_the_connect_classifier() -> None:
    """The parser on strace 6's own spellings, so that the run below cannot pass by misreading them."""
    local = [
        '12 connect(5, {sa_family=AF_INET, sin_port=htons(8000), sin_addr=inet_addr("127.0.0.1")}, 16) = 0',
        '12 connect(5, {sa_family=AF_INET, sin_port=htons(9), sin_addr=inet_addr("127.8.9.1")}, 16 <unfinished ...>',
        '12 connect(6, {sa_family=AF_INET6, sin6_port=htons(1), sin6_flowinfo=htonl(0), '
        'inet_pton(AF_INET6, "::1", &sin6_addr), sin6_scope_id=0}, 28) = -1 ECONNREFUSED',
        '12 connect(6, {sa_family=AF_INET6, sin6_port=htons(1), sin6_flowinfo=htonl(0), '
        'inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr), sin6_scope_id=0}, 28) = 0',
        '12 connect(3, {sa_family=AF_UNIX, sun_path="/var/run/nscd/socket"}, 110) = -1 ENOENT',
        '12 connect(3, {sa_family=AF_NETLINK, nl_pid=0, nl_groups=00000000}, 12) = 0',
    ]
    remote = [
        '12 connect(3, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("8.8.8.8")}, 16) = 0',
        '12 connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.0.0.2")}, 16) = 0',
        '12 connect(6, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), '
        'inet_pton(AF_INET6, "2001:4860:4860::8888", &sin6_addr), sin6_scope_id=0}, 28) = 0',
        '12 connect(6, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), '
        'inet_pton(AF_INET6, "::ffff:1.2.3.4", &sin6_addr), sin6_scope_id=0}, 28) = 0',
        "12 connect(3, 0x7ffd5c1e2a40, 16) = -1 EFAULT",
        '12 connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("127.0.0.53")}, 16) = 0',
    ]
    assert [is_local(line) for line in local] == [True] * len(local)
    assert [is_local(line) for line in remote] == [False] * len(remote)
    assert connect_lines("\n".join([*local, "12 <... connect resumed>) = 0", "13 +++ exited with 0 +++"])) == local
