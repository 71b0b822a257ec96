"""A DNS server on a loopback UDP port whose A records a test changes while it runs: gRPC's resolver asks it when a
target names it as the authority (``dns://127.0.0.1:PORT/name:port``), so a test sees what a client of a
Kubernetes headless Service sees when a replica is added, without touching the machine's resolver."""

import socket
import struct
import threading

A, IN = 1, 1


class DnsServer:
    """Answers A queries for the names in ``records`` (name -> IPv4 addresses, changed at will), no records for
    other types of those names (AAAA, TXT), NXDOMAIN for any other name."""

    def __init__(self, records: dict[str, list[str]]):
        self.records = records
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self._socket.settimeout(0.1)
        self.queries: list[tuple[str, int]] = []  # (name, type) of each query, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, client = self._socket.recvfrom(512)
            except TimeoutError:
                continue
            self._socket.sendto(self._answer(query), client)

    def _answer(self, query: bytes) -> bytes:
        (ident,) = struct.unpack("!H", query[:2])
        labels, offset = [], 12
        while query[offset]:
            length = query[offset]
            labels.append(query[offset + 1:offset + 1 + length].decode().lower())
            offset += 1 + length
        qtype, _ = struct.unpack("!HH", query[offset + 1:offset + 5])
        question = query[12:offset + 5]
        name = ".".join(labels)
        self.queries.append((name, qtype))
        addresses = self.records.get(name)
        if addresses is None:
            return struct.pack("!HHHHHH", ident, 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
        answers = [] if qtype != A else addresses
        # Each answer points at the question's name (offset 12), TTL 0: never cached.
        records = b"".join(struct.pack("!HHHIH", 0xC00C, A, IN, 0, 4) + socket.inet_aton(a) for a in answers)
        return struct.pack("!HHHHHH", ident, 0x8180, 1, len(answers), 0, 0) + question + records

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
