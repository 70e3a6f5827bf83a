"""A raw HTTP server in a thread, for testing clients against servers that misbehave on the wire:
each connection is handed to a function that writes what it likes (a reply trickled a byte at a
time, a body broken off, a request never read, a reply of any size)."""
import contextlib
import json
import socket
import threading

HEADER_END = b"\r\n\r\n"
ACCEPT_POLL_S = 0.05


class RawServer:
    """State shared with the answering functions: the requests read, and `stop`, set when the
    test leaves (an answer that stalls waits on it)."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.requests = []  # (method, path, body) of each request read
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def count(self, method: str, path: str = None) -> int:
        with self.lock:
            return sum(m == method and (path is None or p == path) for m, p, _ in self.requests)

    def read_request(self, conn):
        """One request from `conn`: (method, path, body); None when the client went away."""
        data = b""
        while HEADER_END not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, body = data.split(HEADER_END, 1)
        lines = head.decode("latin1").split("\r\n")
        method, path = lines[0].split(" ")[:2]
        length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                       if line.lower().startswith("content-length:")), 0)
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            body += chunk
        with self.lock:
            self.requests.append((method, path, body))
        return method, path, body


def reply_bytes(body: bytes, status: str = "200 OK", content_type: str = "application/json", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}"
            "Connection: close\r\n\r\n").encode() + body


def json_reply(value, status: str = "200 OK") -> bytes:
    return reply_bytes(json.dumps(value).encode(), status)


def get_then_post(get_reply: bytes, post_answer):
    """An `answer` for raw_server: each GET gets `get_reply`, each POST is left to `post_answer(server, conn)`."""
    def answer(server, conn):
        request = server.read_request(conn)
        if request is None:
            return
        if request[0] == "GET":
            conn.sendall(get_reply)
        else:
            post_answer(server, conn)
    return answer


def health_then(score_answer):
    """An `answer` for raw_server: GET /health as mm-grpo's reward server answers it, each POST
    `score_answer(server, conn)`."""
    return get_then_post(json_reply({"status": "ok", "rewards": {"r": 1.0}}), score_answer)


@contextlib.contextmanager
def raw_server(answer):
    """Serve on localhost: `answer(server, conn)` handles each connection in a thread of its own.
    Yields the RawServer; on leaving, `stop` is set and every connection closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(ACCEPT_POLL_S)
    server = RawServer(listener.getsockname()[1])
    connections, threads = [], []

    def handle(conn):
        with contextlib.suppress(OSError):
            answer(server, conn)
            conn.shutdown(socket.SHUT_WR)  # the end of a reply without a length

    def accept_loop():
        while not server.stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            connections.append(conn)
            thread = threading.Thread(target=handle, args=(conn,), daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept_loop, daemon=True)
    acceptor.start()
    try:
        yield server
    finally:
        server.stop.set()
        acceptor.join()
        listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        for thread in threads:
            thread.join(timeout=5)
