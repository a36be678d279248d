"""A disk that really fills while a run writes its metrics row or its checkpoint, and while the feature cache is
written: the error names the full disk, nothing half-written stays or is read, and once there is room again the
run resumes bit-exactly and the cache is rebuilt.

The other fault tests raise the error themselves (a patched `torch.save`) or SIGKILL the writer; here the bytes
run out. `SmallDisk` (the test prints which mechanism ran: "disk full via tmpfs" or "via rlimit"):
- tmpfs: a 16 MiB tmpfs mounted on the directory (root with CAP_SYS_ADMIN, as in this sandbox) and a ballast file
  that leaves less room than the next write needs; the write fails with ENOSPC, "No space left on device";
- rlimit, where mounting is refused: each attempt runs in a forked child whose RLIMIT_FSIZE is below the size of
  the file it writes, SIGXFSZ ignored, so the write fails with EFBIG, "File too large", instead of killing it.
Neither: skipped, but a failure under CI. `RLCD_TEST_DISK=rlimit` takes the fallback where tmpfs works.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from conftest import fresh_data, synth_processed

from rlcd import checkpoint as ckpt
from rlcd import features
from rlcd.features import cache_root, ensure_features, find_features
from rlcd.recipe import Recipe
from rlcd.run import Run
from rlcd.train import train

torch.set_num_threads(1)
HERE = Path(__file__).resolve().parent
SIZE = 16 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
QUIET = dict(progress=False, print_fn=lambda _: None)
RECIPE = Recipe(steps=3, eval_every=3, checkpoint_every=1, log_every=1, diagnostics_every=0, grad_accum=1)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


class SmallDisk:
    """A directory whose writes run out of room on demand. `squeeze(room)`: tmpfs -- a ballast leaves `room` bytes
    free; rlimit -- files are capped at `room` bytes in the process that makes the attempt (`attempt` runs it in a
    child; a `squeeze` inside the child applies at once). `release()` gives the room back."""

    def __init__(self, root: Path, mechanism: str, child: bool = False):
        self.root, self.mechanism, self.child, self.cap = Path(root), mechanism, child, None
        self.errno = errno.ENOSPC if mechanism == "tmpfs" else errno.EFBIG

    def __repr__(self) -> str:
        return f"SmallDisk({self.mechanism} at {self.root})"

    @property
    def ballast(self) -> Path:
        return self.root / ".ballast"

    def free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def squeeze(self, room: int) -> None:
        if self.mechanism == "rlimit":
            self.cap = room
            if self.child:
                resource.setrlimit(resource.RLIMIT_FSIZE, (room, resource.RLIM_INFINITY))
            return
        self.release()
        with open(self.ballast, "wb") as f:
            f.write(b"\0" * (self.free() - room))
        assert abs(self.free() - room) <= PAGE, (self, self.free(), room)

    def release(self) -> None:
        self.cap = None
        self.ballast.unlink(missing_ok=True)

    def attempt(self, fn, *args) -> dict:
        """What `fn(self, *args)` raised ({"type", "errno", "message"}); fails the test when it raised nothing."""
        if self.mechanism == "tmpfs":
            got = failure_of(fn, self, *args)
        else:
            got = self._in_a_child(fn, *args)
        assert got is not None, f"{fn.__name__} raised nothing on a full disk ({self}): its writes fit in the room left"
        return got

    def _in_a_child(self, fn, *args) -> dict | None:
        """`failure_of(fn, self, *args)` in a forked child, under the cap: the limit is the child's alone (pytest's
        own files are not capped). Its stdout and stderr go to /dev/null, its answer through a pipe (neither is a
        file the cap counts)."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(r)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                sys.stdout = sys.stderr = open(os.devnull, "w")  # pytest's capture writes to a file
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                self.child = True
                if self.cap is not None:
                    self.squeeze(self.cap)
                out = {"failure": failure_of(fn, self, *args)}
            except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
                out = {"crash": traceback.format_exc()}
            finally:
                try:
                    os.write(w, json.dumps(out).encode())
                finally:
                    os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            answer = f.read()
        os.waitpid(pid, 0)
        got = json.loads(answer) if answer else {"crash": "the child died without an answer"}
        assert "crash" not in got, got.get("crash")
        return got["failure"]

    def says_full(self, got: dict) -> bool:
        """The error names the full disk: its errno, or the OS's words for it (safetensors' error quotes them)."""
        return got["errno"] == self.errno or os.strerror(self.errno) in got["message"]


