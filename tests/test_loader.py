"""ShardLoader: windows of the raw stream, seeded order, DDP rank split, exact resume, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gptforge.errors import BadInput
from gptforge.training.loader import ShardLoader

N_VOCAB = 280


def write_shards(folder: Path, val: list[int], train: list[int], seed: int = 0) -> dict[str, np.ndarray]:
    """Shards and a manifest as `prepare pretrain` writes them; returns each split's whole stream."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    shards, streams = [], {}
    for split, sizes in (("val", val), ("train", train)):
        parts = []
        for i, n in enumerate(sizes):
            data = rng.integers(0, N_VOCAB, n, dtype=np.uint16)
            name = f"{split}_{i:06d}.npy"
            np.save(folder / name, data)
            shards.append({"file": name, "split": split, "tokens": n, "sha256": "not-checked"})
            parts.append(data)
        streams[split] = np.concatenate(parts) if parts else np.empty(0, np.uint16)
    manifest = {
        "source": "test",
        "name": None,
        "tokenizer": {"name": "small.tiktoken", "n_vocab": N_VOCAB, "eot": N_VOCAB - 1},
        "dtype": "uint16",
        "documents": {"val": 1, "train": 1},
        "tokens": {s: len(streams[s]) for s in streams},
        "shards": shards,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return streams


@pytest.fixture
def data(tmp_path):
    """Uneven shards so that windows (T=8) cross shard boundaries: 61 train windows, 12 val."""
    folder = tmp_path / "pretrain"
    streams = write_shards(folder, val=[50, 47], train=[100, 37, 250, 102])
    return folder, streams


def batches(loader: ShardLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def window_starts(x: torch.Tensor, stream: np.ndarray, T: int) -> list[int]:
    """Which window each row of x is (found by matching it against the stream)."""
    found = []
    for row in x.numpy():
        hits = [i for i in range((len(stream) - 1) // T) if np.array_equal(stream[i * T : i * T + T], row)]
        assert len(hits) == 1
        found.append(hits[0])
    return found


# ---------------------------------------------------------------------------------------------
# Windows


def test_windows_match_the_raw_stream_in_natural_order(data):
    folder, streams = data
    T, B = 8, 3
    loader = ShardLoader(folder, "train", B, T, shuffle=False)
    stream = streams["train"].astype(np.int64)
    assert loader.tokens == len(stream) == 489
    assert loader.n_windows == (489 - 1) // T == 61
    for k in range(loader.batches_per_epoch):
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
        for b in range(B):
            i = k * B + b
            assert x[b].tolist() == stream[i * T : i * T + T].tolist()
            assert y[b].tolist() == stream[i * T + 1 : i * T + T + 1].tolist()  # targets: shifted by one
    # Windows 12 (tokens 96..104) and 17 (136..144) straddle shard boundaries at 100 and 137.
    assert loader.batches_per_epoch * B > 17


def test_every_window_is_read_once_per_epoch_with_shuffle(data):
    folder, streams = data
    loader = ShardLoader(folder, "train", 4, 8, seed=7)
    seen = []
    for _ in range(loader.batches_per_epoch):
        x, y = loader.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])
        seen += window_starts(x, streams["train"], 8)
    assert len(seen) == len(set(seen)) == loader.batches_per_epoch * 4 == 60  # 61 windows, tail of 1 dropped


def test_val_split_reads_its_own_shards(data):
    folder, streams = data
    loader = ShardLoader(folder, "val", 2, 8, shuffle=False)
    assert loader.tokens == 97 and loader.n_windows == 12
    x, _ = loader.next_batch()
    assert x[0].tolist() == streams["val"][:8].tolist()


def test_next_batch_moves_to_a_device(data):
    folder, _ = data
    x, y = ShardLoader(folder, "train", 2, 8).next_batch(device="cpu")
    assert x.device.type == "cpu" and x.is_contiguous() and y.is_contiguous()


# ---------------------------------------------------------------------------------------------
# Order


def first_epoch(folder, seed, **kw) -> list[list[int]]:
    loader = ShardLoader(folder, "train", 4, 8, seed=seed, **kw)
    return [x.flatten().tolist() for x, _ in batches(loader, loader.batches_per_epoch)]


def test_seeded_order_is_reproducible_and_differs_by_seed(data):
    folder, _ = data
    assert first_epoch(folder, 1) == first_epoch(folder, 1)
    assert first_epoch(folder, 1) != first_epoch(folder, 2)
    assert first_epoch(folder, 1) != first_epoch(folder, 1, shuffle=False)


def test_epochs_roll_over_with_a_new_permutation(data):
    folder, streams = data
    loader = ShardLoader(folder, "train", 4, 8, seed=3)
    per_epoch = loader.batches_per_epoch
    epoch0 = [window_starts(x, streams["train"], 8) for x, _ in batches(loader, per_epoch)]
    assert (loader.epoch, loader.position) == (0, per_epoch)
    epoch1 = [window_starts(x, streams["train"], 8) for x, _ in batches(loader, per_epoch)]
    assert loader.epoch == 1
    assert epoch0 != epoch1
    assert len({w for b in epoch1 for w in b}) == per_epoch * 4
    expected = torch.randperm(61, generator=torch.Generator().manual_seed(3 + 1))[: per_epoch * 4].tolist()
    assert [w for b in epoch1 for w in b] == expected


def test_validation_order_is_the_same_every_epoch(data):
    folder, _ = data
    loader = ShardLoader(folder, "val", 3, 8, shuffle=False)
    per_epoch = loader.batches_per_epoch
    a = [x.tolist() for x, _ in batches(loader, per_epoch)]
    b = [x.tolist() for x, _ in batches(loader, per_epoch)]
    assert a == b


# ---------------------------------------------------------------------------------------------
# Ranks


def test_ranks_read_disjoint_windows(data):
    folder, streams = data
    W = 3
    loaders = [ShardLoader(folder, "train", 2, 8, rank=r, world_size=W, seed=5) for r in range(W)]
    per_epoch = loaders[0].batches_per_epoch
    assert per_epoch == 61 // (2 * W)
    seen = [set() for _ in range(W)]
    for _ in range(per_epoch):
        for r, loader in enumerate(loaders):
            seen[r].update(window_starts(loader.next_batch()[0], streams["train"], 8))
    assert all(len(s) == per_epoch * 2 for s in seen)
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    # The next batch starts epoch 1 on every rank at once.
    for loader in loaders:
        loader.next_batch()
        assert (loader.epoch, loader.position) == (1, 1)


@pytest.mark.parametrize("batch_size", [2, 3])
def test_one_process_reads_what_two_ranks_read(data, batch_size):
    """DDP equivalence: micro-batches 2j and 2j+1 of world_size=1 == micro-batch j of ranks 0 and 1."""
    folder, _ = data
    single = ShardLoader(folder, "train", batch_size, 8, seed=11)
    ranks = [ShardLoader(folder, "train", batch_size, 8, rank=r, world_size=2, seed=11) for r in range(2)]
    assert ranks[0].batches_per_epoch * 2 <= single.batches_per_epoch
    for _ in range(ranks[0].batches_per_epoch):
        for r in range(2):
            x1, y1 = single.next_batch()
            x2, y2 = ranks[r].next_batch()
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


# ---------------------------------------------------------------------------------------------
# Resume


@pytest.mark.parametrize("stop", [3, 15, 16, 20])  # mid-epoch, at the end of epoch 0 (15 per epoch), in epoch 1
def test_state_dict_resumes_exactly(data, stop):
    folder, _ = data
    expected = batches(ShardLoader(folder, "train", 4, 8, seed=9), stop + 20)[stop:]

    first = ShardLoader(folder, "train", 4, 8, seed=9)
    batches(first, stop)
    state = first.state_dict()
    assert all(type(v) is int for v in state.values())
    assert json.loads(json.dumps(state)) == state
    resumed = ShardLoader(folder, "train", 4, 8, seed=12345)  # the state's seed wins
    resumed.load_state_dict(state)
    got = batches(resumed, 20)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))


