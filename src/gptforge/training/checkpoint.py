"""Training checkpoints: `root/step_{step:08d}/` folders that are whole or absent, and the
protocol that saves a pretraining session into one and resumes from it.

A checkpoint holds `model.safetensors` and `config.json` (written by the caller's
`write_model`, so this module does not depend on the model), `state.pt` (optimizer, data
loader position, RNG states, step: anything `torch.load(weights_only=True)` can read back, so
loading a checkpoint never runs pickled code) and `checksums.json` (sha256 and size of every
other file). The folder is built under a hidden temporary name and renamed into place, with
checksums.json written last: a kill mid-write leaves no `step_*` folder, and disk damage
after the fact is caught by `verify`, so a resume falls back to the newest intact checkpoint.

The session's protocol (`find_resume`, `check_resumable`, `save_session`, `restore_session`): the
checkpoint to continue from (`pretrain.resume`: the newest intact one made with the same
fingerprint, gptforge.training.session's), and a step folder holding everything a resumed run
needs to continue bit for bit: weights, optimizer and grad-scaler state, the data position, the
step and every process's RNG states. Under ddp and zero1 process 0 writes it alone; under fsdp
every process first writes its shards into one hidden folder that process 0 moves into the step
folder it builds, between barriers.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.distributed as dist

from gptforge.errors import BadInput, StageFailed
from gptforge.io import atomic_dir, sha256_file, write_json
from gptforge.modeling.weights import save_model, write_model_config
from gptforge.training import sharding

if TYPE_CHECKING:
    from gptforge.config.schema import Config
    from gptforge.training.runtime import Runtime
    from gptforge.training.session import Session

log = logging.getLogger("gptforge")

CHECKSUMS = "checksums.json"
STATE = "state.pt"
_STEP_DIR = re.compile(r"step_(\d+)")


def step_of(folder: str | os.PathLike) -> int:
    m = _STEP_DIR.fullmatch(Path(folder).name)
    if m is None:
        raise BadInput(f"{folder}: not a checkpoint folder (its name is not step_NNNNNNNN)")
    return int(m.group(1))


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The `step_*` folders in `root`, oldest step first (temporary and other folders are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=step_of)


# ---------------------------------------------------------------------------------------------
# Writing


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    write_model: Callable[[Path], None],
    state: dict,
    keep_last: int | None,
) -> Path:
    """Write `root/step_{step:08d}/` atomically, then keep only the newest `keep_last` step folders
    (None keeps all). The folder just written and `final/` are never removed."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    _check_weights_only(state, "state")
    root = Path(root)
    folder = root / f"step_{step:08d}"
    try:
        with atomic_dir(folder) as tmp:
            write_model(tmp)
            torch.save(state, tmp / STATE)
            _write_checksums(tmp)
    except OSError as e:  # a full disk, a quota, a read-only mount: the older checkpoints are untouched
        kept = [p.name for p in list_checkpoints(root) if p != folder]
        raise StageFailed(
            f"cannot write checkpoint {folder}: {e.strerror or e}; "
            + (f"the previous checkpoints ({', '.join(kept)}) are intact" if kept else "no earlier checkpoint exists")
        ) from e
    _fsync_dir(root)
    if keep_last is not None:
        older = [p for p in list_checkpoints(root) if p != folder]
        for old in older[: max(len(older) - (keep_last - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _write_checksums(folder: Path) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        # fsync before the rename makes "whole or absent" hold through a power cut, not just a kill.
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.relative_to(folder).as_posix()] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    write_json(folder / CHECKSUMS, {"algorithm": "sha256", "files": files})


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not possible on every platform (Windows); the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Exact types: numpy scalars subclass float/int but the weights_only unpickler refuses them.
_SCALARS = (str, int, float, bool, type(None))
_TORCH = (torch.Tensor, torch.Size, torch.dtype, torch.device)


def _check_weights_only(obj, where: str) -> None:
    """Refuse at save time what `weights_only=True` would refuse at resume time, hours later."""
    if type(obj) in _SCALARS or isinstance(obj, _TORCH):
        return
    if type(obj) in (dict, list, tuple, collections.OrderedDict):  # not subclasses: the unpickler refuses them
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(obj, dict) and not isinstance(key, (str, int, float)):
                raise TypeError(f"{where} has a {type(key).__name__} key; use str or int keys")
            _check_weights_only(value, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}: state.pt must hold only tensors, "
        "numbers, strings and dict/list/tuple of them (it is loaded with weights_only=True)"
    )


# ---------------------------------------------------------------------------------------------
# Checking and loading


def verify(folder: str | os.PathLike) -> str | None:
    """None when every file listed in checksums.json is present with its size and sha256,
    else a one-line reason naming the file."""
    folder = Path(folder)
    sums = folder / CHECKSUMS
    if not sums.is_file():
        return f"{sums} is missing"
    try:
        files = json.loads(sums.read_text(encoding="utf-8"))["files"]
        expected = {name: (str(e["sha256"]), int(e["bytes"])) for name, e in files.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{sums} is unreadable ({type(e).__name__})"
    for name, (digest, size) in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} is truncated or resized ({actual} bytes, checksums.json says {size})"
        if sha256_file(path) != digest:
            return f"{path} fails its checksum (the bytes changed after it was written)"
    return None


def newest_good(root: str | os.PathLike, log: logging.Logger = logging.getLogger("gptforge")) -> Path | None:
    """The newest checkpoint in `root` that verifies; each newer damaged one is logged and skipped."""
    for folder in reversed(list_checkpoints(root)):
        reason = verify(folder)
        if reason is None:
            return folder
        log.warning("checkpoint %s is damaged, falling back to an older one: %s", folder, reason)
    return None


def load_state(folder: str | os.PathLike) -> dict:
    """`state.pt` of a verified checkpoint, on the CPU, read with weights_only=True."""
    folder = Path(folder)
    reason = verify(folder)
    if reason is not None:
        raise BadInput(f"checkpoint {folder} is damaged: {reason}")
    path = folder / STATE
    if not path.is_file():
        raise BadInput(f"{path} is missing: {folder} holds weights only, not a resumable training state")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for foreign objects, RuntimeError/EOFError for bad bytes
        raise BadInput(f"{path} cannot be loaded with weights_only=True: {_why(e)}") from None


def _why(error: Exception) -> str:
    """The informative line of torch.load's long, multi-line weights_only message."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    for line in lines:
        if "Unsupported global" in line or "WeightsUnpickler error" in line:
            # torch goes on to suggest allowlisting the global: not advice for a file of unknown origin.
            return line.split(" Please use", 1)[0]
    return lines[0] if lines else type(error).__name__


# ---------------------------------------------------------------------------------------------
# Random number generators


def capture_rng() -> dict:
    """Every RNG a training step may draw from, as tensors and ints (weights_only-loadable)."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        # Python's Mersenne Twister words are < 2**32, so they fit int64 exactly.
        "python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Put back what `capture_rng` took. CUDA states are restored for as many devices as both
    the saved state and this process have (a DDP rank usually sees one)."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            int(n["pos"]),
            int(n["has_gauss"]),
            float(n["cached_gaussian"]),
        )
    )
    p = state["python"]
    random.setstate((int(p["version"]), tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]))
    if state.get("cuda") and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)