def failure_of(fn, *args) -> dict | None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the test inspects whatever the disk made it raise
        return {"type": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}
    return None


def _rlimit_works(tmp: Path) -> bool:
    """A child process under RLIMIT_FSIZE gets EFBIG for a write past the limit (SIGXFSZ ignored)."""
    script = ("import errno, resource, signal\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
              "try:\n"
              f"    with open({str(tmp / 'probe')!r}, 'wb') as f:\n"
              "        f.write(b'x' * 8192)\n"
              "except OSError as e:\n"
              "    raise SystemExit(0 if e.errno == errno.EFBIG else 1)\n"
              "raise SystemExit(1)\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A `SmallDisk` at tmp_path/small: tmpfs when this process may mount one, else rlimit."""
    root = tmp_path / "small"
    root.mkdir()
    mounted = False
    if os.environ.get("RLCD_TEST_DISK") != "rlimit" and shutil.which("mount"):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(root)],
                                 capture_output=True).returncode == 0
    try:
        if mounted:
            disk = SmallDisk(root, "tmpfs")
        elif _rlimit_works(tmp_path):
            disk = SmallDisk(root, "rlimit")
        else:
            if _in_ci():
                pytest.fail("neither a tmpfs mount nor RLIMIT_FSIZE works here, so the disk-full tests cannot run")
            pytest.skip("neither a tmpfs mount nor RLIMIT_FSIZE works here")
        print(f"disk full via {disk.mechanism}")
        yield disk
    finally:
        if mounted and subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], check=True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 40, seed=5)


# ----------------------------------------------------------------------------------------------
# what the attempts run


def resume(disk, run) -> None:
    train(Path(run), resume=True, **QUIET)


def resume_as_the_disk_fills_at_the_row(disk, run) -> None:
    """Resume `run`; the disk fills (another writer takes the room) just before update 2's metrics row goes out,
    64 bytes of it still fitting. tmpfs hands out whole pages, so a padding row first moves the end of the file to
    64 bytes before the end of a page; rlimit caps the file 64 bytes past its end."""
    real = Run.log

    def log(self, row):
        if row.get("event") == "train":
            size = self.metrics_path.stat().st_size
            if disk.mechanism == "tmpfs":
                bare = len(json.dumps({"event": "padding", "pad": "", "step": 0})) + 1
                pad = (PAGE - 64 - size) % PAGE
                real(self, {"event": "padding", "pad": "x" * (pad - bare if pad >= bare else pad - bare + PAGE),
                            "step": 0})
                disk.squeeze(0)
            else:
                disk.squeeze(size + 64)
        real(self, row)

    Run.log = log
    try:
        resume(disk, run)
    finally:
        Run.log = real


def _model():
    from rlcd.model.build import build_model

    return build_model({"model": "tiny-toy", "model_seed": 0, "recipe": {}})


def extract(disk, data, model) -> None:
    ensure_features(model, data, progress=False)


def extract_as_the_disk_fills_at_publish(disk, data, model) -> None:
    """`extract`; the disk fills (another writer takes the room) as the finished cache is published: the manifest,
    which `publish` writes first, no longer fits."""
    real = features.publish

    def publish(tmp, final, manifest):
        disk.squeeze(0)
        real(tmp, final, manifest)

    features.publish = publish
    try:
        extract(disk, data, model)
    finally:
        features.publish = real


# ----------------------------------------------------------------------------------------------


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(".tmp-") or p.name.endswith(".old"))


