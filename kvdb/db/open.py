"""Opening a Db directory: the lock, the key secret, the manifest, recovery steps, the options.

Data directory
    PATH/LOCK           an exclusive ``flock`` held while a Db has PATH open (any process, any
                        thread); taken without waiting: DbLockedError when someone holds it.
                        The holder also sets an OFD write lock on the file, which only says
                        "in use": ``lock_is_held`` asks for it with F_OFD_GETLK and so never
                        takes a lock itself (a probe that took one, even shared, made a
                        concurrent open fail). The file itself is empty and stays.
    PATH/KEY_SECRET     32 random bytes (mode 0600) made at the first open when no
                        ``key_secret`` is given: salts tenant namespaces (kvdb/keys.py); sealed
                        under the encryption key when the store has one (kvdb/format/secret.py).
                        The manifest records an HMAC id of the secret, never the secret.
    PATH/MANIFEST.json  layout, model id, key parameters, store id (kvdb/format/manifest.py)
    PATH/wal/, PATH/index/  the cold tier (kvdb/cold/), when the disk tier is enabled
    PATH/replication/   replication's state; a re-seed's swap files (kvdb/format/swap.py)

Open, in order (``Db.__init__``), each step under the lock
    1. take the lock;
    2. roll an interrupted re-seed swap forward or drop it (``finish_swap_locked``, RS1);
    3. read the manifest, load (or make) the key secret -- a new directory writes one from
       ``layout`` and ``model_id``, an existing one must match what the caller passes; a log
       without a manifest, or an existing store without its KEY_SECRET (and no ``key_secret=``),
       is refused before anything is written;
    4. build the pool, the planner and the mover, then open the cold tier (which recovers its
       log and checks the store id of its index and segments: kvdb/cold/); a plain KEY_SECRET
       of an encrypted store is sealed once the disk tier has accepted the key.
A failure at any step drops the lock and raises; nothing the steps wrote is half made (the
manifest and the secret are written atomically, the swap rolls forward from any step).

A ``read_only`` open (inspection: ``kvdb stats``, ``verify``) writes nothing and takes no lock:
no step 1 or 2, the manifest must exist, the secret is read if there (else no keys: ``NoKeys``),
and the cold tier opens read-only (kvdb/cold/store.py).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import math
import os
import secrets
import shutil
import struct
from pathlib import Path
from typing import Callable

import torch

from kvdb.buffer_pool.arena import cuda_available
from kvdb.buffer_pool.replacer import Replacer
from kvdb.cold.store import ColdStore, check_space_amp
from kvdb.errors import CorruptionError, DbLockedError, InvalidInput, NotFound
from kvdb.format.layout import BlockLayout
from kvdb.cold.codec import Sealer, read_key_file
from kvdb.format.manifest import MANIFEST_NAME, STORE_ID_BYTES, read_manifest, store_id_of, write_manifest
from kvdb.format.record import parse_segment_name
from kvdb.format.secret import KEY_SECRET_NAME, SEALED_AAD, SEALED_MAGIC, encode_sealed
from kvdb.format.secret import decode as decode_secret
from kvdb.format.swap import APPLIED_NAME, ASIDE_DIR, MOVED, REPLICATION_DIR, STAGING_DIR, SWAP_MARKER
from kvdb.fs import OsFs, write_file_atomic
from kvdb.keys import KeySpace
from kvdb.sizes import parse_size
from kvdb.planner import make_policy
from kvdb.planner.policies import REPLAY_ONLY
from kvdb.types import DURABILITIES

LOCK_NAME = "LOCK"


# ---------------------------------------------------------------------- the lock

def _ofd(cmd: str, fd: int, ltype: int) -> int | None:
    """An OFD lock call (``cmd``: "F_OFD_SETLK" or "F_OFD_GETLK") on the whole file: the l_type
    it answers, None where the platform has no OFD locks."""
    op = getattr(fcntl, cmd, None)
    if op is None:
        return None
    try:
        got = fcntl.fcntl(fd, op, _FLOCK.pack(ltype, os.SEEK_SET, 0, 0, 0))
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            return None
        raise
    return _FLOCK.unpack(got)[0]


_FLOCK = struct.Struct("@hhqqi4x")  # l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)


def take_lock(path: Path, busy: str | None = None) -> int:
    """Take PATH/LOCK; its fd (release with ``drop_lock``). DbLockedError when held."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DbLockedError(busy or f"{path} is already open (another process or another Db in this one); "
                            "close it first or use a different path") from None
    try:
        _ofd("F_OFD_SETLK", fd, fcntl.F_WRLCK)  # the "in use" mark lock_is_held reads
    except OSError:
        pass  # only a mark: the flock above is what excludes
    return fd


