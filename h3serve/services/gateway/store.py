"""Where HTTP jobs live: a job record (JSON) and, once completed, its MP4, in a store every gateway replica shares.

    DiskStore  DIR/jobs/<id>.json  DIR/videos/<id>.mp4  DIR/index/<owner>/<entry>   laptop (`--jobs-dir DIR`)
    S3Store    s3://BUCKET/PREFIX: PREFIX/jobs/<id>.json, PREFIX/videos/<id>.mp4, PREFIX/index/<owner>/<entry>,
               PREFIX/gateways/<instance>.json
               (`--job-store s3://BUCKET/PREFIX`; endpoint and credentials from the environment as every S3 client
               reads them: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)

A record is written when the job is admitted, when it starts, and when it ends; the MP4 is published before the
record says `completed`, so a completed record always has its MP4. Every failure of either store (a full or
read-only disk, an unreachable server) is a StoreError: 503, retryable, naming `job-store`; a publish that fails
keeps the local MP4 for the next try. Each gateway writes a heartbeat
(`gateways/<host:port>.json`: its boot id and time); a record still queued or in progress whose gateway restarted
(another boot id) or stopped beating is an orphan, and whoever reads it first marks it failed with the reason.

The index: one empty entry per job, under its owner (`_` for a job of no key), named so that name order is newest
first (`index_entry`: the creation time counted down, then the id). It is written before a job's first record
and removed with the job, so listing a caller's jobs reads entry names (a directory listing, or an S3 listing from
a start key) and then only the records of the page asked for, never every record. A store written before the index
existed is indexed once, from its records, on first use (marked by `index/.complete`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Iterator, Protocol

import urllib3

from h3serve.errors import StageUnavailable

log = logging.getLogger("h3serve.gateway")

CHUNK = 1 << 20            # download chunk
HEARTBEAT_STALE_S = 30.0   # a gateway silent this long is gone (it beats every few seconds)
S3_CONNECT_S, S3_READ_S = 3.0, 60.0


class StoreError(StageUnavailable):
    """The job store could not be read or written (UNAVAILABLE, retryable, naming the store)."""

    def __init__(self, message: str):
        super().__init__("job-store", message)


@dataclass(frozen=True)
class Mp4:
    """A stored MP4: a local path (served with ranges) or a stream of chunks of a known size."""

    size: int
    path: str | None = None
    chunks: Iterator[bytes] | None = None


INDEX_TOP = 10 ** 20 - 1   # entries count down from here: name order is newest first
ANYONE = "_"               # the index folder of jobs of no key (a key's NAME starts with a letter or digit)
INDEX_DONE = ".complete"


def index_entry(record: dict) -> str:
    """A job's index entry: its creation time (ns) counted down from INDEX_TOP, then its id."""
    ns = int(float(record.get("created_at") or 0.0) * 1e9)
    return f"{INDEX_TOP - ns:020d}_{record['id']}"


def entry_id(entry: str) -> str:
    return entry.split("_", 1)[1]


def output_id(job_id: str, index: int) -> str:
    """The store's name of a job's output `index` (0: the job's own MP4; a job of n > 1 outputs has the others)."""
    return job_id if index == 0 else f"{job_id}.{index}"


def _outputs(record: dict | None) -> list[str]:
    """A record's MP4 names beyond its own (those published, also of a job that failed part way)."""
    return [output_id(record["id"], o["index"]) for o in (record or {}).get("outputs") or () if o.get("index")]


def _owner_folder(owner: str | None) -> str:
    return ANYONE if owner is None else _safe(owner)


# Usage records (one per finished job, kept when the job is deleted or expires: they are what a caller is billed
# by) under usage/CALLER/DAY/, the day of its end (UTC): a range is read a day folder at a time.
def usage_path(record: dict) -> tuple[str, str, str]:
    """(caller folder, day, name) of a usage record."""
    end = float(record["completed_at"])
    day = time.strftime("%Y-%m-%d", time.gmtime(end))
    return _owner_folder(record.get("caller")), day, f"{int(end * 1000):013d}_{_safe(record['id'])}.json"