def test_state_dict_resumes_each_rank(data):
    folder, _ = data
    ranks = [ShardLoader(folder, "train", 2, 8, rank=r, world_size=2, seed=4) for r in range(2)]
    for loader in ranks:
        batches(loader, 20)  # 15 per epoch: into epoch 1
    state = ranks[0].state_dict()  # rank 0's state is what a checkpoint holds
    for r in range(2):
        resumed = ShardLoader(folder, "train", 2, 8, rank=r, world_size=2, seed=4)
        resumed.load_state_dict(state)
        for _ in range(5):
            assert torch.equal(resumed.next_batch()[0], ranks[r].next_batch()[0])


def test_reset_rereads_the_first_batches(data):
    folder, _ = data
    loader = ShardLoader(folder, "val", 2, 8, shuffle=False)
    first = [x.tolist() for x, _ in batches(loader, 4)]
    loader.reset()
    assert [x.tolist() for x, _ in batches(loader, 4)] == first
    shuffled = ShardLoader(folder, "train", 2, 8)
    first = [x.tolist() for x, _ in batches(shuffled, 40)]  # into epoch 1
    shuffled.reset()
    assert [x.tolist() for x, _ in batches(shuffled, 40)] == first


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(batch_size=2),
            "saved with batch_size 4, block_size 8, world_size 1; this run has batch_size 2, "
            "block_size 8, world_size 1",
        ),
        (dict(block_size=4), "this run has batch_size 4, block_size 4, world_size 1"),
        (dict(world_size=2), "this run has batch_size 4, block_size 8, world_size 2"),
    ],
)
def test_state_from_another_shape_is_refused(data, change, message):
    folder, _ = data
    state = ShardLoader(folder, "train", 4, 8).state_dict()
    kw = dict(batch_size=4, block_size=8, world_size=1) | change
    other = ShardLoader(folder, "train", kw.pop("batch_size"), kw.pop("block_size"), **kw)
    with pytest.raises(BadInput, match="cannot resume the data order") as e:
        other.load_state_dict(state)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_state_from_other_shards_is_refused(data, tmp_path):
    folder, _ = data
    state = ShardLoader(folder, "train", 4, 8).state_dict()
    other = tmp_path / "other"
    write_shards(other, val=[50], train=[300])
    with pytest.raises(BadInput, match="had 61 windows, .* now has 37"):
        ShardLoader(other, "train", 4, 8).load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# Bad inputs


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_missing_manifest(tmp_path):
    with pytest.raises(BadInput) as e:
        ShardLoader(tmp_path / "nowhere", "train", 2, 8)
    assert one_line(e) == f"{tmp_path / 'nowhere' / 'manifest.json'} not found: run `gptforge prepare pretrain` first"