# ---------------------------------------------------------------------------------------------
# The pretraining session: which step folder a run continues from, saving one and reading it back


def find_resume(cfg: Config, out_dir: Path, fp: str) -> Path | None:
    """The checkpoint to continue from, or None to start over (`pretrain.resume`)."""
    resume = cfg.pretrain.resume
    if resume == "never":
        return None
    if resume != "auto":
        folder = Path(resume)
        reason = verify(folder) if folder.is_dir() else f"{folder} is not a folder"
        if reason:
            raise BadInput(f"pretrain.resume: cannot resume from {folder}: {reason}")
        return folder
    folder = newest_good(out_dir)
    if folder is None:
        return None
    made_by = load_state(folder).get("fingerprint")
    if made_by != fp:
        log.warning("not resuming from %s: it was made with other model/pretrain params or data", folder)
        return None
    return folder


def check_resumable(folder: Path, sharded: bool) -> None:
    """A sharded checkpoint resumes under fsdp only, a whole one under ddp/zero1 only."""
    has_shards = (folder / sharding.SHARDS_DIR).is_dir()
    if has_shards != sharded:
        made, now = ("fsdp", "ddp/zero1") if has_shards else ("ddp/zero1", "fsdp")
        raise BadInput(
            f"pretrain.resume: {folder} was written under strategy {made} and this run is {now}: "
            f"resume it under {made}, or start from its weights with pretrain.init_from"
        )


def _rng_states(s: Session) -> dict:
    """Process 0's RNG states, and every process's when there are several (a collective): each
    resumes its own dropout stream."""
    mine = capture_rng()
    if not s.rt.ddp:
        return {"rng": mine}
    every = [None] * s.rt.world_size
    dist.all_gather_object(every, mine)
    return {"rng": every[0], "rng_by_rank": every}


def save_session(s: Session) -> Path | None:
    """The session's step folder (`save_checkpoint`). Called on every process: under ddp and
    zero1 process 0 writes it alone; under fsdp every process writes its shards into it first.
    Returns the folder on process 0, None on the others."""
    rng = _rng_states(s)
    if not s.rt.master and not s.sharded:
        return None
    state = {
        "step": s.step,
        "scaler": s.scaler.state_dict(),
        "loader": s.train_loader.state_dict(),
        **rng,
        "fingerprint": s.fingerprint,
    }
    keep_last = s.cfg.pretrain.keep_last
    if not s.sharded:
        state["optimizer"] = s.optimizer.state_dict()
        return save_checkpoint(
            s.out_dir, s.step, write_model=lambda d: save_model(s.raw_model, d), state=state, keep_last=keep_last
        )
    # Every process writes its shards to one hidden folder beside the step folders; process 0 then
    # moves it into the step folder it builds, which appears whole (checksums included) or not at all.
    shards = s.out_dir / f".shards_step_{s.step:08d}"
    if s.rt.master:
        for leftover in s.out_dir.glob(".shards_step_*"):  # a kill's, between the shards and the rename
            shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier()
    sharding.save_sharded(shards, s.raw_model, s.optimizer)
    dist.barrier()
    folder = None
    if s.rt.master:

        def write_model(d: Path) -> None:
            write_model_config(s.raw_model, d)
            os.replace(shards, d / sharding.SHARDS_DIR)

        folder = save_checkpoint(s.out_dir, s.step, write_model=write_model, state=state, keep_last=keep_last)
    dist.barrier()
    return folder


def restore_session(folder: Path, rt: Runtime, raw_model, optimizer, scaler, train_loader) -> int:
    """Read a step folder back into a run being set up (under fsdp the shards of the weights and
    AdamW's state into the sharded `raw_model` and `optimizer`, a collective) and return its step."""
    state = load_state(folder)
    if (folder / sharding.SHARDS_DIR).is_dir():
        sharding.load_sharded(folder / sharding.SHARDS_DIR, raw_model, optimizer)
    else:
        optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    train_loader.load_state_dict(state["loader"])
    by_rank = state.get("rng_by_rank") or []  # each process's own stream, when it was saved
    restore_rng(by_rank[rt.rank] if rt.rank < len(by_rank) else state["rng"])
    return int(state["step"])
