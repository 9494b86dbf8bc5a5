"""Batches of (x, y) windows from the uint16 token shards that `prepare pretrain` wrote.

A split's shards are read as one token stream through memory maps, so no shard is ever
copied whole into RAM and a window may cross a shard boundary. Window i covers the tokens
[i*T, i*T + T + 1): x is its first T tokens, y its last T (the next-token targets), and
consecutive windows share one token, so every token of the stream is a target once.

Each epoch is a permutation of the window indices drawn from `seed + epoch` (the natural
order without shuffle). With W processes of micro-batch B, rank r's k-th micro-batch of the
epoch is perm[(k*W + r)*B : (k*W + r + 1)*B]. So ranks read disjoint windows, and one process
(W=1) reading its micro-batches 2j and 2j+1 reads exactly what ranks 0 and 1 (W=2) read at
their micro-batch j: a run on 2 GPUs with `a` accumulation steps sees the same data per
optimizer step as a run on 1 GPU with 2a steps. An epoch ends when the next micro-batch would
not be full for every rank (the tail is dropped), the same moment on every rank since it
depends only on the window count, B and W. (The equivalence holds through epoch boundaries
only when W=1 and W=2 drop the same tail, i.e. when n_windows // B is even.)

The loader's position is a pair of plain ints (epoch, micro-batches read in it), so a run
resumed from `state_dict()` reads exactly the batches an uninterrupted run would have read.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from gptforge.errors import BadInput
from gptforge.io import read_json

# Knobs named in error messages, so a user knows what to change.
_SIZE_PARAM = {"val": "data.pretrain.val_tokens", "train": "data.pretrain.max_tokens"}


class ShardLoader:
    def __init__(
        self,
        data_dir: str | os.PathLike,
        split: str,
        batch_size: int,
        block_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 1337,
        shuffle: bool = True,
        n_vocab: int | None = None,
        tokenizer_name: str | None = None,
    ) -> None:
        """`n_vocab` is the tokenizer's vocabulary (50257 for GPT-2), not the model's padded
        vocab_size; with `n_vocab`/`tokenizer_name` given, shards made by another tokenizer are refused."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in range(world_size={world_size})")
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size ({batch_size}) and block_size ({block_size}) must be positive")
        self.data_dir = Path(data_dir)
        self.split = split
        self.batch_size, self.block_size = batch_size, block_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle

        manifest = self.manifest = _read_manifest(self.data_dir)
        _check_tokenizer(self.data_dir, manifest, n_vocab, tokenizer_name)
        self._shards = _open_shards(self.data_dir, manifest, split)
        # starts[i] is the stream position of shard i's first token; starts[-1] is the total.
        self._starts = np.cumsum([0] + [len(s) for s in self._shards])
        self._check_size()

        self.epoch = 0
        self.position = 0  # micro-batches this rank has read in the current epoch
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    # -- sizes ------------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        return int(self._starts[-1])

    @property
    def n_windows(self) -> int:
        return max(self.tokens - 1, 0) // self.block_size

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches each rank reads per epoch."""
        return self.n_windows // (self.batch_size * self.world_size)

    def _check_size(self) -> None:
        T, need_windows = self.block_size, self.batch_size * self.world_size
        if self.n_windows >= need_windows:
            return
        knob = _SIZE_PARAM.get(self.split, "the corpus size")
        if self.tokens < T + 1:
            raise BadInput(
                f"{self.split} split in {self.data_dir} has {self.tokens} tokens, fewer than one window of "
                f"block_size+1 = {T + 1}: raise {knob} (and re-run prepare pretrain) or lower model.block_size"
            )
        raise BadInput(
            f"{self.split} split in {self.data_dir} has {self.tokens} tokens = {self.n_windows} windows of "
            f"{T}+1, but batch_size {self.batch_size} x {self.world_size} processes needs {need_windows} windows "
            f"({need_windows * T + 1} tokens): raise {knob} (and re-run prepare pretrain) or lower the batch size"
        )

    # -- reading ----------------------------------------------------------------------------

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(self.n_windows, generator=g).numpy()
            else:
                self._perm = np.arange(self.n_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def _read(self, start: int, out: np.ndarray) -> None:
        """Copy the stream's tokens [start, start + len(out)) into `out`, across shard boundaries."""
        filled = 0
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while filled < len(out):
            offset = start + filled - int(self._starts[i])
            piece = self._shards[i][offset : offset + len(out) - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            i += 1

    def next_batch(self, device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: int64 tensors x, y of shape (batch_size, block_size)."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        B, T, W = self.batch_size, self.block_size, self.world_size
        first = (self.position * W + self.rank) * B
        windows = self._permutation()[first : first + B]
        buf = np.empty((B, T + 1), dtype=np.int64)
        for row, w in zip(buf, windows):
            self._read(int(w) * T, row)
        self.position += 1
        batch = torch.from_numpy(buf)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if device is not None and torch.device(device).type == "cuda":
            # Pinned host memory lets the copy overlap with the GPU work already queued.
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        elif device is not None:
            x, y = x.to(device), y.to(device)
        return x, y

    def reset(self) -> None:
        """Back to the first batch: each evaluation then reads the same validation windows."""
        self.epoch, self.position = 0, 0

    # -- resuming ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
            "n_windows": self.n_windows,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off. Every rank loads the same state (rank 0's): the
        ranks move in lockstep, so their (epoch, position) are equal."""
        missing = {"epoch", "position", "seed", "world_size", "batch_size", "block_size"} - set(state)
        if missing:
            raise BadInput(f"data loader state lacks {', '.join(sorted(missing))}: not a ShardLoader state")
        saved = tuple(int(state[k]) for k in ("batch_size", "block_size", "world_size"))
        ours = (self.batch_size, self.block_size, self.world_size)
        if saved != ours:
            raise BadInput(
                "cannot resume the data order: it was saved with batch_size {}, block_size {}, world_size {}; "
                "this run has batch_size {}, block_size {}, world_size {} (keep them, or start fresh with "
                "pretrain.resume=never)".format(*saved, *ours)
            )
        if "n_windows" in state and int(state["n_windows"]) != self.n_windows:
            raise BadInput(
                f"cannot resume the data order: the {self.split} split had {int(state['n_windows'])} windows, "
                f"{self.data_dir} now has {self.n_windows} (the shards changed; start fresh with pretrain.resume=never)"
            )
        position = int(state["position"])
        if not 0 <= position <= self.batches_per_epoch:
            raise BadInput(f"data loader state position {position} is outside 0..{self.batches_per_epoch}")
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.epoch, self.position = int(state["epoch"]), position
        self._perm_epoch = None


# ---------------------------------------------------------------------------------------------
# The manifest and its shards


def _read_manifest(data_dir: Path) -> dict:
    path = data_dir / "manifest.json"
    manifest = read_json(
        path,
        missing=" not found: run `gptforge prepare pretrain` first",
        invalid=": re-run `gptforge prepare pretrain`",
    )
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise BadInput(f"{path}: no 'shards' list: re-run `gptforge prepare pretrain`")
    if manifest.get("dtype", "uint16") != "uint16":
        raise BadInput(f"{path}: dtype {manifest['dtype']!r}, expected 'uint16': re-run `gptforge prepare pretrain`")
    return manifest


def _check_tokenizer(data_dir: Path, manifest: dict, n_vocab: int | None, name: str | None) -> None:
    made = manifest.get("tokenizer") or {}
    made_name, made_vocab = made.get("name"), made.get("n_vocab")
    if (n_vocab is None or n_vocab == made_vocab) and (name is None or name == made_name):
        return
    ours = f"tokenizer {name}" if name is not None else "a tokenizer"
    if n_vocab is not None:
        ours += f" (n_vocab {n_vocab})"
    raise BadInput(
        f"shards in {data_dir} were made with tokenizer {made_name} (n_vocab {made_vocab}), this run uses "
        f"{ours}: re-run prepare pretrain"
    )


def _open_shards(data_dir: Path, manifest: dict, split: str) -> list[np.ndarray]:
    """Memory-map the split's shards in manifest order, checking each against the manifest.

    Only the header is read (dtype, length): hashing every shard would read the whole corpus
    at each start. Checksums are there for `dvc`/manual checks."""
    shards = []
    for entry in manifest["shards"]:
        if entry.get("split") != split:
            continue
        path = data_dir / entry["file"]
        if not path.is_file():
            raise BadInput(f"shard {path} listed in manifest.json is missing: re-run `gptforge prepare pretrain`")
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise BadInput(f"shard {path} is not a readable .npy file ({e})") from None
        if arr.dtype != np.uint16 or arr.ndim != 1 or len(arr) != int(entry["tokens"]):
            raise BadInput(
                f"shard {path} holds {arr.dtype} {tuple(arr.shape)}, manifest.json says uint16 "
                f"({int(entry['tokens'])},): re-run `gptforge prepare pretrain`"
            )
        shards.append(arr)
    return shards
