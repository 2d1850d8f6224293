"""Token shards in llm.c's layout, so shards written here and by llm.c interoperate.

A shard is a 1024-byte header of 256 little-endian int32 followed by the tokens:
  header[0] magic: 20240520 for uint16 tokens, 20240801 for uint32 tokens (vocabularies above 65,535)
  header[1] version: 1 for uint16, 7 for uint32
  header[2] number of tokens; the rest is zero.
Chat data's loss masks use the same layout with a magic of their own: 20261128, version 1, one uint8 per token.
Writes go to a temporary file that is renamed into place, so a crash never leaves half a shard.

Two headerless layouts from other projects are read too (`open_tokens`): nanoGPT's `train.bin`/`val.bin`
(raw uint16 tokens) and build-nanogpt's `.npy` shards (numpy arrays of uint16 tokens).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from gpt2train.files import AtomicFile, leftover_temp_files

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMATS = {  # magic -> (version, token dtype)
    20240520: (1, np.dtype("<u2")),
    20240801: (7, np.dtype("<u4")),
    20261128: (1, np.dtype("u1")),  # a loss mask beside a shard of chat data (data/conversations.py)
}
MASK_DTYPE = np.dtype("u1")


class ShardError(ValueError):
    """A shard file that cannot be read as llm.c tokens; the message says what is wrong."""


def out_of_vocab(where: str | Path, token_id: int, vocab_size: int) -> ShardError:
    """The one-line error for data whose ids the model cannot embed (an index error deep in the model otherwise)."""
    return ShardError(f"{where} holds token id {token_id} but the model's vocabulary has {vocab_size} ids; set "
                      f"model.vocab_size to 0 (from the data) or at least {token_id + 1}, or prepare the data "
                      f"with the model's tokenizer")


def check_ids_below(tokens: np.ndarray, vocab_size: int, where: str | Path) -> None:
    """For tokens whose largest id was not recorded at prepare time: checked batch by batch as they are read."""
    if tokens.size == 0:
        return
    lowest, highest = int(tokens.min()), int(tokens.max())
    if lowest < 0:
        raise ShardError(f"{where} holds token id {lowest}; token ids are never negative: the file is not tokens")
    if highest >= vocab_size:
        raise out_of_vocab(where, highest, vocab_size)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def tokens_crc32(tokens: np.ndarray, chunk: int = 1 << 25) -> int:
    """CRC-32 of the tokens' bytes as stored (little-endian), read a chunk at a time so a memory-mapped shard is
    never copied whole. prepare records it per shard; opening compares it, so a shard changed on disk is found
    before training, not when (if ever) a batch reads the changed part."""
    crc = 0
    for start in range(0, tokens.size, chunk):
        crc = zlib.crc32(np.ascontiguousarray(tokens[start:start + chunk]).view(np.uint8), crc)
    return crc


class ShardWriter:
    """One shard written as its tokens arrive, so no more than the tokens of one `append` are ever held:
    the header's count is filled in at `close`, and the file, written beside as files.py's temporary file,
    is renamed into place only then (a crash never leaves half a shard under the shard's name). Keeps the
    CRC-32 and the largest id of what it wrote (prepare records both)."""

    def __init__(self, path: str | Path, vocab_size: int, dtype: np.dtype | None = None):
        """dtype: the stored type (default: the smallest token type that holds vocab_size ids)."""
        self.path, self.vocab_size = Path(path), vocab_size
        self.dtype = np.dtype(dtype) if dtype is not None else token_dtype(vocab_size)
        for partial in leftover_temp_files(self.path):  # a killed writer's (prepare reruns into its staging folder)
            partial.unlink(missing_ok=True)
        self.out = AtomicFile(self.path)  # committed in close(), discarded in abandon()
        self.file = self.out.file
        self.file.write(bytes(HEADER_BYTES))
        self.count, self.crc, self.max_id = 0, 0, -1

    def append(self, tokens) -> None:
        tokens = np.asarray(tokens)
        if not tokens.size:
            return
        lowest, highest = int(tokens.min()), int(tokens.max())
        if lowest < 0 or highest >= self.vocab_size:
            bad = highest if highest >= self.vocab_size else lowest
            self.abandon()
            raise ShardError(f"{self.path.name}: token id {bad} is outside the vocabulary of {self.vocab_size}; "
                             f"the tokenizer's vocab_size is wrong")
        stored = tokens.astype(self.dtype, copy=False)
        self.file.write(stored.data if stored.flags.c_contiguous else stored.tobytes())
        self.crc = zlib.crc32(stored.view(np.uint8) if stored.flags.c_contiguous else stored.tobytes(), self.crc)
        self.count += tokens.size
        self.max_id = max(self.max_id, highest)

    def close(self) -> int:
        """Finish the shard under its name; returns its tokens_crc32."""
        magic = next(m for m, (_, dt) in FORMATS.items() if dt == self.dtype)
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = (magic, FORMATS[magic][0], self.count)
        self.file.seek(0)
        self.file.write(header.tobytes())
        self.out.commit()
        return self.crc

    def abandon(self) -> None:
        self.out.discard()


def write_shard(path: str | Path, tokens, vocab_size: int, dtype: np.dtype | None = None) -> int:
    """Write tokens (ids < vocab_size) as one shard, atomically; returns its tokens_crc32."""
    writer = ShardWriter(path, vocab_size, dtype)
    writer.append(tokens)
    return writer.close()


def read_header(path: str | Path) -> tuple[np.dtype, int]:
    """Check a shard's header and size; return (token dtype, token count)."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes is shorter than the 1024-byte llm.c header; the file is truncated")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic not in FORMATS:
        raise ShardError(f"{path}: magic {magic} is not an llm.c token shard (expected 20240520 or 20240801) or a "
                         f"chat mask (20261128)")
    expected_version, dtype = FORMATS[magic]
    if version != expected_version:
        raise ShardError(f"{path}: version {version} with magic {magic}; expected version {expected_version}")
    if size != HEADER_BYTES + count * dtype.itemsize:
        raise ShardError(f"{path}: header says {count} tokens but the file holds "
                         f"{(size - HEADER_BYTES) // dtype.itemsize}; the shard is truncated or corrupt")
    return dtype, count


def open_shard(path: str | Path, in_memory: bool = False) -> np.ndarray:
    """The shard's tokens, memory-mapped (default) or read into RAM."""
    dtype, count = read_header(path)
    if in_memory:
        return np.fromfile(path, dtype=dtype, count=count, offset=HEADER_BYTES)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def open_raw_uint16(path: str | Path, in_memory: bool = False) -> np.ndarray:
    """nanoGPT's train.bin / val.bin: uint16 tokens with no header."""
    path = Path(path)
    size = path.stat().st_size
    if size % 2:
        raise ShardError(f"{path}: {size} bytes is not a whole number of uint16 tokens; the file is truncated")
    if in_memory:
        return np.fromfile(path, dtype="<u2")
    return np.memmap(path, dtype="<u2", mode="r") if size else np.zeros(0, dtype="<u2")


def open_npy(path: str | Path, in_memory: bool = False) -> np.ndarray:
    """build-nanogpt's `.npy` shards: a 1-D integer array of tokens."""
    try:
        tokens = np.load(path, mmap_mode=None if in_memory else "r", allow_pickle=False)
    except ValueError as e:
        raise ShardError(f"{path}: not a readable .npy token array ({str(e).splitlines()[0]})") from None
    if not isinstance(tokens, np.ndarray):  # np.load opens a .npz archive whatever its name
        raise ShardError(f"{path}: a .npz archive, not a .npy array; save the tokens with np.save")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ShardError(f"{path}: expected a 1-D integer token array, found {tokens.dtype} of shape {tokens.shape}")
    return tokens


OPENERS = {"llmc": open_shard, "nanogpt": open_raw_uint16, "npy": open_npy}


def open_tokens(path: str | Path, fmt: str = "llmc", in_memory: bool = False) -> np.ndarray:
    """Tokens of one shard in any layout we read: llmc (default), nanogpt (raw uint16) or npy."""
    if fmt not in OPENERS:
        raise ShardError(f"unknown shard format {fmt!r} in meta.json; expected one of {sorted(OPENERS)}")
    return OPENERS[fmt](path, in_memory=in_memory)
