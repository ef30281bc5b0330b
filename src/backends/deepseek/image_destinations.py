"""Where an image URL may be fetched from: the destination filter deepseek-recipe's fetcher needs against SSRF.

``ReqwestImageFetcher`` connects to any address unless it is given ``with_destination_filter(fn)``; the library
calls ``fn(host, address)`` for the URL's host and for every redirect target, once per resolved address, and
connects only to the addresses it allows. ``ImageDestinations`` is that rule: the host must be on the operator's
allowlist, and the address must be a public unicast one (not loopback, private, shared, link-local, multicast,
reserved or unspecified, nor a cloud metadata address), whatever its spelling: an IPv4 address inside IPv6
(``::ffff:127.0.0.1``, ``::127.0.0.1``, 6to4, NAT64) is judged as the IPv4 address, and a host written as a number
(``2130706433``, ``0177.0.0.1``, ``0x7f.1``) is read as the address it spells before the allowlist is consulted.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from deepseek_recipe import ReqwestImageFetcher

METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean instance metadata
        "169.254.170.2",  # AWS ECS task metadata
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud
        "fd00:ec2::254",  # AWS over IPv6
    )
)
"""Cloud metadata endpoints, refused even where their range would not be (100.64/10 and 192.0.0/24 are refused
anyway, as shared and reserved space; the list keeps the rule explicit)."""

_NAT64 = ipaddress.ip_network("64:ff9b::/96")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def embedded_ipv4(address: IpAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, 6to4, NAT64), if any."""
    if isinstance(address, ipaddress.IPv4Address):
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if int(address) >> 32 == 0 and int(address) > 1:  # IPv4-compatible ::a.b.c.d (deprecated, still routed by some)
        return ipaddress.IPv4Address(int(address))
    return None


def is_public(address: IpAddress) -> bool:
    """Whether an address is one a fetch may reach: global unicast and no metadata endpoint, in any spelling."""
    inner = embedded_ipv4(address)
    for candidate in (address, inner):
        if candidate is None:
            continue
        if candidate in METADATA_ADDRESSES or not candidate.is_global or candidate.is_multicast:
            return False
    return True


def numeric_host(host: str) -> IpAddress | None:
    """The address a host spells as a number, in any form a URL parser or ``inet_aton`` accepts: dotted with one to
    four parts, each decimal, octal (leading 0) or hexadecimal (0x); or an IPv6 literal, bracketed or not."""
    text = host.strip().rstrip(".").lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values: list[int] = []
    for part in parts:
        try:
            if part.startswith("0x"):
                values.append(int(part[2:] or "0", 16))
            elif len(part) > 1 and part.startswith("0"):
                values.append(int(part[1:], 8))
            else:
                values.append(int(part, 10))
        except ValueError:
            return None
    *head, last = values
    if any(v > 0xFF for v in head) or last >= 1 << (8 * (5 - len(values))):
        return None
    number = last
    for position, value in enumerate(head):
        number |= value << (8 * (3 - position))
    return ipaddress.IPv4Address(number)


class ImageDestinations:
    """The destination filter: allowlisted hosts, public addresses only (``fn(host, address) -> bool``)."""

    def __init__(self, allowed_hosts: Iterable[str]) -> None:
        """``allowed_hosts``: exact host names, or ``*.example.com`` for any subdomain of ``example.com``."""
        exact: set[str] = set()
        suffixes: list[str] = []
        for entry in allowed_hosts:
            name = entry.strip().rstrip(".").lower()
            if name.startswith("*."):
                suffixes.append(name[1:])
            elif name:
                exact.add(name)
        self._exact = frozenset(exact)
        self._suffixes = tuple(suffixes)

    def allows_host(self, host: str) -> bool:
        """Whether a URL's (or redirect's) host is on the allowlist; a host spelling an address must be public too."""
        spelled = numeric_host(host)
        if spelled is not None and not is_public(spelled):
            return False
        name = host.strip().rstrip(".").lower()
        return name in self._exact or any(name.endswith(suffix) for suffix in self._suffixes)

    def __call__(self, host: str, address: str) -> bool:
        if not self.allows_host(host):
            return False
        try:
            resolved = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
        except ValueError:
            return False
        return is_public(resolved)


def remote_image_fetcher(destinations: ImageDestinations, max_bytes: int) -> ReqwestImageFetcher:
    """deepseek-recipe's fetcher bounded to ``max_bytes`` per image, connecting only where ``destinations`` allow
    (at the URL's host and at every redirect target, for each resolved address) and through no proxy."""
    return ReqwestImageFetcher.with_max_bytes(max_bytes).with_destination_filter(destinations)