def lock_is_held(path) -> bool:
    """Whether a Db (any process) has PATH open now; takes nothing and writes nothing, so it
    never makes a concurrent ``take_lock`` fail (F_OFD_GETLK; where the platform lacks OFD
    locks, a non-blocking shared ``flock`` probe)."""
    try:
        fd = os.open(Path(path) / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        got = _ofd("F_OFD_GETLK", fd, fcntl.F_WRLCK)
        if got is not None:
            return got != fcntl.F_UNLCK
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


def drop_lock(fd: int) -> None:
    try:
        _ofd("F_OFD_SETLK", fd, fcntl.F_UNLCK)  # the mark first: a next holder's mark then sticks
    except OSError:
        pass
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


# ---------------------------------------------------------------------- the re-seed swap (RS1)

def finish_swap(path) -> bool:
    """Finish or drop an interrupted re-seed of the Db directory ``path`` (RS1): roll the swap
    forward when its marker is there (True), else delete a leftover staging copy (False).
    Takes the directory's lock meanwhile (DbLockedError while a Db has it open)."""
    path = Path(path)
    rep = path / REPLICATION_DIR
    if not any((rep / n).exists() for n in (SWAP_MARKER, STAGING_DIR, ASIDE_DIR)):
        return False
    fd = take_lock(path, f"{path} is open in a Db; a re-seed swap runs only while it is closed")
    try:
        return finish_swap_locked(path)
    finally:
        drop_lock(fd)


def finish_swap_locked(path) -> bool:
    """``finish_swap`` for a caller that already holds the directory's lock (``Db`` open)."""
    path = Path(path)
    rep = path / REPLICATION_DIR
    staging, aside, marker = rep / STAGING_DIR, rep / ASIDE_DIR, rep / SWAP_MARKER
    if not (marker.exists() or staging.exists() or aside.exists()):
        return False
    fs = OsFs()
    if not marker.exists():
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
        return False
    aside.mkdir(exist_ok=True)
    for name in MOVED:
        src, cur = staging / name, path / name
        if not src.exists():
            if not (aside / name).exists():  # moved in puts the old one aside first: the copy lost it
                raise CorruptionError(f"{path}: the sealed re-seed copy has no {name}/ and it was never moved in; "
                                      f"remove {rep / SWAP_MARKER} and {staging} to keep the old state")
            continue  # moved in before the crash
        if cur.exists():
            if (aside / name).exists():
                shutil.rmtree(cur)  # made by someone who opened the half-swapped directory
            else:
                os.rename(cur, aside / name)
        os.rename(src, cur)
    src = staging / REPLICATION_DIR / APPLIED_NAME
    if src.exists():
        os.replace(src, rep / APPLIED_NAME)
    fs.sync_dir(str(path))
    fs.sync_dir(str(rep))
    marker.unlink()
    fs.sync_dir(str(rep))
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    return True


# ---------------------------------------------------------------------- secret and manifest

def key_secret_id(secret: bytes) -> str:
    return hmac.new(secret, b"kvdb key secret id", hashlib.sha256).hexdigest()[:32]


def early_sealer(encryption_key_file, disk_bytes) -> Sealer | None:
    """The encryption key's Sealer, read before the manifest: a sealed KEY_SECRET opens under it
    (kvdb/format/secret.py). The disk tier checks the key against its own key check later."""
    if encryption_key_file is None:
        return None
    if disk_bytes == 0:
        raise InvalidInput("encryption_key_file needs the disk tier (disk_bytes != 0)")
    return Sealer(read_key_file(encryption_key_file))


def holds_log(path: Path) -> bool:
    """Whether PATH has a disk tier's files (a log segment, or an index)."""
    wal, index = path / "wal", path / "index"
    try:
        if any(parse_segment_name(n) is not None for n in os.listdir(wal)):
            return True
    except (FileNotFoundError, NotADirectoryError):
        pass
    return (index / "CURRENT").exists()


class Secret:
    """The directory's key secret as loaded: ``value`` (None: read-only without it), and
    ``seal_later``: a plain KEY_SECRET of an encrypted store, sealed once the disk tier has
    accepted the key (``seal_plain_file``)."""

    def __init__(self, value: bytes | None, seal_later: bool = False) -> None:
        self.value = value
        self.seal_later = seal_later


def load_secret(path: Path, key_secret: bytes | None, read_only: bool = False, sealer: Sealer | None = None,
                existing: bool = False) -> Secret:
    """The caller's secret, else PATH/KEY_SECRET (opened under ``sealer`` when sealed), made on
    first use (never when ``read_only``; never for an ``existing`` store: a missing file there is
    an error naming it). Caller holds the lock (or opens read-only)."""
    p = path / KEY_SECRET_NAME
    if key_secret is not None:
        if not isinstance(key_secret, (bytes, bytearray)) or len(key_secret) < 16:
            raise InvalidInput("key_secret must be at least 16 bytes")
        # the same secret lying plain in the file of an encrypted store is sealed all the same
        plain = sealer is not None and not read_only and p.exists() and p.read_bytes() == bytes(key_secret)
        return Secret(bytes(key_secret), seal_later=plain)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        if read_only:
            return Secret(None)  # made with an explicit key_secret: inspection works without keys (NoKeys)
        if existing:
            raise InvalidInput(f"{p} is missing: {path} holds blocks keyed with a key secret that is neither in "
                               f"that file nor passed as key_secret=; restore {p} from a backup, or pass the "
                               "store's key_secret= (nothing was written)") from None
        secret = secrets.token_bytes(32)
        data = secret if sealer is None else encode_sealed(sealer.seal(secret, SEALED_AAD))
        write_file_atomic(p, data, mode=0o600)  # we hold the directory lock: no race
        return Secret(secret)
    sealed, body = decode_secret(raw, str(p))
    if not sealed:
        return Secret(body, seal_later=sealer is not None and not read_only)
    if sealer is None:
        if read_only:
            return Secret(None)  # inspection without the key: stats and verify need no keys
        raise InvalidInput(f"{path} is encrypted ({p} is sealed under its encryption key): "
                           "open it with encryption_key_file=")
    try:
        return Secret(sealer.open(body, SEALED_AAD))
    except CorruptionError:
        raise InvalidInput(f"the encryption key does not match the one {path} was created with "
                           f"({p} does not open under it)") from None


def read_key_secret_file(path) -> bytes:
    """A cluster's key secret file (docs/replication.md, "One key namespace per cluster"): its bytes
    are the secret, as passed to ``kvdb.open(key_secret=)`` (at least 16; a plain PATH/KEY_SECRET of
    a store without encryption is one). InvalidInput naming the file otherwise."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise InvalidInput(f"cannot read key secret file {path}: {e.strerror or e}") from None
    if raw.startswith(SEALED_MAGIC):
        raise InvalidInput(f"{path} is a sealed KEY_SECRET (it opens only under its store's encryption key); "
                           "a key secret file holds the secret itself")
    if len(raw) < 16:
        raise InvalidInput(f"key secret file {path} holds {len(raw)} bytes; a key secret has at least 16 "
                           "(make one with: head -c 32 /dev/urandom > FILE)")
    return raw


def seal_plain_file(path: Path, secret: bytes, sealer: Sealer) -> None:
    """Replace a plain PATH/KEY_SECRET by the same secret sealed under ``sealer`` (the migration
    of a store encrypted before sealing existed; docs/durability.md). Caller holds the lock."""
    write_file_atomic(path / KEY_SECRET_NAME, encode_sealed(sealer.seal(secret, SEALED_AAD)), mode=0o600)


class NoKeys:
    """The key space of a read-only open without the directory's key secret (it was made with
    an explicit ``key_secret``, or it is sealed and no key was given): stats and verify need no
    keys; computing one is InvalidInput."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __getattr__(self, name: str):
        raise InvalidInput(f"{self.path} is open read-only without its key secret (no {KEY_SECRET_NAME} file, "
                           "or one sealed under an encryption key not given); pass key_secret= or "
                           "encryption_key_file= to compute keys")


