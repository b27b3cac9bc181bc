"""Tiny Shakespeare, character by character (the data set of nanoGPT's shakespeare_char).

    text = tiny_shakespeare()                 # ~1.1 MB of plays, found locally or downloaded once
    text, name = tiny_shakespeare_or_stand_in("../README.md")   # offline with no copy: another text, named
    data = CharData(text)                     # 65 characters; 90% train, 10% validation
    x, y = data.batch("train", batch_size=64, block_size=256, generator=g)   # (64, 256) each

Where the text comes from, first found first:
  1. ``path``, if given (a file);
  2. ``data_dir``, or the environment variable TPLAB_DATA_DIR: ``tinyshakespeare.txt`` or ``input.txt``
     in that folder (an error if the folder is named but holds neither);
  3. the cache: ``$TPLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/tplab``, else ``~/.cache/tplab``;
  4. a download of Karpathy's char-rnn ``input.txt`` (``URL``) into the cache, used from then on.
"""

from __future__ import annotations

import os
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import torch

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
FILE_NAMES = ("tinyshakespeare.txt", "input.txt")


def cache_dir() -> Path:
    if os.environ.get("TPLAB_CACHE_DIR"):
        return Path(os.environ["TPLAB_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tplab"


def _in_folder(folder) -> Path | None:
    for name in FILE_NAMES:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def download(url: str, target: Path, timeout: float = 60) -> Path:
    """Fetch ``url`` into ``target``, atomically: a half-finished download never becomes the cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(url, timeout=timeout) as response:
        payload = response.read()
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".part") as tmp:
        tmp.write(payload)
    os.replace(tmp.name, target)
    return target


def tiny_shakespeare_path(path=None, data_dir=None, url: str = URL, allow_download: bool = True) -> Path:
    """The file the text is read from (see the module docstring for the order)."""
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no such file: {path}")
        return Path(path)
    folder = data_dir if data_dir is not None else os.environ.get("TPLAB_DATA_DIR") or None
    if folder is not None:
        found = _in_folder(folder)
        if found is None:
            raise FileNotFoundError(f"{folder} (data_dir or TPLAB_DATA_DIR) holds none of {FILE_NAMES}")
        return found
    cached = cache_dir() / FILE_NAMES[0]
    if cached.is_file():
        return cached
    if not allow_download:
        raise FileNotFoundError(f"Tiny Shakespeare is not in {cached} and downloading is off: pass a path or "
                                "set TPLAB_DATA_DIR to a folder holding tinyshakespeare.txt")
    try:
        return download(url, cached)
    except OSError as e:
        raise RuntimeError(f"could not download Tiny Shakespeare from {url} ({e}); put the file in a folder "
                           "and pass data_dir=... or set TPLAB_DATA_DIR") from e


def tiny_shakespeare(path=None, data_dir=None, url: str = URL, allow_download: bool = True) -> str:
    return tiny_shakespeare_path(path, data_dir, url, allow_download).read_text(encoding="utf-8")


def tiny_shakespeare_or_stand_in(stand_in, data_dir=None, url: str = URL) -> tuple[str, str]:
    """Tiny Shakespeare and its name; offline with no local copy, the text of the file ``stand_in`` and a
    name that says it is a stand-in, after a printed note saying why. A notebook's cells then keep running,
    and its figures can say which text they were measured on. (A ``data_dir`` or TPLAB_DATA_DIR without the
    file is a mistake to fix, not a reason for a stand-in: that error is raised.)"""
    try:
        return tiny_shakespeare(data_dir=data_dir, url=url), "Tiny Shakespeare"
    except RuntimeError as missing:  # the download failed and no copy was found
        name = Path(stand_in).name
        print(f"NOTE: {missing}\nUsing a stand-in text, {name}, so that the cells still run: what follows is "
              "measured on it, not on Tiny Shakespeare.")
        return Path(stand_in).read_text(encoding="utf-8"), f"a stand-in text ({name})"


class CharData:
    """A text as integers, one per character, split into train (first 90%) and validation (last 10%)."""

    def __init__(self, text: str, train_fraction: float = 0.9):
        if not text:
            raise ValueError("the text is empty")
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        data = self.encode(text)
        n = int(train_fraction * len(data))
        self.split = {"train": data[:n], "val": data[n:]}

    def encode(self, text: str) -> torch.Tensor:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # one code point per character
        table = np.full(max(max(map(ord, self.chars)), int(codes.max(initial=0))) + 1, -1, dtype=np.int64)
        table[[ord(c) for c in self.chars]] = np.arange(self.vocab_size)
        ids = table[codes]
        if (ids < 0).any():
            raise ValueError(f"characters outside the vocabulary: {sorted(set(text) - set(self.chars))[:10]}")
        return torch.from_numpy(ids)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, split: str, batch_size: int, block_size: int, generator=None, device="cpu"):
        """``batch_size`` random windows of ``block_size`` characters (x) and the next character after each
        position (y), as nanoGPT draws them. The same generator state gives the same batch on every rank."""
        data = self.split[split]
        if len(data) <= block_size:
            raise ValueError(f"the {split} split has {len(data)} characters, fewer than block_size + 1")
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
        x = torch.stack([data[i:i + block_size] for i in starts.tolist()])  # (b, s)
        y = torch.stack([data[i + 1:i + 1 + block_size] for i in starts.tolist()])  # (b, s)
        return x.to(device), y.to(device)
