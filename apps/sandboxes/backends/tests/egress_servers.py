"""Run inside the test's 'internet' netns: TCP listeners that answer with their own
address, UDP ones on the same addresses and ports that answer each datagram so, and
(on .2:53, UDP and TCP) an authoritative server for a test zone.

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


def zone(net: str) -> dict[str, tuple[str, int]]:
    """name -> (address, ttl): .2 serves allowed/cdn names, .3 the blocked one, .4 the
    wildcard zone and the short-lived name."""
    a, b, c = f"{net}.2", f"{net}.3", f"{net}.4"
    return {
        "allowed.test": (a, 300),
        "cdn-shared.test": (a, 300),
        "other-cdn.test": (a, 300),
        "blocked.test": (b, 300),
        "wild.test": (c, 300),
        "short.test": (c, 1),
        # answers no resolver may open: a link-local ("metadata") and the host's address
        "evil.test": (f"169.254.216.{net.rsplit('.', 1)[1]}", 300),
        "hostaddr.test": (f"{net}.1", 300),
    }


def dns_server(net: str) -> None:
    import dns.message
    import dns.rcode
    import dns.rdatatype
    import dns.rrset

    names = zone(net)

    def answer(wire: bytes) -> bytes:
        query = dns.message.from_wire(wire)
        response = dns.message.make_response(query)
        q = query.question[0]
        name = q.name.to_text(omit_final_dot=True).lower()
        hit = names.get(name) or (names["wild.test"] if name.endswith(".wild.test") else None)
        if hit is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif q.rdtype == dns.rdatatype.A:
            response.answer.append(dns.rrset.from_text(q.name, hit[1], "IN", "A", hit[0]))
        elif q.rdtype == dns.rdatatype.TXT:
            response.answer.append(dns.rrset.from_text(q.name, 60, "IN", "TXT", '"zone"'))
        return bytes(response.to_wire())

    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((f"{net}.2", 53))

    def serve_udp() -> None:
        while True:
            data, addr = udp.recvfrom(65535)
            try:
                udp.sendto(answer(data), addr)
            except Exception:
                pass

    threading.Thread(target=serve_udp, daemon=True).start()


def udp(addr: str, port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind((addr, port))

    def serve() -> None:
        while True:
            _, peer = srv.recvfrom(65535)
            try:
                srv.sendto(f"hello {addr}:{port}\n".encode(), peer)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()


def main() -> None:
    dns_server(sys.argv[1])
    for target in sys.argv[2:]:
        addr, port = target.rsplit(":", 1)
        tcp(addr, int(port))
        udp(addr, int(port))
    print("ok", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