def test_missing_shard(data):
    folder, _ = data
    (folder / "train_000002.npy").unlink()
    with pytest.raises(BadInput) as e:
        ShardLoader(folder, "train", 2, 8)
    assert "train_000002.npy" in one_line(e) and "missing" in one_line(e)


@pytest.mark.parametrize(
    "content, says",
    [
        (np.zeros(36, np.uint16), "holds uint16 (36,), manifest.json says uint16 (37,)"),
        (np.zeros(37, np.int32), "holds int32 (37,), manifest.json says uint16 (37,)"),
    ],
)
def test_shard_that_differs_from_the_manifest(data, content, says):
    folder, _ = data
    np.save(folder / "train_000001.npy", content)
    with pytest.raises(BadInput) as e:
        ShardLoader(folder, "train", 2, 8)
    assert f"train_000001.npy {says}" in one_line(e)


def test_shard_that_is_not_npy(data):
    folder, _ = data
    (folder / "train_000001.npy").write_bytes(b"garbage")
    with pytest.raises(BadInput) as e:
        ShardLoader(folder, "train", 2, 8)
    assert "train_000001.npy is not a readable .npy file" in one_line(e)


@pytest.mark.parametrize(
    "kw, ours",
    [
        (dict(n_vocab=50257), "a tokenizer (n_vocab 50257)"),
        (dict(tokenizer_name="gpt2"), "tokenizer gpt2"),
        (dict(n_vocab=50257, tokenizer_name="gpt2"), "tokenizer gpt2 (n_vocab 50257)"),
    ],
)
def test_shards_from_another_tokenizer(data, kw, ours):
    folder, _ = data
    with pytest.raises(BadInput) as e:
        ShardLoader(folder, "train", 2, 8, **kw)
    assert one_line(e) == (
        f"shards in {folder} were made with tokenizer small.tiktoken (n_vocab {N_VOCAB}), this run uses {ours}: "
        "re-run prepare pretrain"
    )


def test_matching_tokenizer_is_accepted(data):
    folder, _ = data
    ShardLoader(folder, "train", 2, 8, n_vocab=N_VOCAB, tokenizer_name="small.tiktoken")


def test_split_shorter_than_one_window(data):
    folder, _ = data
    with pytest.raises(BadInput) as e:
        ShardLoader(folder, "val", 1, 97)
    text = one_line(e)
    assert text.startswith(f"val split in {folder} has 97 tokens, fewer than one window of block_size+1 = 98")
    assert "data.pretrain.val_tokens" in text


def test_split_with_fewer_windows_than_a_batch_on_every_rank(data):
    folder, _ = data
    ShardLoader(folder, "val", 6, 8, rank=1, world_size=2)  # 12 windows: exactly enough
    with pytest.raises(BadInput) as e:
        ShardLoader(folder, "val", 7, 8, rank=1, world_size=2)
    text = one_line(e)
    assert "val split" in text and "has 97 tokens = 12 windows of 8+1" in text
    assert "batch_size 7 x 2 processes needs 14 windows (113 tokens)" in text
    assert "data.pretrain.val_tokens" in text
    with pytest.raises(BadInput, match=r"train split .* has 489 tokens .* data\.pretrain\.max_tokens"):
        ShardLoader(folder, "train", 31, 8, world_size=2)


def test_split_with_no_shards(tmp_path):
    folder = tmp_path / "pretrain"
    write_shards(folder, val=[], train=[100])
    with pytest.raises(BadInput, match="val split .* has 0 tokens"):
        ShardLoader(folder, "val", 1, 8)


def test_unreadable_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(BadInput, match="manifest.json: not readable JSON"):
        ShardLoader(tmp_path, "train", 1, 8)


def test_does_not_copy_shards_into_memory(data):
    folder, _ = data
    loader = ShardLoader(folder, "train", 2, 8)
    assert all(isinstance(s, np.memmap) for s in loader._shards)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_next_batch_to_cuda_equals_the_cpu_batch(data):
    folder, _ = data
    x, y = ShardLoader(folder, "train", 2, 8, seed=1).next_batch(device="cuda")
    x0, y0 = ShardLoader(folder, "train", 2, 8, seed=1).next_batch()
    assert x.is_cuda and torch.equal(x.cpu(), x0) and torch.equal(y.cpu(), y0)
