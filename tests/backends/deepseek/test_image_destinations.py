"""The image destination filter: deepseek-recipe's real fetcher, given it, never connects to a private address,
whatever the spelling, while a listener on 127.0.0.1 counts every connection it would have made."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from deepseek_recipe import ImageError, ReqwestImageFetcher

from backends.deepseek.image_destinations import ImageDestinations, is_public, numeric_host, remote_image_fetcher


class CountingListener:
    """A TCP listener on 127.0.0.1 that accepts and counts connections (and answers nothing)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[CountingListener]:
    running = CountingListener()
    yield running
    running.close()


SPELLINGS = (
    "127.0.0.1",
    "localhost",
    "2130706433",  # decimal
    "0177.0.0.1",  # octal
    "0x7f.0.0.1",  # hexadecimal
    "0x7f.1",  # two parts
    "127.1",
    "[::ffff:127.0.0.1]",  # IPv4-mapped
    "[::ffff:7f00:1]",
)


@pytest.mark.parametrize("host", SPELLINGS)
def test_the_filtered_fetcher_never_connects_to_loopback_in_any_spelling(listener: CountingListener, host: str) -> None:
    # Every spelling is on the allowlist: only the address rule stands between the fetcher and the listener.
    allowed = ImageDestinations([host.strip("[]"), host])
    fetcher = remote_image_fetcher(allowed, max_bytes=1 << 20)
    with pytest.raises(ImageError):
        fetcher.fetch(f"http://{host}:{listener.port}/image.png")
    assert listener.accepted == 0


def test_without_the_filter_the_fetcher_does_connect(listener: CountingListener) -> None:
    """The listener sees what an unfiltered fetcher does: the test above would notice a filter that let it through."""
    with pytest.raises(ImageError):  # the listener answers nothing: the fetch fails after connecting
        ReqwestImageFetcher.with_max_bytes(1 << 20).fetch(f"http://127.0.0.1:{listener.port}/image.png")
    assert listener.accepted == 1


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",  # shared address space (carrier-grade NAT)
        "169.254.169.254",  # cloud metadata
        "169.254.170.2",
        "100.100.100.200",
        "192.0.0.192",
        "0.0.0.0",
        "224.0.0.1",
        "239.255.255.250",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "fd00:ec2::254",
        "ff02::1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
    ],
)
def test_private_and_metadata_addresses_are_refused_for_an_allowed_host(address: str) -> None:
    assert not ImageDestinations(["images.example.com"])("images.example.com", address)


def test_a_public_address_of_an_allowed_host_is_let_through() -> None:
    destinations = ImageDestinations(["images.example.com", "*.cdn.example.org"])
    assert destinations("images.example.com", "93.184.215.14")
    assert destinations("a.b.cdn.example.org", "2606:2800:21f:cb07:6820:80da:af6b:8b2c")
    assert destinations("IMAGES.example.com.", "93.184.215.14")  # case and the root dot do not matter


def test_hosts_off_the_allowlist_are_refused_even_at_public_addresses() -> None:
    destinations = ImageDestinations(["images.example.com", "*.cdn.example.org"])
    for host in ("example.com", "evil.com", "images.example.com.evil.com", "cdn.example.org", "xcdn.example.org"):
        assert not destinations(host, "93.184.215.14"), host
    assert not ImageDestinations([])("images.example.com", "93.184.215.14")


def test_numeric_hosts_are_read_as_the_address_they_spell() -> None:
    assert numeric_host("2130706433") == numeric_host("0177.0.0.1") == numeric_host("0x7f.1") == numeric_host("127.1")
    assert str(numeric_host("0x7f.1")) == "127.0.0.1"
    assert str(numeric_host("[::ffff:7f00:1]")) == "::ffff:7f00:1"
    assert numeric_host("images.example.com") is None and numeric_host("1.2.3.4.5") is None
    assert numeric_host("256.1.1.1") is None and numeric_host("08.1.1.1") is None


def test_public_means_global_unicast_in_every_spelling() -> None:
    import ipaddress

    assert is_public(ipaddress.ip_address("93.184.215.14"))
    assert not is_public(ipaddress.ip_address("::ffff:127.0.0.1"))
    assert not is_public(ipaddress.ip_address("::127.0.0.1"))  # IPv4-compatible