def usage_days(start: float, end: float) -> list[str]:
    """The UTC days [start, end] touches."""
    first = int(start // 86400)
    return [time.strftime("%Y-%m-%d", time.gmtime(d * 86400)) for d in range(first, int(end // 86400) + 1)]


def in_range(record: dict, start: float, end: float) -> bool:
    return start <= float(record.get("completed_at") or 0.0) <= end


class JobStore(Protocol):
    durable: bool

    def put_record(self, record: dict) -> None: ...

    def index_entries(self, owner: str | None, after: str | None = None,
                      reverse: bool = False) -> Iterator[str]: ...

    def ensure_index(self) -> None: ...

    def get_record(self, job_id: str) -> dict | None: ...

    def records(self) -> list[dict]: ...

    def delete(self, job_id: str) -> None: ...

    def spool_path(self, job_id: str) -> str: ...

    def publish(self, job_id: str, path: str) -> None: ...

    def open_mp4(self, job_id: str) -> Mp4 | None: ...

    def beat(self, instance: str, boot: str) -> None: ...

    def heartbeat(self, instance: str) -> dict | None: ...

    def put_usage(self, record: dict) -> None: ...

    def usage(self, caller: str | None, start: float, end: float, everyone: bool = False) -> list[dict]: ...

    def close(self) -> None: ...


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _safe(name: str) -> str:
    """A job id or instance as an object / file name (ids are checked by the API; this keeps paths flat)."""
    return urllib.parse.quote(name, safe="-_.:")


def disk_error(what: str, where: str, exc: OSError) -> StoreError:
    """An OSError of the local store (ENOSPC, EROFS, EIO, ...) as the store's retryable error."""
    why = exc.strerror or type(exc).__name__
    return StoreError(f"could not {what} in {where}: {why}" + (f" (errno {exc.errno})" if exc.errno else ""))


class DiskStore:
    """Records and MP4s under one directory; every write is a temp file renamed into place."""

    def __init__(self, root: str, *, durable: bool = True):
        self.root = root
        self.durable = durable
        self._indexed: set[str] = set()   # ids whose entry this process wrote (a record is written 3 times)
        jobs = os.path.join(root, "jobs")
        fresh = not os.path.isdir(jobs) or next(os.scandir(jobs), None) is None
        for sub in ("jobs", "videos", "gateways", "index"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        if fresh:   # no record to index: complete as it is
            self._write(os.path.join(root, "index", INDEX_DONE), b"", "index the jobs")

    def _path(self, sub: str, name: str, ext: str) -> str:
        return os.path.join(self.root, sub, _safe(name) + ext)

    def _write(self, path: str, data: bytes, what: str = "write a job record") -> None:
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)   # a half-written temp file would hold the space it could not get
            except OSError:
                pass
            raise disk_error(what, self.root, exc) from None

    def _read(self, path: str) -> dict | None:
        try:
            with open(path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except ValueError:
            log.warning("job store: unreadable record %s ignored", path)
            return None
        except OSError as exc:
            raise disk_error("read a job record", self.root, exc) from None

    def put_record(self, record: dict) -> None:
        self._index(record)   # first: a record always has its entry (an entry without one is skipped)
        self._write(self._path("jobs", record["id"], ".json"), _dumps(record))

    def get_record(self, job_id: str) -> dict | None:
        return self._read(self._path("jobs", job_id, ".json"))

    def _entry_path(self, record: dict) -> str:
        return os.path.join(self.root, "index", _owner_folder(record.get("owner")), index_entry(record))

    def _index(self, record: dict) -> None:
        if record["id"] in self._indexed:
            return
        path = self._entry_path(record)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise disk_error("write a job record", self.root, exc) from None
        self._indexed.add(record["id"])

    def index_entries(self, owner: str | None, after: str | None = None,
                      reverse: bool = False) -> Iterator[str]:
        """Entry names, newest first (oldest first with `reverse`), after `after`: of one owner, or every one."""
        top = os.path.join(self.root, "index")
        try:
            folders = [_owner_folder(owner)] if owner is not None else os.listdir(top)
            names = []
            for folder in folders:
                path = os.path.join(top, folder)
                if os.path.isdir(path):
                    names += [n for n in os.listdir(path) if not n.startswith(".")]
        except OSError as exc:
            raise disk_error("list the jobs", self.root, exc) from None
        names.sort(reverse=reverse)
        if after is not None:
            names = [n for n in names if (n < after if reverse else n > after)]
        return iter(names)

    def ensure_index(self) -> None:
        done = os.path.join(self.root, "index", INDEX_DONE)
        if os.path.exists(done):
            return
        for rec in self.records():
            self._index(rec)
        self._write(done, b"", "index the jobs")

    def records(self) -> list[dict]:
        out = []
        try:
            names = os.listdir(os.path.join(self.root, "jobs"))
        except OSError as exc:
            raise disk_error("list the jobs", self.root, exc) from None
        for name in names:
            if name.endswith(".json"):
                rec = self._read(os.path.join(self.root, "jobs", name))
                if rec is not None:
                    out.append(rec)
        return out

    def delete(self, job_id: str) -> None:
        rec = self.get_record(job_id)
        paths = [self._path("videos", job_id, ".mp4"), self._path("jobs", job_id, ".json")]
        paths += [self._path("videos", o, ".mp4") for o in _outputs(rec)]
        if rec is not None:
            paths.append(self._entry_path(rec))
        self._indexed.discard(job_id)
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise disk_error("delete a job", self.root, exc) from None

    def spool_path(self, job_id: str) -> str:
        return self._path("videos", job_id, ".mp4")

    def publish(self, job_id: str, path: str) -> None:
        pass   # the sink wrote it in place

    def open_mp4(self, job_id: str) -> Mp4 | None:
        path = self._path("videos", job_id, ".mp4")
        try:
            return Mp4(size=os.path.getsize(path), path=path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise disk_error("find the MP4", self.root, exc) from None

    def beat(self, instance: str, boot: str) -> None:
        self._write(self._path("gateways", instance, ".json"), _dumps({"boot": boot, "at": time.time()}),
                    "write the gateway's heartbeat")

    def heartbeat(self, instance: str) -> dict | None:
        return self._read(self._path("gateways", instance, ".json"))

    def put_usage(self, record: dict) -> None:
        folder, day, name = usage_path(record)
        path = os.path.join(self.root, "usage", folder, day)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise disk_error("write a usage record", self.root, exc) from None
        self._write(os.path.join(path, name), _dumps(record), "write a usage record")

    def usage(self, caller: str | None, start: float, end: float, everyone: bool = False) -> list[dict]:
        top = os.path.join(self.root, "usage")
        try:
            folders = os.listdir(top) if everyone and os.path.isdir(top) else [_owner_folder(caller)]
            out = []
            for folder in folders:
                for day in usage_days(start, end):
                    path = os.path.join(top, folder, day)
                    for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
                        rec = self._read(os.path.join(path, name))
                        if rec is not None and in_range(rec, start, end):
                            out.append(rec)
        except OSError as exc:
            raise disk_error("read the usage records", self.root, exc) from None
        return out

    def close(self) -> None:
        pass


class S3Store:
    """Records and MP4s as objects of an S3 bucket (MinIO's client: any S3-compatible server). MP4s are spooled
    on local disk while the muxer's bytes arrive, uploaded when complete, and streamed back on download."""

    durable = True

    def __init__(self, url: str, spool_dir: str, env: dict | None = None, *,
                 timeout_s: tuple[float, float] = (S3_CONNECT_S, S3_READ_S)):
        from minio import Minio   # lazy: only an S3-backed gateway needs the client

        env = os.environ if env is None else env
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"job store {url!r}: expected s3://BUCKET[/PREFIX] or a directory")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        endpoint = env.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"
        ep = urllib.parse.urlparse(endpoint)
        if ep.scheme not in ("http", "https") or not ep.netloc:
            raise ValueError(f"AWS_ENDPOINT_URL {endpoint!r}: expected http(s)://HOST[:PORT]")
        self.endpoint = endpoint
        # bounded waits: an unreachable store fails a call in seconds (the client's default waits minutes)
        connect_s, read_s = timeout_s
        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=connect_s, read=read_s), maxsize=16,
                                   retries=urllib3.Retry(total=2, backoff_factor=0.2,
                                                         status_forcelist=(500, 502, 503, 504)))
        self.client = Minio(ep.netloc, access_key=env.get("AWS_ACCESS_KEY_ID"),
                            secret_key=env.get("AWS_SECRET_ACCESS_KEY"), region=env.get("AWS_REGION") or None,
                            secure=ep.scheme == "https", http_client=http)
        self.spool = spool_dir
        os.makedirs(spool_dir, exist_ok=True)
        self._etags: dict[str, tuple[str, dict]] = {}   # records of finished jobs do not change: read once
        self._indexed: set[str] = set()   # ids whose index entry this process wrote
        self._call("reach the bucket", self._ensure_bucket)

    def _ensure_bucket(self) -> None:
        if not self.client.bucket_exists(self.bucket):
            self.client.make_bucket(self.bucket)

    def _key(self, sub: str, name: str, ext: str) -> str:
        return "/".join(p for p in (self.prefix, sub, _safe(name) + ext) if p)

    def _call(self, what: str, fn, *args, **kwargs):
        from minio.error import S3Error

        try:
            return fn(*args, **kwargs)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                return None
            raise StoreError(f"could not {what} in s3://{self.bucket}/{self.prefix}: {exc.code}") from None
        except Exception as exc:  # noqa: BLE001 - connection refused, reset, timeouts: the store is unreachable
            raise StoreError(f"could not {what} at {self.endpoint}: {type(exc).__name__}") from None

    def _get_json(self, key: str) -> dict | None:
        def get():
            resp = self.client.get_object(self.bucket, key)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        data = self._call("read a job record", get)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            log.warning("job store: unreadable record %s ignored", key)
            return None

    def _put_json(self, key: str, obj: dict) -> None:
        data = _dumps(obj)
        self._call("write a job record", self.client.put_object, self.bucket, key, io.BytesIO(data), len(data),
                   content_type="application/json")

    def put_record(self, record: dict) -> None:
        self._index(record)   # first: a record always has its entry (an entry without one is skipped)
        self._put_json(self._key("jobs", record["id"], ".json"), record)

    def _index(self, record: dict) -> None:
        if record["id"] not in self._indexed:
            self._call("write a job record", self.client.put_object, self.bucket, self._entry_key(record),
                       io.BytesIO(b""), 0)
            self._indexed.add(record["id"])

    def get_record(self, job_id: str) -> dict | None:
        return self._get_json(self._key("jobs", job_id, ".json"))

    def _entry_key(self, record: dict) -> str:
        return "/".join(p for p in (self.prefix, "index", _owner_folder(record.get("owner")),
                                    index_entry(record)) if p)

    def index_entries(self, owner: str | None, after: str | None = None,
                      reverse: bool = False) -> Iterator[str]:
        """Entry names, newest first (oldest first with `reverse`), after `after`. One owner's newest first is
        listed lazily from `after` (S3 lists in name order); the other orders list the names and sort them."""
        top = "/".join(p for p in (self.prefix, "index") if p) + "/"
        if owner is not None and not reverse:
            prefix = top + _owner_folder(owner) + "/"
            objs = self._call("list the jobs", self.client.list_objects, self.bucket, prefix=prefix,
                              recursive=True, start_after=prefix + after if after else None)
            return (o.object_name.rsplit("/", 1)[1] for o in self._listed(objs))
        prefix = top + (_owner_folder(owner) + "/" if owner is not None else "")
        objs = self._call("list the jobs", lambda: list(self.client.list_objects(self.bucket, prefix=prefix,
                                                                                 recursive=True)))
        names = sorted((n for n in (o.object_name.rsplit("/", 1)[1] for o in objs or ())
                        if not n.startswith(".")), reverse=reverse)
        if after is not None:
            names = [n for n in names if (n < after if reverse else n > after)]
        return iter(names)

    def _listed(self, objs) -> Iterator:
        """A lazy S3 listing, its failures the store's error."""
        it = iter(objs or ())
        while True:
            o = self._call("list the jobs", next, it, None)
            if o is None:
                return
            yield o

    def ensure_index(self) -> None:
        done = "/".join(p for p in (self.prefix, "index", INDEX_DONE) if p)
        if self._call("read the job index", self.client.stat_object, self.bucket, done) is not None:
            return
        for rec in self.records():
            self._index(rec)
        self._call("index the jobs", self.client.put_object, self.bucket, done, io.BytesIO(b""), 0)

    def records(self) -> list[dict]:
        prefix = self._key("jobs", "", "")
        objs = self._call("list the jobs", lambda: list(self.client.list_objects(self.bucket, prefix=prefix,
                                                                                 recursive=True)))
        out, seen = [], set()
        for o in objs or ():
            seen.add(o.object_name)
            cached = self._etags.get(o.object_name)
            if cached is not None and cached[0] == o.etag:
                out.append(cached[1])
                continue
            rec = self._get_json(o.object_name)
            if rec is None:
                continue
            if rec.get("status") in ("completed", "failed"):
                self._etags[o.object_name] = (o.etag, rec)
            out.append(rec)
        for gone in set(self._etags) - seen:
            self._etags.pop(gone, None)
        return out

    def delete(self, job_id: str) -> None:
        rec = self.get_record(job_id)
        keys = [self._key("videos", job_id, ".mp4"), self._key("jobs", job_id, ".json")]
        keys += [self._key("videos", o, ".mp4") for o in _outputs(rec)]
        if rec is not None:
            keys.append(self._entry_key(rec))
        self._indexed.discard(job_id)
        for key in keys:
            self._call("delete a job", self.client.remove_object, self.bucket, key)

    def spool_path(self, job_id: str) -> str:
        return os.path.join(self.spool, _safe(job_id) + ".mp4")

    def publish(self, job_id: str, path: str) -> None:
        """Upload the spooled MP4, then remove it; a failed upload keeps it for the next try."""
        self._call("upload the MP4", self.client.fput_object, self.bucket, self._key("videos", job_id, ".mp4"),
                   path, content_type="video/mp4")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def open_mp4(self, job_id: str) -> Mp4 | None:
        key = self._key("videos", job_id, ".mp4")
        st = self._call("find the MP4", self.client.stat_object, self.bucket, key)
        if st is None:
            return None
        resp = self._call("read the MP4", self.client.get_object, self.bucket, key)
        if resp is None:
            return None

        def chunks() -> Iterator[bytes]:
            try:
                yield from resp.stream(CHUNK)
            finally:
                resp.close()
                resp.release_conn()

        return Mp4(size=st.size, chunks=chunks())

    def beat(self, instance: str, boot: str) -> None:
        self._put_json(self._key("gateways", instance, ".json"), {"boot": boot, "at": time.time()})

    def heartbeat(self, instance: str) -> dict | None:
        return self._get_json(self._key("gateways", instance, ".json"))

    def put_usage(self, record: dict) -> None:
        key = "/".join(p for p in (self.prefix, "usage", *usage_path(record)) if p)
        data = _dumps(record)
        self._call("write a usage record", self.client.put_object, self.bucket, key, io.BytesIO(data), len(data),
                   content_type="application/json")

    def usage(self, caller: str | None, start: float, end: float, everyone: bool = False) -> list[dict]:
        top = "/".join(p for p in (self.prefix, "usage") if p) + "/"
        if everyone:
            objs = self._call("read the usage records", lambda: list(self.client.list_objects(
                self.bucket, prefix=top, recursive=False)))
            folders = [o.object_name[len(top):].rstrip("/") for o in objs or () if o.is_dir]
        else:
            folders = [_owner_folder(caller)]
        out = []
        for folder in folders:
            for day in usage_days(start, end):
                prefix = f"{top}{folder}/{day}/"
                objs = self._call("read the usage records", lambda: list(self.client.list_objects(
                    self.bucket, prefix=prefix, recursive=True)))
                for o in sorted(objs or (), key=lambda o: o.object_name):
                    rec = self._get_json(o.object_name)
                    if rec is not None and in_range(rec, start, end):
                        out.append(rec)
        return out

    def close(self) -> None:
        pass


def open_store(spec: str | None, spool_dir: str) -> JobStore:
    """`s3://BUCKET/PREFIX` -> S3Store (spooling under `spool_dir`); a directory -> DiskStore."""
    if spec and spec.startswith("s3://"):
        return S3Store(spec, spool_dir)
    return DiskStore(spec or spool_dir, durable=bool(spec))
