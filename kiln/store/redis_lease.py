"""A lease in Redis: one holder per key across every process on the store, with a fencing token.

``SET lease NX PX ttl`` claims the key and ``INCR fence`` numbers the claim, in one script so that no claim goes
unnumbered. A thread renews the lease every third of its ttl while the holder works; a holder that dies (kill -9,
a lost host) stops renewing and the lease expires, so a waiter takes over after at most one ttl. A holder that was
only slow (a long pause, a partition) may still believe it holds the key after someone else took over: the fencing
token is what the store checks at commit, so its late commit is refused rather than overwriting the newer one.
Every lease expires: one without an expiry, or with more left than MAX_LEASE_S, is stale and taken over.
"""

import logging
import threading
import time
import uuid

import redis

log = logging.getLogger(__name__)

# The longest lease any holder may take: one found with more time left, or with no expiry at all (written by hand
# or by something other than Kiln), is stale and taken over, so that no lease blocks a key forever.
MAX_LEASE_S = 600.0
# KEYS: lease, fence; ARGV: owner, ttl ms, longest ttl ms. The new fencing token, or nil when someone else holds it.
_ACQUIRE = """
local left = redis.call('PTTL', KEYS[1])
if left == -1 or left > tonumber(ARGV[3]) then
  redis.call('DEL', KEYS[1])
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return false
"""
# KEYS: lease; ARGV: owner, ttl ms. 1 when still ours and extended, 0 when lost.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS: lease; ARGV: owner. Deletes only our own lease, never a successor's.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease:
    """One claim on ``lease_key``: ``acquire()`` waits for it, ``release()`` gives it back; ``token`` is the
    fencing token of this claim and ``lost`` is set once renewal failed for a whole ttl or found another holder."""

    def __init__(self, client: redis.Redis, lease_key: str, fence_key: str, ttl_s: float):
        self.client = client
        self.lease_key = lease_key
        self.fence_key = fence_key
        if not 0 < ttl_s <= MAX_LEASE_S:
            raise ValueError(f"lease ttl {ttl_s} s is outside (0, {MAX_LEASE_S:g}]")
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.owner = uuid.uuid4().hex
        self.token: int | None = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self, deadline: float | None = None) -> int | None:
        """Wait until this claim holds the lease, or until ``deadline`` (time.monotonic()); returns its fencing
        token, or None when the deadline came first. Redis errors propagate."""
        poll_s = min(0.25, self.ttl_ms / 10000)
        while True:
            token = self.client.eval(_ACQUIRE, 2, self.lease_key, self.fence_key, self.owner, self.ttl_ms,
                                     int(MAX_LEASE_S * 1000))
            if token is not None:
                self.token = int(token)
                break
            if deadline is not None and time.monotonic() + poll_s > deadline:
                return None
            time.sleep(poll_s)
        self._renewer = threading.Thread(target=self._renew, name=f"lease {self.lease_key}", daemon=True)
        self._renewer.start()
        return self.token

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        try:
            self.client.eval(_RELEASE, 1, self.lease_key, self.owner)
        except redis.RedisError as exc:  # it expires on its own within one ttl
            log.warning("lease %s: not released (%s); it expires within %.1fs", self.lease_key, exc,
                        self.ttl_ms / 1000)

    def _renew(self) -> None:
        """The renewal thread: extend every third of the ttl; lost once a whole ttl passed without success."""
        last_renewed = time.monotonic()
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if self.client.eval(_RENEW, 1, self.lease_key, self.owner, self.ttl_ms):
                    last_renewed = time.monotonic()
                    continue
                reason = "another holder has it"
            except redis.RedisError as exc:
                if time.monotonic() - last_renewed < self.ttl_ms / 1000:
                    continue
                reason = f"not renewed for a whole ttl: {exc}"
            log.warning("lease %s lost (%s); this holder's commit will be refused", self.lease_key, reason)
            self.lost.set()
            return