def _train_rows(run: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in rows if r["event"] == "train"]


def test_a_run_that_fills_the_disk_keeps_its_last_checkpoint_and_resumes_exactly(tmp_path, data_dir, small_disk):
    """The disk fills three times on the same run: as update 2's metrics row is appended, as the checkpoint's
    weights are written, as its optimizer state is written. Each time the error names the full disk, checkpoints/last
    still holds update 1 and no temporary directory stays behind; with room again, the resume equals an
    uninterrupted run."""
    ref = tmp_path / "ref"
    train(ref, data_dir=data_dir, model="tiny-toy", recipe=RECIPE, **QUIET)
    run = small_disk.root / "run"
    train(run, data_dir=data_dir, model="tiny-toy", recipe=RECIPE, stop_after=1, **QUIET)
    last = run / "checkpoints" / "last"
    before = ckpt.load(last)
    w, o = (last / ckpt.WEIGHTS).stat().st_size, (last / ckpt.OPTIMIZER).stat().st_size
    assert w < o, (w, o)
    tmpfs = small_disk.mechanism == "tmpfs"
    attempts = [("metrics row", resume_as_the_disk_fills_at_the_row, None),
                ("weights", resume, w // 2),
                ("optimizer state", resume, w + o // 2 if tmpfs else (w + o) // 2)]
    for where, fn, room in attempts:
        small_disk.release()
        if room is not None:
            small_disk.squeeze(room)
        got = small_disk.attempt(fn, run)
        assert small_disk.says_full(got), (where, small_disk, got)
        kept = ckpt.load(last)
        assert kept["path"] == last and kept["state"]["step"] == 1, (where, kept["path"], kept["state"]["step"])
        assert all(torch.equal(before["weights"][k], kept["weights"][k]) for k in before["weights"]), where
        assert _leftovers(run / "checkpoints") == [], (where, _leftovers(run / "checkpoints"))
        if where == "metrics row":
            tail = (run / "metrics.jsonl").read_text().rsplit("\n", 1)[1]
            assert len(tail) == 64 and tail.startswith("{"), f"64 bytes of the row went out: {tail!r}"
    small_disk.release()
    train(run, resume=True, **QUIET)
    a, b = ckpt.load(ref / "checkpoints" / "last"), ckpt.load(last)
    assert b["state"]["step"] == 3
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert _train_rows(ref) == _train_rows(run)
    assert _leftovers(run / "checkpoints") == []


def test_a_feature_cache_that_fills_the_disk_publishes_nothing_and_is_rebuilt(data_dir, small_disk):
    """The data directory on the small disk; the disk fills twice: with 64 KiB left, as the first split's tensors
    are written (the check that the cache root is writable passes), and as the finished cache is published. Each
    time the error names the full disk, the temporary directory is gone and nothing is published, so `find_features`
    finds nothing (the partial directory keeps the chunks already committed, `rlcd.partial`); with room again the
    next call builds the whole cache and removes the partial."""
    data = fresh_data(small_disk.root, data_dir)
    root = cache_root(data)
    m = _model()
    room = 64 << 10
    for where, fn, squeeze in [("tensors", extract, room), ("manifest", extract_as_the_disk_fills_at_publish, None)]:
        small_disk.release()
        if squeeze is not None:
            small_disk.squeeze(squeeze)
        got = small_disk.attempt(fn, data, m)
        assert small_disk.says_full(got), (where, small_disk, got)
        assert [p.name for p in root.iterdir() if not p.name.startswith(".partial-")] == [], \
            (where, "temp dir removed, nothing published (the chunks already written stay for the next call)")
        assert find_features(m, data) is None, where
    small_disk.release()
    built = ensure_features(m, data, progress=False)
    assert built.manifest["complete"] and find_features(m, data) is not None
    assert sorted(p.name for p in root.iterdir()) == [built.root.name]
    assert (built.root / "train.safetensors").stat().st_size > 2 * room, "64 KiB held less than one split"
