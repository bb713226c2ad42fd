"""The peer service: one small TCP listener per process that the job's other processes call directly,
not through the coordination service on process 0. Its first message type is the probe
(trainer/cluster/links.py); the peer checkpoint tier adds its own types to the same service.

Port scheme: process I listens on PEER_PORT_BASE + I, PEER_PORT_BASE from the environment, else the
coordinator's port + 1 (launch/local.py, launch/slurm/train.sbatch and launch/k8s/render.py leave it at
that; the Kubernetes NetworkPolicy admits that range from the job's own pods only). A port that is
taken or past 65535 falls back to one the kernel picks, with a warning: every process publishes the
address it really listens on in the coordination service (`peers/I`), so peers still find it where
the network does not filter ports. The address is that of the interface that routes to process 0.

Every connection first proves, both ways, that it belongs to the job: the listener sends MAGIC and a
random nonce, the caller its own nonce and an HMAC-SHA256 of both under the job's secret (job_secret),
the listener its HMAC of both; a connection that fails is closed unanswered and said once per address
(no handler ever sees it). Then one request and its reply, framed alike:
  4 bytes MAGIC, 1 byte message type, 8 bytes payload length (big-endian), then the payload.
A reply's type is the request's | REPLY, or ERROR with a UTF-8 message as its payload. Frames are sent
part by part (a file by sendfile) and a stream handler reads its payload from the socket as it
arrives: the checkpoint tiers' copies (trainer/checkpoint/local.py) are never joined in memory. What
arrives is data, read as data (JSON, raw array bytes), never unpickled.
"""

import errno
import fcntl
import hashlib
import hmac
import json
import os
import select
import socket
import socketserver
import struct
import sys
import threading
import time

import jax

MAGIC = b"TPL1"
_HEADER = struct.Struct("!4sBQ")  # magic, message type, payload length.
PROBE = 1  # Payload {"from": I, "to": J}; the reply {"process": J}.
REPLY = 0x80
ERROR = 0xFF
MAX_PAYLOAD = 1 << 34  # 16 GiB: a bound against a stray connection's garbage length, not a quota.
PORT_BASE_ENV = "PEER_PORT_BASE"
# The job's secret: hex in PEER_SECRET (launch/local.py), else in the file PEER_SECRET_FILE names
# (launch/slurm/train.sbatch, a Kubernetes Secret), else made by process 0 and shared through the
# coordination service (as exposed as that service: docs/concepts/network.md).
SECRET_ENV, SECRET_FILE_ENV = "PEER_SECRET", "PEER_SECRET_FILE"
_NONCE = 32


class PeerError(OSError):
  """A peer that did not answer, or answered with something other than a reply."""


def encode(kind: int, payload: bytes) -> bytes:
  return _HEADER.pack(MAGIC, kind, len(payload)) + payload


def send_frame(sock: socket.socket, kind: int, parts: list, file=None) -> None:
  """One frame of `parts` (bytes-like) and then `file`'s bytes, sent as they are: a copy of the
  checkpoint tiers' shards is never concatenated in memory."""
  size = sum(len(p) for p in parts) + (os.fstat(file.fileno()).st_size if file is not None else 0)
  sock.sendall(_HEADER.pack(MAGIC, kind, size))
  for part in parts:
    sock.sendall(part)
  if file is not None:
    sock.sendfile(file)


def read_to_file(sock: socket.socket, n: int, f) -> None:
  """Writes the next `n` bytes from `sock` to the file `f` at its position (a stream handler's payload).
  On Linux by splice, socket to pipe to page cache, never through this process's memory: one copy of the
  bytes instead of two, and less CPU time, which logical CPU devices would take from the step (measured:
  docs/results.md, 'The checkpoint tiers'); elsewhere, or where the file system cannot take a splice,
  through a buffer."""
  f.flush()
  start = f.tell()
  done = _splice_to_file(sock, n, f.fileno(), start) if hasattr(os, "splice") else 0
  f.seek(start + done)
  buf = memoryview(bytearray(min(n - done, 1 << 20) or 1))
  while done < n:
    k = sock.recv_into(buf, min(n - done, len(buf)))
    if not k:
      raise PeerError(f"connection closed with {n - done} of {n} bytes unread")
    f.write(buf[:k])
    done += k


def _splice_to_file(sock: socket.socket, n: int, fd: int, start: int) -> int:
  """How many of the `n` bytes it wrote: all, or those before the file system refused a splice."""
  r, w = os.pipe()
  try:
    try:
      fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)  # Fewer calls; the default 64 KiB where refused.
    except (OSError, AttributeError):
      pass
    done = 0
    while done < n:
      try:  # A socket with a timeout is non-blocking underneath: wait for it as recv would.
        k = os.splice(sock.fileno(), w, min(n - done, 1 << 20))
      except BlockingIOError:
        if not select.select([sock], [], [], sock.gettimeout())[0]:
          raise PeerError(f"timed out with {n - done} of {n} bytes unread") from None
        continue
      if not k:
        raise PeerError(f"connection closed with {n - done} of {n} bytes unread")
      while k:
        try:
          moved = os.splice(r, fd, k, offset_dst=start + done)
        except OSError as e:
          if e.errno != errno.EINVAL:
            raise
          moved = os.pwrite(fd, os.read(r, k), start + done)  # No splice into this file system.
          if moved == k:
            return done + moved
        done, k = done + moved, k - moved
    return done
  finally:
    os.close(r)
    os.close(w)


