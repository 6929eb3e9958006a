"""Run inside the test's 'internet' netns: TCP listeners that answer with their own
address, and (on .2:53, UDP and TCP) an authoritative server for a test zone.

argv: <the /24's first three octets> <ip:port>...  Prints "ok" once everything listens.
"""

from __future__ import annotations

import socket
import sys
import threading


def tcp(addr: str, port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(64)

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            try:
                conn.sendall(f"hello {addr}:{port}\n".encode())
            except OSError:
                pass
            conn.close()

    threading.Thread(target=serve, daemon=True).start()


def main() -> None:
    for target in sys.argv[2:]:
        addr, port = target.rsplit(":", 1)
        tcp(addr, int(port))
    print("ok", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
