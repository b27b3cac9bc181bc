"""The Tiny Shakespeare loader (local file, TPLAB_DATA_DIR, download and cache) and a 20-step training
smoke test of the student project's configurations on simulated ranks. No network: downloads come from file:// URLs."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tplab.lab import data  # noqa: E402
from tplab.lab.data import (  # noqa: E402
    CharData,
    tiny_shakespeare,
    tiny_shakespeare_or_stand_in,
    tiny_shakespeare_path,
)

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare.txt"
needs_shakespeare = pytest.mark.skipif(not SHARED.is_file(), reason=f"no local copy at {SHARED}")
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No TPLAB_DATA_DIR, and a private cache directory."""
    monkeypatch.delenv("TPLAB_DATA_DIR", raising=False)
    monkeypatch.setenv("TPLAB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_reads_a_path_a_folder_or_the_environment(isolated, monkeypatch):
    folder = isolated / "mine"
    folder.mkdir()
    (folder / "input.txt").write_text(TEXT)
    assert tiny_shakespeare(path=folder / "input.txt") == TEXT
    assert tiny_shakespeare(data_dir=folder) == TEXT
    monkeypatch.setenv("TPLAB_DATA_DIR", str(folder))
    assert tiny_shakespeare(allow_download=False) == TEXT
    (folder / "tinyshakespeare.txt").write_text("preferred")
    assert tiny_shakespeare() == "preferred"  # tinyshakespeare.txt before input.txt


def test_missing_files_give_clear_errors(isolated, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such file"):
        tiny_shakespeare(path=isolated / "absent.txt")
    monkeypatch.setenv("TPLAB_DATA_DIR", str(isolated))
    with pytest.raises(FileNotFoundError, match="TPLAB_DATA_DIR"):
        tiny_shakespeare()
    monkeypatch.delenv("TPLAB_DATA_DIR")
    with pytest.raises(FileNotFoundError, match="downloading is off"):
        tiny_shakespeare(allow_download=False)
    with pytest.raises(RuntimeError, match="could not download"):
        tiny_shakespeare(url=(isolated / "nowhere.txt").as_uri())


def test_downloads_once_then_reads_the_cache(isolated, monkeypatch):
    source = isolated / "served.txt"
    source.write_text(TEXT)
    fetched = []
    real_download = data.download
    monkeypatch.setattr(data, "download", lambda url, target: fetched.append(url) or real_download(url, target))
    path = tiny_shakespeare_path(url=source.as_uri())
    assert path == isolated / "cache" / "tinyshakespeare.txt" and path.read_text() == TEXT
    source.unlink()  # the cached copy is all that is left
    assert tiny_shakespeare(url=source.as_uri()) == TEXT
    assert len(fetched) == 1
    assert not list(path.parent.glob("*.part"))  # no half-written download left behind


def test_a_stand_in_only_offline_with_no_copy_and_named_so(isolated, capsys):
    stand_in = isolated / "README.md"
    stand_in.write_text("# a stand-in\n")
    offline = (isolated / "nowhere.txt").as_uri()  # a download that fails
    assert tiny_shakespeare_or_stand_in(stand_in, url=offline) == ("# a stand-in\n", "a stand-in text (README.md)")
    assert "not on Tiny Shakespeare" in capsys.readouterr().out  # said out loud, in the notebook's output
    (isolated / "cache").mkdir(exist_ok=True)  # the failed download made it, or not
    (isolated / "cache" / "tinyshakespeare.txt").write_text(TEXT)
    assert tiny_shakespeare_or_stand_in(stand_in, url=offline) == (TEXT, "Tiny Shakespeare")
    with pytest.raises(FileNotFoundError):  # a folder named but without the file: fix it, no stand-in
        tiny_shakespeare_or_stand_in(stand_in, data_dir=isolated / "cache" / "empty")


def test_characters_split_and_batches():
    chars = CharData(TEXT)
    assert chars.decode(chars.encode(TEXT[:50])) == TEXT[:50]
    assert len(chars.split["train"]) == int(0.9 * len(TEXT))
    x, y = chars.batch("val", 3, 8, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    again, _ = chars.batch("val", 3, 8, torch.Generator().manual_seed(1))
    assert torch.equal(x, again)  # the same generator state, the same batch: what every rank relies on
    with pytest.raises(ValueError, match="outside the vocabulary"):
        chars.encode("Zebra!")


@needs_shakespeare
def test_tiny_shakespeare_as_nanogpt_sees_it():
    chars = CharData(tiny_shakespeare(path=SHARED))
    assert chars.vocab_size == 65  # nanoGPT's shakespeare_char: 65 characters, 1,003,854 / 111,540
    assert (len(chars.split["train"]), len(chars.split["val"])) == (1003854, 111540)


@needs_shakespeare
def test_twenty_training_steps_of_every_configuration():
    chars = CharData(tiny_shakespeare(path=SHARED))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only add synchronisation (and the machine is shared)
    try:
        _train_every_configuration(chars)
    finally:
        torch.set_num_threads(threads)


def _train_every_configuration(chars):
    from tplab.fewer_syncs import PATTERNS, SimulatedRanks, TrainConfig, syncs_per_forward, train

    cfg = TrainConfig(steps=20, batch_size=4, block_size=32, n_head=4, n_embd=32, warmup_steps=5,
                      learning_rate=3e-3, eval_interval=20, eval_iters=4)
    for name, pattern in PATTERNS.items():
        rows = train(pattern, chars, cfg, SimulatedRanks(2), name=name)
        assert [r["step"] for r in rows] == [0, 20]
        assert rows[0]["val_loss"] == pytest.approx(4.17, abs=0.1)  # ln 65: uniform guesses at the start
        assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 0.3, name
        assert rows[-1]["syncs_forward"] == rows[-1]["syncs_backward"] == syncs_per_forward(pattern)
