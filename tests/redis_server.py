"""A real redis-server for tests: a child process on a free loopback port, its data (append-only file) in a temp
directory, so a stop and a start on the same port keep what was committed, as a restarted Redis would."""

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kiln_cli.service_process import free_port

BINARY = shutil.which("redis-server")


def require_redis_server() -> str:
    """The redis-server binary, or a skip that says how to get it."""
    if BINARY is None:
        pytest.skip("redis-server is not installed: .ci/run and the README's test command install it "
                    "(apt-get install redis-server)")
    return BINARY


class RedisServer:
    def __init__(self, data_dir: Path, *extra_args: str, tls: tuple[Path, Path, Path] | None = None):
        """``tls``: (CA, certificate, key) files; the port then speaks TLS only."""
        self.binary = require_redis_server()
        self.tls = tls
        self.data_dir = Path(data_dir).resolve()  # redis-server changes into --dir before it opens --logfile
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        scheme = "redis" if self.tls is None else "rediss"
        return f"{scheme}://127.0.0.1:{self.port}/{db}"

    def start(self, timeout: float = 20.0) -> "RedisServer":
        if self.tls is None:
            ports = ["--port", str(self.port)]
        else:
            ca, cert, key = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert), "--tls-key-file",
                     str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
        argv = [self.binary, "--bind", "127.0.0.1", *ports, "--dir", str(self.data_dir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
                "--logfile", str(self.data_dir / "redis.log"), *self.extra_args]
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self.log_tail()}")
            if self.ping():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout}s: {self.log_tail()}")

    def ping(self) -> bool:
        """True once the server answers (an auth error is an answer: the server is up)."""
        client = self.client(socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        try:
            return bool(client.ping())
        except redis.AuthenticationError:
            return True
        except redis.ResponseError as exc:
            return "NOAUTH" in str(exc)
        except redis.ConnectionError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM: Redis flushes its append-only file and exits."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)

    def client(self, **kwargs) -> redis.Redis:
        if self.tls is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls[0]))
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def log_tail(self) -> str:
        log = self.data_dir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
