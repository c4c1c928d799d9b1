"""Which media URLs a request may make an engine fetch.

An engine fetches the URL of a request's image, audio, video or file part itself, from where it
runs: inside the serving network, beside Redis, the gateway's ops listener, the cloud's metadata
service and whatever else trusts that network. vLLM's media connector fetches any http(s) URL it is
given, loopback, private and link-local addresses included, and follows redirects (CVE-2025-6242;
still so by default on main, vLLM #57157: ``--allowed-media-domains`` is empty, i.e. off, unless
set); model processors that fetched by themselves opened any other string as a path on the engine's
host (vLLM PR #43117), and SGLang's loader takes file paths as images too. So a tenant who can send
an image URL can make the engine send GET requests into the network the gateway guards (server-side
request forgery), and learn from the errors and timings what answers there.

The gateway checks every media URL before anything is held or forwarded (`MediaUrls.problem`):

* its scheme is one of ``schemes`` (default ``data``, ``http``, ``https``); a string without one (a
  path), ``file:`` and every other scheme are refused;
* an http(s) URL is written plainly, so that every parser on the way reads the same host:
  ``scheme://host[:port]`` followed by ``/``, ``?``, ``#`` or the end; printable ASCII, no spaces,
  no backslash, no user info (``@``), no percent-escapes before the path; a host of letters, digits,
  ``-``, ``_`` and dots (an international name in its ``xn--`` form) or a bracketed IPv6 address
  without a zone. (WHATWG parsers strip tabs and newlines, read ``\\`` as ``/``, map full-width
  dots to dots and take ``http:/host`` as ``http://host``; others do not, and a URL two parsers read
  differently is how checks like this one are passed.)
* with ``hosts`` set, its host is one of them (``name``, or ``*.name`` for the names under it);
  otherwise, unless ``private_hosts`` is allowed, a public one: an address, in any spelling a
  resolver accepts (``127.1``, ``0x7f.0.0.1``, ``2130706433``, ``0177.0.0.1``,
  ``[::ffff:127.0.0.1]``, the NAT64 and 6to4 forms of one), must be globally routable, and a name
  must not be one that by convention resolves inside a network: a single label (``localhost``,
  ``redis``, a Kubernetes service), or one ending in ``localhost``, ``.local``, ``.internal``,
  ``.localdomain``, ``.lan``, ``.home.arpa``, ``.svc`` or ``.corp``.

Not checked, because the gateway neither resolves names nor does the fetching: a public name that
resolves to a private address (``127.0.0.1.nip.io``, DNS rebinding), and a public URL that redirects
inside. Where tenants are untrusted allow ``data`` alone, or list ``hosts`` that do not redirect, and
start the engine so that it refuses too (vLLM: ``--allowed-media-domains``,
``VLLM_MEDIA_URL_ALLOW_REDIRECTS=0``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

DEFAULT_SCHEMES: tuple[str, ...] = ("data", "http", "https")

# Names that resolve inside a network by convention (RFC 6761 / 6762 / 8375, cloud and cluster DNS).
_PRIVATE_SUFFIXES = (
    ".localhost",
    ".local",
    ".internal",
    ".localdomain",
    ".lan",
    ".home.arpa",
    ".svc",
    ".corp",
)

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
# The authority of a plainly written http(s) URL: a name or a bracketed IPv6 address, then a port.
_AUTHORITY = re.compile(r"(?:([A-Za-z0-9_.-]+)|\[([0-9A-Fa-f:.]+)\])(?::([0-9]{1,5}))?\Z")
_PLAIN = re.compile(r"[\x21-\x7e]*\Z")  # printable ASCII, no space
_IPV4_PART = re.compile(r"(?:0[xX][0-9A-Fa-f]*|0[0-7]*|[1-9][0-9]*)\Z")
_NUMERIC_LABEL = re.compile(r"(?:0[xX][0-9A-Fa-f]*|[0-9]+)\Z")
# IPv6 prefixes that carry an IPv4 address which a translator reaches (RFC 6052 NAT64, RFC 3056 6to4).
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
# ...and the older forms that carry one in their last 32 bits: IPv4-compatible (RFC 4291, ::a.b.c.d;
# deprecated, but a stack may still route it) and IPv4-translated (RFC 2765, ::ffff:0:a.b.c.d).
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_V4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")


@dataclass(frozen=True, slots=True)
class MediaUrls:
    """The media URLs a request may carry (module docstring); config ``pricing.media_urls``."""

    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    hosts: tuple[str, ...] = ()  # when set, the only http(s) hosts allowed: "name" or "*.name"
    private_hosts: bool = False  # True: private addresses and internal names allowed (no `hosts`)
    # The gateway fetches allowed http(s) media itself and sends it inline (gateway/request/media_fetch.py):
    # names resolved once and checked, redirects checked, at most this many bytes within this time.
    fetch: bool = False
    fetch_max_bytes: int = 10 * 1024 * 1024
    fetch_timeout_s: float = 10.0
    # Fetches one tenant may have running at once per process; its others wait (within their
    # timeout) for one of its own, never for another tenant's.
    fetch_per_tenant: int = 16

    def __post_init__(self) -> None:
        for scheme in self.schemes:
            if not _SCHEME.fullmatch(scheme + ":"):
                raise ValueError(f"{scheme!r} is not a URL scheme")
        for host in self.hosts:
            name = host[2:] if host.startswith("*.") else host
            if not name or _AUTHORITY.match(name) is None or ":" in name:
                raise ValueError(f"{host!r} is not a host name or an IPv4 address (or '*.' and a name)")
        object.__setattr__(self, "schemes", tuple(s.lower() for s in self.schemes))
        object.__setattr__(self, "hosts", tuple(h.lower().rstrip(".") for h in self.hosts))

    def problem(self, url: str) -> str | None:
        """None when an engine may fetch ``url``; otherwise why not, in words a client can act on."""
        m = _SCHEME.match(url)
        if m is None:
            return "is not a URL with a scheme (a data: URL or an http(s) URL); paths are not accepted"
        scheme = m.group(1).lower()
        if scheme not in self.schemes:
            allowed = ", ".join(f"{s}:" for s in self.schemes) or "none"
            return f"uses the scheme {scheme}:, which this gateway does not accept (allowed: {allowed})"
        if scheme not in ("http", "https"):
            return None
        if not _PLAIN.match(url) or "\\" in url:
            return "must be plain printable ASCII without spaces or backslashes (encode it)"
        rest = url[m.end() :]
        if not rest.startswith("//"):
            return f"must be written {scheme}://host/..."
        end = len(rest)
        for stop in "/?#":
            i = rest.find(stop, 2)
            if i != -1 and i < end:
                end = i
        authority = rest[2:end]
        if "@" in authority:
            return "must not carry user info ('@') before the host"
        a = _AUTHORITY.match(authority)
        if a is None:
            return "has a host that is not a plain name, address or [IPv6 address] (no '%', no zone)"
        name, v6, port = a.groups()
        if port is not None and int(port) > 65535:
            return "has a port above 65535"
        host = (name or v6).lower()
        if self.hosts:
            if _listed(host[:-1] if host.endswith(".") else host, self.hosts):
                return None
            return f"names the host {host}, which is not one this gateway fetches media from"
        if self.private_hosts:
            return None
        why = _private(host, v6 is not None)
        return None if why is None else f"names {why}: media must come from public hosts"


# Keys whose value names media an engine loads: OpenAI-style content parts (chat, and the multimodal
# score / rerank / pooling requests built from them), Responses parts, SGLang's native /generate.
MEDIA_KEYS = frozenset(
    ("image_url", "audio_url", "video_url", "file_url", "image_data", "audio_data", "video_data")
)


class TooManyElements(Exception):
    """A body with more elements than a walk for media URLs may visit."""


def may_name_media(raw: bytes) -> bool:
    """Whether a JSON body's text may hold a media key: most bodies are skipped at the cost of three
    scans. Every key in `MEDIA_KEYS` ends in ``_url`` or ``_data``, unless a ``\\u`` escape spells a
    character of it (``"image\\u005furl"`` is ``image_url`` to every JSON parser)."""
    return b"_url" in raw or b"_data" in raw or b"\\u" in raw


def media_urls_in(value: object, limit: int) -> list[tuple[str, object]]:
    """(where, URL) of every media reference in a parsed JSON ``value`` of unknown shape: the value
    of a `MEDIA_KEYS` key, a string (or anything else), a list of them, or an object whose ``url`` it
    is. Visits at most ``limit`` elements (0: no bound), else raises `TooManyElements`."""
    return [(where, holder[key]) for where, holder, key in media_refs(value, limit)]


def media_refs(value: object, limit: int) -> list[tuple[str, Any, Any]]:
    """As `media_urls_in`, each reference as (where, holder, key): its value is ``holder[key]``, so
    it can be replaced in place. Iterative: a body nested as deep as JSON allows is no recursion."""
    found: list[tuple[str, Any, Any]] = []
    stack: list[tuple[str, object]] = [("", value)]
    visited = 0
    while stack:
        where, v = stack.pop()
        visited += 1 + len(v) if isinstance(v, dict | list) else 1  # (its elements: each is looked at)
        if limit and visited > limit:
            raise TooManyElements
        if isinstance(v, dict):
            for key, item in v.items():
                at = f"{where}.{key}" if where else str(key)
                if key in MEDIA_KEYS:
                    refs: list[tuple[str, Any, Any]]
                    if isinstance(item, list):
                        refs = [(f"{at}[{i}]", item, i) for i in range(len(item))]
                    else:
                        refs = [(at, v, key)]
                    for here, holder, k in refs:
                        one = holder[k]
                        if isinstance(one, dict):
                            if "url" in one:
                                found.append((f"{here}.url", one, "url"))
                        elif one is not None:
                            found.append((here, holder, k))
                elif isinstance(item, dict | list):
                    stack.append((at, item))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(v) if isinstance(item, dict | list))
    return found


def _listed(host: str, hosts: tuple[str, ...]) -> bool:
    for allowed in hosts:
        if allowed.startswith("*."):
            if host.endswith(allowed[1:]) and len(host) > len(allowed) - 1:
                return True
        elif host == allowed:
            return True
    return False


def _private(host: str, bracketed: bool) -> str | None:
    """Why ``host`` (lower case) is not a public host, or None when it is."""
    if bracketed:
        try:
            v6 = ipaddress.IPv6Address(host)
        except ValueError:
            return f"[{host}], which is not an IPv6 address"
        return _address_problem(v6, f"[{host}]")
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if any(not label for label in labels):
        return f"the host {host}, which has an empty label"
    if _NUMERIC_LABEL.match(labels[-1]):
        # A resolver reads a name ending in a number as an IPv4 address, in any of its spellings.
        v4 = _ipv4(labels)
        if v4 is None:
            return f"the host {host}, which is not a valid address"
        return _address_problem(v4, host)
    if len(labels) == 1:
        return f"the host {host}, a single-label name that resolves inside a network"
    if name == "localhost" or name.endswith(_PRIVATE_SUFFIXES):
        return f"the host {host}, an internal name"
    return None


def _ipv4(labels: list[str]) -> ipaddress.IPv4Address | None:
    """The address inet_aton reads from ``labels`` (1 to 4 parts, decimal, 0x-hex or 0-octal, the
    last filling the bytes the others leave), or None when it reads none."""
    # (A part longer than 16 characters holds no 32-bit number a resolver would take, and a long
    # decimal one would cost int() time, or raise beyond Python's 4,300-digit limit.)
    if len(labels) > 4 or not all(len(p) <= 16 and _IPV4_PART.match(p) for p in labels):
        return None
    values = []
    for p in labels:
        if p[:2] in ("0x", "0X"):
            values.append(int(p[2:] or "0", 16))
        elif len(p) > 1 and p[0] == "0":
            values.append(int(p, 8))
        else:
            values.append(int(p))
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    number = last
    for i, v in enumerate(head):
        number |= v << (8 * (3 - i))
    return ipaddress.IPv4Address(number)


def _address_problem(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, shown: str) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address):
        inner: ipaddress.IPv4Address | None = ip.ipv4_mapped or ip.sixtofour
        carries = (
            ip in _NAT64
            or ip in _NAT64_LOCAL
            or ip in _V4_TRANSLATED
            or (ip in _V4_COMPATIBLE and int(ip) > 1)  # (:: and ::1 are themselves)
        )
        if inner is None and carries:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None and _address_problem(inner, "") is not None:
            return f"{shown}, which carries the private address {inner}"
    if not ip.is_global or ip.is_multicast:
        return f"{shown}, which is not a public address"
    return None


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` is a public address (nor carries a private IPv4 one): what a resolver's answer
    for a media host must be (gateway/request/media_fetch.py)."""
    return _address_problem(ip, "") is None