def read_exactly(sock: socket.socket, n: int) -> bytearray:
  out = bytearray(n)
  view, at = memoryview(out), 0
  while at < n:
    k = sock.recv_into(view[at:], min(n - at, 1 << 20))
    if not k:
      raise PeerError(f"connection closed with {n - at} of {n} bytes unread")
    at += k
  return out


def read_header(sock: socket.socket) -> tuple[int, int]:
  """(message type, payload length) of the next frame; PeerError on a bad header."""
  magic, kind, length = _HEADER.unpack(read_exactly(sock, _HEADER.size))
  if magic != MAGIC or length > MAX_PAYLOAD:
    raise PeerError(f"not a peer-service frame (magic {magic!r}, length {length})")
  return kind, length


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
  """(message type, payload) of the next frame; PeerError on a bad header."""
  kind, length = read_header(sock)
  return kind, read_exactly(sock, length)


def port_for(process: int, coordinator_port: int) -> int:
  """Where process `process` listens by the scheme (PEER_PORT_BASE + process)."""
  return int(os.environ.get(PORT_BASE_ENV) or coordinator_port + 1) + process


def _proof(secret: bytes, side: bytes, theirs: bytes, ours: bytes) -> bytes:
  return hmac.new(secret, side + theirs + ours, hashlib.sha256).digest()


def _prove_caller(sock: socket.socket, secret: bytes) -> None:
  """The caller's side of the handshake; PeerError where the listener cannot prove it knows the secret."""
  greeting = read_exactly(sock, len(MAGIC) + _NONCE)
  if greeting[: len(MAGIC)] != MAGIC:
    raise PeerError("not a peer service")
  theirs, ours = bytes(greeting[len(MAGIC) :]), os.urandom(_NONCE)
  sock.sendall(ours + _proof(secret, b"caller", theirs, ours))
  try:
    answer = bytes(read_exactly(sock, 32))
  except PeerError:
    raise PeerError("refused at the handshake: the listener holds another secret than this job's") from None
  if not hmac.compare_digest(answer, _proof(secret, b"listener", theirs, ours)):
    raise PeerError("the listener does not hold this job's secret")


def _proves_listener(sock: socket.socket, secret: bytes) -> bool:
  """The listener's side: whether the caller holds the secret (then it is told this side does too)."""
  ours = os.urandom(_NONCE)
  sock.sendall(MAGIC + ours)
  answer = read_exactly(sock, _NONCE + 32)
  theirs = bytes(answer[:_NONCE])
  if not hmac.compare_digest(bytes(answer[_NONCE:]), _proof(secret, b"caller", ours, theirs)):
    return False
  sock.sendall(_proof(secret, b"listener", ours, theirs))
  return True


def request(address: str, kind: int, payload: bytes, timeout_s: float, file=None) -> bytearray:
  """Sends one request (`payload`, then `file`'s bytes) to HOST:PORT and returns the reply's payload;
  PeerError (an OSError) otherwise."""
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
      _prove_caller(sock, job_secret())
      send_frame(sock, kind, [payload], file)
      got, body = read_frame(sock)
  except (OSError, struct.error) as e:
    raise PeerError(f"{address}: {e}") from None
  if got == ERROR:
    raise PeerError(f"{address}: {body.decode(errors='replace')}")
  if got != kind | REPLY:
    raise PeerError(f"{address}: reply of type {got} to a request of type {kind}")
  return body


class _Server(socketserver.ThreadingTCPServer):
  daemon_threads = True  # A caller that hangs holds its own thread only, and never the process's exit.
  allow_reuse_address = True

  def handle_error(self, request, client_address) -> None:
    """One line instead of socketserver's traceback, and nothing while the interpreter shuts down: a
    partner's copy or probe that arrives as this process exits gets no thread ("can't create new thread
    at interpreter shutdown"), and the peer sees the connection close."""
    if not sys.is_finalizing():
      error = sys.exception()
      _warn(f"peer service: a request from {client_address[0]} failed ({type(error).__name__}: {error})")


