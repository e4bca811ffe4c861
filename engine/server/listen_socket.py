"""The listening socket of every HTTP server here (the engine's, the router's, the digest's web
view), bound before the server's slow start so that a port in use or a bad host fails at once,
in one line."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int, *, inheritable: bool = False) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); OSError names the address.
    inheritable: for a server whose worker processes accept on it too."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(inheritable)
    return sock
