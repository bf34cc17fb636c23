"""Which ``Host`` headers the dashboard answers: the guard against DNS rebinding.

Any web page the user visits can point a name of its own at 127.0.0.1 and then read ``http://that-name:8050/``
as its own origin; the requests reach the dashboard with ``Host: that-name:8050``. So the server answers only the
names it was started for: loopback names by default; ``--host`` adds its address (and, for a wildcard such as
0.0.0.0, this machine's names and any IP address: a rebinding page always uses a name); ``--allow-host NAME``
adds a name (``*``: any, e.g. behind a proxy that checks names itself). The port is not checked: an SSH tunnel
serves the dashboard on another local port, and a rebinding attack changes the name, not the port.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

ANY = "*"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
_PORT = re.compile(r"[0-9]{1,5}")


def hostname(value: str | None) -> str | None:
    """The name of a Host header (``name``, ``name:port``, ``[v6]:port``) in lower case, without port or final
    dot; None when it is not a host name or IP address."""
    value = (value or "").strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and _PORT.fullmatch(rest[1:]))):
            return None
        return name if _ip(name) is not None and ":" in name else None
    name, sep, port = value.partition(":")
    if (sep and not _PORT.fullmatch(port)) or not _NAME.fullmatch(name):
        return None
    return name.rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """localhost (and ``*.localhost``, which browsers resolve to loopback themselves) or a loopback address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    ip = _ip(name)
    return ip is not None and ip.is_loopback


@dataclass(frozen=True)
class HostPolicy:
    """The names a server answers: ``names`` (plus loopback), any IP address when ``any_ip``, anything when
    ``names`` holds ``*``."""

    names: frozenset[str] = frozenset(LOOPBACK_NAMES)
    any_ip: bool = False

    def allows(self, header: str | None) -> bool | None:
        """True or False for a Host header; None when the header is malformed."""
        name = hostname(header)
        if name is None:
            return None
        return ANY in self.names or name in self.names or is_loopback(name) or (self.any_ip and _ip(name) is not None)

    def shown(self) -> str:
        return ", ".join(sorted(self.names)) + (", any IP address" if self.any_ip else "")


def for_bind(host: str, allow: tuple[str, ...] = ()) -> HostPolicy:
    """The policy of a server bound to ``host`` with ``--allow-host`` names ``allow``."""
    bind = host.strip("[]").lower()
    names = set(LOOPBACK_NAMES) | {n for a in allow if (n := ANY if a.strip() == ANY else hostname(a)) is not None}
    if is_loopback(bind):
        return HostPolicy(frozenset(names))
    if bind in WILDCARDS:
        names |= {n.lower() for n in (socket.gethostname(), socket.getfqdn()) if n}
    else:
        names.add(bind)
    return HostPolicy(frozenset(names), any_ip=True)