class PeerService:
  """Listens on `host:port` (0: a port the kernel picks) and answers with `handlers[type](payload)`."""

  def __init__(self, me: int, host: str, port: int, secret: bytes | None = None):
    self.me, secret = me, secret or job_secret()
    self.refused: set[str] = set()  # Addresses whose connections failed the handshake (said once each).
    # type -> handler(payload) -> reply: bytes, or a list of bytes-like parts sent one after another.
    self.handlers = {PROBE: self._answer_probe}
    self.streams = {}  # type -> handler(socket, payload length) -> reply, for payloads too large to hold.
    self.heard: dict[int, float] = {}  # peer -> when its last probe reached us (the link works).
    service = self

    class Handler(socketserver.BaseRequestHandler):
      def handle(self):
        self.request.settimeout(30)
        try:
          proven = _proves_listener(self.request, secret)
        except (OSError, struct.error):
          proven = False
        if not proven:  # Closed unanswered.
          service.refuse(self.client_address[0])
          return
        try:
          kind, length = read_header(self.request)
          if kind in service.streams:  # Reads its own payload from the socket.
            reply = service.streams[kind](self.request, length)
          elif kind in service.handlers:
            reply = service.handlers[kind](read_exactly(self.request, length))
          else:
            self.request.sendall(encode(ERROR, f"unknown message type {kind}".encode()))
            return
          send_frame(self.request, kind | REPLY, reply if isinstance(reply, list) else [reply])
        except (OSError, struct.error, ValueError, KeyError) as e:
          try:
            self.request.sendall(encode(ERROR, str(e).encode()))
          except OSError:
            pass

    self._server = _Server((host, port), Handler)
    self.address = f"{host}:{self._server.server_address[1]}"
    threading.Thread(target=self._server.serve_forever, daemon=True, name="peer-service").start()

  def refuse(self, address: str) -> None:
    if address not in self.refused:
      self.refused.add(address)
      _warn(
        f"peer service of process {self.me}: refused a connection from {address}: it does not hold this "
        f"job's secret (said once per address)"
      )

  def _answer_probe(self, payload: bytes) -> bytes:
    asked = json.loads(payload)
    if asked["to"] != self.me:
      raise ValueError(f"probe for process {asked['to']} reached process {self.me}")
    self.heard[int(asked["from"])] = time.time()
    return json.dumps({"process": self.me}).encode()

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()


def probe(address: str, me: int, peer: int, timeout_s: float) -> None:
  """One probe of `peer` at `address`; PeerError unless process `peer` itself answers."""
  body = request(address, PROBE, json.dumps({"from": me, "to": peer}).encode(), timeout_s)
  if json.loads(body).get("process") != peer:
    raise PeerError(f"{address}: answered by another process ({body[:100]!r})")


def _own_host(coordinator: str) -> str:
  """The address of the interface that routes to the coordinator (a UDP connect sends nothing)."""
  host, port = coordinator.rsplit(":", 1)
  family, _, _, _, where = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
  with socket.socket(family, socket.SOCK_DGRAM) as s:
    s.connect(where)
    return s.getsockname()[0]


_service: list[PeerService | None] = []  # Once started (or failed to), for the rest of the process.


def service() -> PeerService | None:
  """This process's peer service, started and published on the first call; None in a single-process run,
  or where it cannot start (said in a warning: the job runs on without the link probes)."""
  if jax.process_count() == 1:
    return None
  if _service:
    return _service[0]
  from jax._src import distributed

  me = jax.process_index()
  try:
    coordinator = distributed.global_state.coordinator_address
    host, port = _own_host(coordinator), port_for(me, int(coordinator.rsplit(":", 1)[1]))
    try:
      if port > 65535:
        raise OSError(f"port {port} is past 65535")
      started = PeerService(me, host, port)
    except OSError as e:
      started = PeerService(me, host, 0)
      _warn(
        f"the peer service of process {me} cannot listen on {host}:{port} ({e}); it listens on "
        f"{started.address}: peers reach it there unless a firewall admits the scheme's ports only "
        f"(set {PORT_BASE_ENV})"
      )
    distributed.global_state.client.key_value_set(f"peers/{me}", started.address, allow_overwrite=True)
  except Exception as e:  # noqa: BLE001 - no coordinator address, no usable interface: probes off, not the run.
    _warn(f"process {me} runs no peer service ({type(e).__name__}: {e}): links between processes go unprobed")
    _service.append(None)
    return None
  _service.append(started)
  return started


_secret: list[bytes] = []


def job_secret() -> bytes:
  """The job's peer secret (SECRET_ENV, SECRET_FILE_ENV, else process 0's shared through the coordination
  service), read once."""
  if _secret:
    return _secret[0]
  if value := os.environ.get(SECRET_ENV):
    secret = value.encode()
  elif path := os.environ.get(SECRET_FILE_ENV):
    with open(path, "rb") as f:
      secret = f.read().strip()
  else:
    from trainer.cluster import multihost

    if jax.process_index() == 0:
      multihost.client().key_value_set("peer_secret", os.urandom(32).hex(), allow_overwrite=True)
    secret = multihost.client().blocking_key_value_get("peer_secret", 600_000).encode()
  if len(secret) < 16:
    raise ValueError(f"the job's peer secret is {len(secret)} bytes long: at least 16 are needed")
  _secret.append(secret)
  return secret


def _warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr, flush=True)


def addresses() -> dict[int, str]:
  """{process: HOST:PORT} of every peer service published so far."""
  from trainer.cluster import multihost

  rows = multihost.client().key_value_dir_get("peers/")
  return {int(key.rsplit("/", 1)[1]): value for key, value in rows}