class Opened:
    """What ``open_keyspace`` found: the key space, layout, model id, the store id (None:
    legacy) and the loaded secret (``secret.seal_later``)."""

    def __init__(self, keyspace, layout: BlockLayout, model_id: str, store_id: bytes | None, secret: Secret) -> None:
        self.keyspace, self.layout, self.model_id = keyspace, layout, model_id
        self.store_id = store_id
        self.secret = secret


def open_keyspace(path: Path, layout, model_id, key_secret: bytes | None, key_algo: str,
                  ns_extra: dict, read_only: bool = False, sealer: Sealer | None = None) -> Opened:
    """Write the manifest of a new directory, or check the caller's options against an
    existing one's. Caller holds the lock (or opens ``read_only``: then the directory must
    exist). A directory holding a log but no MANIFEST.json is refused before anything is written."""
    manifest = read_manifest(path)
    if manifest is None and holds_log(path):
        raise CorruptionError(f"{path / MANIFEST_NAME} is missing but {path} holds a log (wal/, index/): restore "
                              f"{MANIFEST_NAME} from a backup; it is never rewritten over an existing log "
                              "(nothing was written)")
    if manifest is None and read_only:
        raise NotFound(f"{path} is not a kvdb data directory (no MANIFEST.json); read_only opens only an existing one")
    if manifest is None:
        if layout is None or model_id is None:
            raise InvalidInput(f"{path} is a new data directory: pass layout= and model_id=")
        if not isinstance(layout, BlockLayout):
            raise InvalidInput(f"layout must be a kvdb.BlockLayout, got {type(layout).__name__}")
    store_id = None if manifest is None else store_id_of(manifest, str(path / MANIFEST_NAME))
    secret = load_secret(path, key_secret, read_only, sealer, existing=manifest is not None)
    if secret.value is None:  # read-only, no usable secret file and none given
        return Opened(NoKeys(path), BlockLayout.from_dict(manifest["layout"]), manifest["model_id"], store_id, secret)
    if manifest is None:
        KeySpace(model_id=model_id, layout=layout, key_secret=secret.value, algo=key_algo, **ns_extra)  # validates
        store_id = secrets.token_bytes(STORE_ID_BYTES)
        fields = dict(model_id=model_id, layout=layout.to_dict(), key_algo=key_algo,
                      key_secret_id=key_secret_id(secret.value), store_id=store_id.hex(), **ns_extra)
        write_manifest(path, fields)
    else:
        stored = BlockLayout.from_dict(manifest["layout"])
        if layout is not None and layout != stored:
            raise InvalidInput(f"{path} holds layout {stored}, not {layout}; open it with its own layout")
        if model_id is not None and model_id != manifest["model_id"]:
            raise InvalidInput(f"{path} holds model {manifest['model_id']!r}, not {model_id!r}")
        if manifest.get("key_secret_id") != key_secret_id(secret.value):
            raise InvalidInput(f"{path} was written with a different key secret; pass the same key_secret")
        for k, v in ns_extra.items():
            if v is not None and v != manifest.get(k):
                raise InvalidInput(f"{path} holds {k}={manifest.get(k)!r}, not {v!r}")
        layout, model_id, key_algo = stored, manifest["model_id"], manifest.get("key_algo", "sha256")
        ns_extra = {k: manifest.get(k) for k in ns_extra}
    keyspace = KeySpace(model_id=model_id, layout=layout, key_secret=secret.value, algo=key_algo, **ns_extra)
    return Opened(keyspace, layout, model_id, store_id, secret)


# ---------------------------------------------------------------------- options

def check_options(durability: str, host_bytes, device_bytes, session_idle_s, max_space_amp) -> float | None:
    """The options checked before anything touches the directory; the checked max_space_amp
    (the disk tier compacts on its own past it: kvdb/cold/store.py)."""
    if durability not in DURABILITIES:
        raise InvalidInput(f"durability must be one of {DURABILITIES}, got {durability!r}")
    for name, v in (("host_bytes", host_bytes), ("device_bytes", device_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidInput(f"{name} must be an int >= 0, got {v!r}")  # check_sizes made it one
    if session_idle_s is not None and (isinstance(session_idle_s, bool) or not isinstance(session_idle_s, (int, float))
                                       or not math.isfinite(session_idle_s) or session_idle_s <= 0):
        raise InvalidInput(f"session_idle_s must be a positive finite number of seconds or None (sessions never "
                           f"expire), got {session_idle_s!r}")
    return check_space_amp(max_space_amp)


def check_sizes(host_bytes, device_bytes, disk_bytes) -> tuple[int, int, int | None]:
    """The tiers' sizes as byte counts: ints, or strings such as "4GiB" (kvdb/sizes.py);
    ``disk_bytes`` may be None (unbounded). NaN, negatives, fractions of a byte and anything over
    2**62 are InvalidInput naming the option."""
    host = parse_size(host_bytes, "host_bytes")
    ram = physical_memory()
    if ram and host > ram:  # the host arena is allocated at open: more than the machine has cannot be
        raise InvalidInput(f"host_bytes={host_bytes!r} is more than this machine's memory ({ram} bytes)")
    return host, parse_size(device_bytes, "device_bytes"), parse_size(disk_bytes, "disk_bytes", allow_none=True)


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def replacer_factory(replacer: str | Callable[[int], Replacer]) -> Callable[[int], Replacer]:
    """``make_replacer(num_frames)`` for the pool from a policy name (kvdb/planner/policies/)."""
    if callable(replacer):
        return replacer
    name = replacer
    if name in REPLAY_ONLY:
        raise InvalidInput(f"policy {name!r} needs the future and runs only in replay (kvdb sim)")
    # the engine reports call_finished when a call really ends, so the planned policy adds no
    # assumed call duration of its own (the simulator, which sees only arrivals, uses the default)
    opts = {"llm_call_s": 0.0} if name == "kvdb" else {}
    make_policy(name, 1, **opts)  # validates the name now
    return lambda n: make_policy(name, n, **opts)


def pick_device(device, device_bytes: int) -> torch.device:
    """The device tier's device. Without CUDA a device tier is refused unless the caller asks
    for one in CPU memory (``device="cpu"``: tests, the demo), which a default never picks."""
    if device is None:
        if not cuda_available():
            raise InvalidInput(f"device_bytes={device_bytes} asks for a device tier but CUDA is not available; "
                               "pass device_bytes=0 (host and disk tiers only), or device='cpu' to run the "
                               "device tier in CPU memory (testing)")
        dev = torch.device("cuda")
    else:
        dev = torch.device(device)
    if dev.type == "cuda" and not cuda_available():
        raise InvalidInput("device='cuda' asked for but CUDA is not available; pass device_bytes=0, or "
                           "device='cpu' to run the device tier in CPU memory (testing)")
    if dev.type not in ("cuda", "cpu"):
        raise InvalidInput(f"unsupported device {dev}; use 'cuda' or 'cpu'")
    total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else physical_memory()
    if total and device_bytes > total:
        raise InvalidInput(f"device_bytes={device_bytes} is more than the {dev.type} memory ({total} bytes)")
    return dev


def open_cold(path: Path, layout: BlockLayout, disk_bytes, codec, encryption_key_file, max_space_amp,
              read_only: bool = False, store_id: bytes | None = None):
    """The disk tier (kvdb/cold/), or None when it is off (``disk_bytes=0``); read-only
    (kvdb/cold/store.py) when asked, and then None where the directory has no disk tier."""
    if disk_bytes == 0:
        if encryption_key_file is not None:
            raise InvalidInput("encryption_key_file needs the disk tier (disk_bytes != 0)")
        return None
    if read_only and not (Path(path) / "wal").is_dir():
        return None
    return ColdStore.open(path, layout, disk_bytes=disk_bytes, encryption_key_file=encryption_key_file,
                          codec=codec, default_durability="group", max_space_amp=max_space_amp, read_only=read_only,
                          store_id=store_id)
