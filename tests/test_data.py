"""Tests for initlab.data: loaders round-trip files written here, the cache, the catalogue.

Expected values are written by hand or computed from the arrays the test wrote, never through the
loaders' helpers. The last section reads the real files under the data root and skips cleanly
when they are absent.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import os
import pickle
import re
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from initlab.data import (
    Dataset,
    _pil_decode,
    cache,
    data_root,
    idx,
    libsvm,
    list_datasets,
    load_cifar_pickle,
    load_dataset,
    load_image_folder,
    load_libsvm,
    load_mnist,
    load_sklearn,
    read_idx,
)

REPO = Path(__file__).resolve().parents[1]
REAL_DATA = Path(os.environ.get("INITLAB_DATA_DIR") or REPO.parent / "shared" / "data")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test caches into its own folder, never ~/.cache."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("INITLAB_CACHE_DIR", str(directory))
    return directory


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.npz")) if directory.is_dir() else []


# --------------------------------------------------------------------------------------- LIBSVM


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode())
    return path


def test_libsvm_edge_cases(tmp_path: Path) -> None:
    # Non-contiguous and negative labels, rows missing trailing (and leading) features, a
    # comment, a blank line, CRLF line ends and a last line without a newline.
    text = (
        "# a comment line\r\n"
        "5 1:0.5 3:-2\r\n"
        "\r\n"
        "-3 2:1.25   # trailing comment\r\n"
        "12 1:1e-3 2:-0.5 3:4 4:7\r\n"
        "-3\r\n"
        "+5 4:1"
    )
    data = load_libsvm(write(tmp_path / "toy.txt", text), cache_dir=False)
    expected = [
        [0.5, 0, -2, 0],
        [0, 1.25, 0, 0],
        [1e-3, -0.5, 4, 7],
        [0, 0, 0, 0],
        [0, 0, 0, 1],
    ]
    assert torch.equal(data.x, torch.tensor(expected, dtype=torch.float32))
    assert data.label_map == (-3, 5, 12)
    assert data.y.tolist() == [1, 0, 2, 0, 1]
    assert (data.n_features, data.n_classes, len(data), data.name) == (4, 3, 5, "toy.txt")
    assert data.x.dtype == torch.float32 and data.y.dtype == torch.int64


def test_libsvm_explicit_n_features_and_shared_label_map(tmp_path: Path) -> None:
    train = load_libsvm(write(tmp_path / "a", "7 1:1\n-2 2:2\n4 3:3\n"), n_features=5)
    test = load_libsvm(
        write(tmp_path / "a.t", "4 5:1\n7 1:2\n"), n_features=5, label_map=train.label_map
    )
    assert train.x.shape == (3, 5) and test.x.shape == (2, 5)
    assert train.label_map == test.label_map == (-2, 4, 7)
    assert test.y.tolist() == [1, 2]
    assert test.n_classes == 3  # the test split lacks class -2 but keeps its index
    assert test.x[0].tolist() == [0, 0, 0, 0, 1]
    # Without an explicit width the two files would disagree.
    assert load_libsvm(tmp_path / "a").n_features == 3


def test_libsvm_unseen_test_label_names_file_and_line(tmp_path: Path) -> None:
    train = load_libsvm(write(tmp_path / "tr", "1 1:1\n2 1:2\n"))
    path = write(tmp_path / "te", "1 1:1\n\n3 1:0\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:3: label 3 is not in"):
        load_libsvm(path, label_map=train.label_map)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("1 x:1", "bad feature 'x:1'"),
        ("1 2:x", "bad feature '2:x'"),
        ("1 3:", "bad feature '3:'"),
        ("1 :3", "bad feature ':3'"),
        ("1 3", "bad feature '3'"),
        ("1 1:2:3 5", "bad feature '1:2:3'"),
        ("1 0:1", "bad feature '0:1'"),
        ("1 -1:1", "bad feature '-1:1'"),
        ("1 1.5:1", "bad feature '1.5:1'"),
        (
            "1 qid:3 1:1",
            "bad feature 'qid:3' (a query id of the ranking format, which this "
            "loader does not read: drop the qid:N tokens",
        ),
        (
            "1 1:1\r2 2:1",
            "bad feature '2' (the line holds a '\\r' inside it, a line end of "
            "another system: two examples may have run together",
        ),
        ("a 1:1", "bad label 'a'"),
        ("1.5 1:1", "bad label '1.5'"),
        # Python's digit separators, which int() and float() read and LIBSVM's strtod refuses
        ("1_0 1:1", "bad label '1_0'"),
        ("1 1_0:1", "bad feature '1_0:1'"),
        ("1 1:1_000", "bad feature '1:1_000'"),
        ("1 1:1e1_0", "bad feature '1:1e1_0'"),
        ("1 2:1 2:3", "feature index 2 appears twice"),
        ("1 9:1", "feature index 9 exceeds n_features=4"),
    ],
)
def test_libsvm_malformed_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path / "dna.scale", f"1 1:1\n2 2:1 3:1\n\n{line}\n3 4:1\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:4: {re.escape(message)}"):
        load_libsvm(path, n_features=4, cache_dir=False)


def test_libsvm_lenient_numbers_and_empty_file(tmp_path: Path) -> None:
    # Integral numbers in other spellings, as NumPy reads them; both parsers agree.
    data = load_libsvm(write(tmp_path / "l", "+1 1:1\n2.0 1:2\n-1.0 1:3\n"))
    assert data.label_map == (-1, 1, 2) and data.y.tolist() == [1, 2, 0]
    text = "1 1:1\n2 1:2 +2:5\n-1 1:3 3.0:-1e-1 4e0:7\n"
    expected = np.array([[1, 0, 0, 0], [2, 5, 0, 0], [3, 0, -0.1, 7]], dtype=np.float32)
    np.testing.assert_array_equal(libsvm._parse_fast(text, None).x, expected)
    np.testing.assert_array_equal(libsvm._parse_reference(text, "l", None).x, expected)
    with pytest.raises(ValueError, match="no examples"):
        load_libsvm(write(tmp_path / "empty", "# nothing\n\n"))


def test_libsvm_matches_a_random_matrix_and_the_reference_parser(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n, d = 300, 40
    dense = rng.standard_normal((n, d)).astype(np.float32)
    dense[rng.random((n, d)) < 0.7] = 0
    labels = rng.choice([-7, -1, 0, 3, 100], size=n)
    lines = []
    for row, label in zip(dense, labels, strict=True):
        nz = np.flatnonzero(row)
        lines.append(" ".join([str(label), *(f"{j + 1}:{row[j]:.9g}" for j in nz)]))
    text = "\n".join(lines)
    data = load_libsvm(write(tmp_path / "rand", text), n_features=d, cache_dir=False)
    np.testing.assert_array_equal(data.x.numpy(), dense)
    classes = sorted(set(labels.tolist()))
    assert data.label_map == tuple(classes)
    assert data.y.tolist() == [classes.index(v) for v in labels]
    fast = libsvm._parse_fast(text, d)
    slow = libsvm._parse_reference(text, "rand", d)
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"99999999999999999999 1:1\n", r":1: label '99999999999999999999' is out of range"),
        (b"1 1:1\n1e20 1:1\n", r":2: label '1e20' is out of range"),
        (b"1 1000000000000:1\n", r":1: feature index 1000000000000 is above 16,777,216"),
        (b"1 1:1\n2 1e30:1\n", r":2: feature index 1e30 is above"),
        (b"1 99999999999999999999:1\n", r":1: feature index 99999999999999999999 is above"),
        (b"1 1:1\r2 2:1\r", r": lines end in '\\r' alone"),
        (gzip.compress(b"1 1:1\n"), ": a gzip-compressed file; decompress it first"),
        (bz2.compress(b"1 1:1\n"), ": a bzip2-compressed file; decompress it first"),
    ],
    ids=[
        "label-int",
        "label-float",
        "index-1e12",
        "index-1e30",
        "index-bigint",
        "cr-only",
        "gzip",
        "bzip2",
    ],
)
def test_libsvm_hostile_files_name_the_file(tmp_path: Path, content: bytes, message: str) -> None:
    """Each is a ValueError naming the file (and the line where there is one), never an
    OverflowError, a MemoryError or NumPy's words."""
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}{message}"):
        load_libsvm(path, cache_dir=False)


def test_libsvm_refuses_a_dense_matrix_over_the_size_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "wide", "1 1:1\n2 1000:1\n3 5:1\n")
    monkeypatch.setattr(libsvm, "MAX_DENSE_BYTES", 3 * 999 * 4)  # 3 x 1000 floats is one too many
    with pytest.raises(ValueError, match=r"wide: 3 examples x 1,000 features make a dense float32"):
        load_libsvm(path, cache_dir=False)
    with pytest.raises(ValueError, match=r"3 examples x 5,000 features"):  # an explicit width too
        load_libsvm(path, n_features=5000, cache_dir=False)
    monkeypatch.setattr(libsvm, "MAX_DENSE_BYTES", 3 * 1000 * 4)
    assert load_libsvm(path, cache_dir=False).x.shape == (3, 1000)
    # an index above MAX_FEATURE_INDEX is read when n_features says the file is that wide
    monkeypatch.setattr(libsvm, "MAX_FEATURE_INDEX", 100)
    with pytest.raises(ValueError, match=r"wide:2: feature index 1000 is above 100"):
        load_libsvm(path, cache_dir=False)
    assert load_libsvm(path, n_features=1000, cache_dir=False).x[1, 999] == 1


@pytest.mark.parametrize("n_features", ["3", 2.5, 3.0, True, 0, -1])
def test_libsvm_n_features_must_be_a_positive_int(tmp_path: Path, n_features: object) -> None:
    path = write(tmp_path / "f", "1 1:1\n")
    with pytest.raises(ValueError, match=r"n_features must be a positive int, got"):
        load_libsvm(path, n_features=n_features, cache_dir=False)  # type: ignore[arg-type]
    assert load_libsvm(path, n_features=np.int64(3), cache_dir=False).x.shape == (1, 3)


# ------------------------------------------------------------------------------------------ IDX


def idx_bytes(array: np.ndarray) -> bytes:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C, np.dtype(">f8"): 0x0E}
    big = array.astype(array.dtype.newbyteorder(">")) if array.dtype.itemsize > 1 else array
    header = bytes([0, 0, codes[big.dtype], array.ndim]) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    return header + big.tobytes()


def write_mnist(directory: Path, n_train: int = 6, n_test: int = 4, gz: bool = True) -> dict:
    rng = np.random.default_rng(1)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"{split}-{kind}-ubyte"
            blob = idx_bytes(array)
            if gz:
                (directory / f"{name}.gz").write_bytes(gzip.compress(blob))
            else:
                (directory / name).write_bytes(blob)
        arrays[split] = (images, labels)
    return arrays


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    arrays = write_mnist(tmp_path / "mnist", gz=gz)
    images, labels = arrays["train"]
    train = load_mnist(tmp_path / "mnist", "train")
    assert train.x.shape == (6, 1, 28, 28) and train.n_features == 784
    assert torch.equal(train.x, torch.from_numpy(images[:, None]).float() / 255)
    assert train.y.tolist() == labels.tolist()
    assert train.label_map == tuple(range(10)) and train.name == "MNIST"
    test = load_mnist(tmp_path / "mnist", "test", dtype=torch.uint8)
    assert torch.equal(test.x, torch.from_numpy(arrays["t10k"][0][:, None]))


def test_read_idx_other_types(tmp_path: Path) -> None:
    for array in (np.arange(-6, 6, dtype=np.int32).reshape(3, 4), np.linspace(0, 1, 5)):
        path = tmp_path / "a.idx"
        path.write_bytes(idx_bytes(array))
        out = read_idx(path)
        assert out.dtype.isnative and out.dtype.kind == array.dtype.kind
        np.testing.assert_array_equal(out, array)


def test_idx_rejects_bad_files(tmp_path: Path) -> None:
    good = idx_bytes(np.zeros((2, 3, 3), dtype=np.uint8))
    cases = {
        "magic": (b"\x08\x03" + good[2:], "not an IDX file"),
        "type": (good[:2] + b"\x42" + good[3:], "not an IDX file"),
        "short": (good[:-1], "header promises shape"),
    }
    for name, (blob, message) in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ValueError, match=message):
            read_idx(tmp_path / name)
    (tmp_path / "good.gz").write_bytes(gzip.compress(good))
    with pytest.raises(ValueError, match="expected an IDX file with 1 dimensions, found 3"):
        read_idx(tmp_path / "good.gz", ndim=1)


def test_idx_truncated_gzip_and_header_name_the_file(tmp_path: Path) -> None:
    good = idx_bytes(np.zeros((2, 3, 3), dtype=np.uint8))
    cases = {
        "cut.gz": (gzip.compress(good)[:-10], "truncated or corrupt gzip file"),
        "crc.gz": (gzip.compress(good)[:-8] + b"\0" * 8, "truncated or corrupt gzip file"),
        "header": (bytes([0, 0, 8, 3, 0, 0]), r"truncated IDX header \(3 dimensions need 16"),
        "header.gz": (gzip.compress(bytes([0, 0, 8, 1])), r"truncated IDX header \(1 dimensions"),
    }
    for name, (blob, message) in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / name))}: {message}"):
            read_idx(tmp_path / name)


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_mnist_labels_outside_0_to_9_name_the_file(tmp_path: Path, gz: bool) -> None:
    folder = tmp_path / "mnist"
    write_mnist(folder, gz=gz)
    name = "t10k-labels-idx1-ubyte" + (".gz" if gz else "")
    blob = idx_bytes(np.array([1, 12, 3, 4], dtype=np.uint8))
    (folder / name).write_bytes(gzip.compress(blob) if gz else blob)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(folder / name))}: label 12 at index 1"):
        load_mnist(folder, "test")


# ---------------------------------------------------------------------------------------- CIFAR

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                 "truck"]  # fmt: skip


def dump(path: Path, obj: object, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=protocol))


def write_cifar10(directory: Path, per_batch: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    directory.mkdir(parents=True)
    data = rng.integers(0, 256, size=(6 * per_batch, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, size=6 * per_batch).tolist()
    names = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]
    for i, name in enumerate(names):
        rows = slice(i * per_batch, (i + 1) * per_batch)
        dump(directory / name, {b"data": data[rows], b"labels": labels[rows]})
    dump(directory / "batches.meta", {b"label_names": [n.encode() for n in CIFAR10_NAMES]})
    return data, np.array(labels)


def test_cifar10_pickle(tmp_path: Path) -> None:
    data, labels = write_cifar10(tmp_path / "cifar-10-batches-py")
    train = load_cifar_pickle(tmp_path / "cifar-10-batches-py", "train", dtype=torch.uint8)
    assert train.x.shape == (15, 3, 32, 32) and train.n_features == 3072
    # Pixel (channel c, row h, column w) of image i is byte c*1024 + h*32 + w of its row.
    i, c, h, w = 7, 2, 5, 30
    assert train.x[i, c, h, w].item() == data[i, c * 1024 + h * 32 + w]
    assert torch.equal(train.x.reshape(15, -1), torch.from_numpy(data[:15]))
    assert train.y.tolist() == labels[:15].tolist()
    assert train.label_map == tuple(CIFAR10_NAMES) and train.name == "CIFAR-10"
    test = load_cifar_pickle(tmp_path / "cifar-10-batches-py", "test")
    assert torch.equal(test.x.reshape(3, -1), torch.from_numpy(data[15:]).float() / 255)
    with pytest.raises(ValueError, match="coarse=True needs CIFAR-100"):
        load_cifar_pickle(tmp_path / "cifar-10-batches-py", coarse=True)
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4"):
        load_cifar_pickle(tmp_path / "cifar-10-batches-py", "train", cache_dir=False)


def test_cifar100_pickle_fine_and_coarse(tmp_path: Path) -> None:
    # str keys and protocol 2 this time (both occur in the wild).
    rng = np.random.default_rng(3)
    directory = tmp_path / "cifar-100-python"
    directory.mkdir()
    data = rng.integers(0, 256, size=(4, 3072), dtype=np.uint8)
    fine, coarse = [0, 99, 42, 7], [0, 19, 3, 3]
    batch = {"data": data, "fine_labels": fine, "coarse_labels": coarse}
    dump(directory / "train", batch, protocol=2)
    dump(directory / "test", batch, protocol=2)
    fine_names = [f"f{k}" for k in range(100)]
    coarse_names = [f"c{k}" for k in range(20)]
    meta = {"fine_label_names": fine_names, "coarse_label_names": coarse_names}
    dump(directory / "meta", meta, protocol=2)
    train = load_cifar_pickle(directory, "train")
    assert train.y.tolist() == fine and train.n_classes == 100 and train.name == "CIFAR-100"
    assert train.label_map == tuple(fine_names)
    test = load_cifar_pickle(directory, "test", coarse=True)
    assert test.y.tolist() == coarse and test.label_map == tuple(coarse_names)
    assert test.name == "CIFAR-100 (coarse)"


class Boom:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo should-not-run",))


@pytest.mark.parametrize("labels", [["x", "y", "z"], ["1", "2", "3"], [0.0, 1.0, 2.0]])
def test_cifar_labels_must_be_integers(tmp_path: Path, labels: list[object]) -> None:
    """Strings and floats are refused (NumPy would turn "1" or 1.0 into 1 without a word)."""
    write_cifar10(tmp_path / "c")
    batch = tmp_path / "c" / "test_batch"
    dump(batch, {"data": np.zeros((3, 3072), dtype=np.uint8), "labels": labels})
    with pytest.raises(ValueError, match=rf"^{re.escape(str(batch))}: labels must be integers"):
        load_cifar_pickle(tmp_path / "c", "test", cache_dir=False)


@pytest.mark.parametrize(
    ("pixels", "text"),
    [
        (np.full((3, 3072), 300, dtype=np.int64), "got values from 300 to 300"),
        (np.full((3, 3072), 0.5), r"got float64 values \(e\.g\. 0\.5\)"),
        (np.arange(3 * 3072, dtype=np.int64).reshape(3, 3072) % 256, None),  # int64 in range: fine
    ],
)
def test_cifar_pixels_must_be_bytes(tmp_path: Path, pixels: np.ndarray, text: str | None) -> None:
    """Out-of-range and float pixels wrapped or truncated in the cast to uint8 (300 -> 44)."""
    write_cifar10(tmp_path / "c")
    batch = tmp_path / "c" / "test_batch"
    dump(batch, {"data": pixels, "labels": [0, 1, 2]})
    if text is None:
        got = load_cifar_pickle(tmp_path / "c", "test", dtype=torch.uint8, cache_dir=False).x
        assert torch.equal(got.reshape(3, -1), torch.from_numpy(pixels.astype(np.uint8)))
        return
    with pytest.raises(ValueError, match=rf"pixels must be integers in 0\.\.255 .*{text}"):
        load_cifar_pickle(tmp_path / "c", "test", cache_dir=False)


def test_cifar_pickle_refuses_code(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    write_cifar10(directory)
    dump(directory / "test_batch", {b"data": Boom(), b"labels": []})
    with pytest.raises(ValueError, match=r"refusing to load (posix|os)\.system"):
        load_cifar_pickle(directory, "test")


# ---------------------------------------------------------------------------------- image folder


def write_tree(root: Path) -> dict[str, np.ndarray]:
    """class 'b': two RGB PNGs; class 'a': a JPEG and a grayscale PNG; plus clutter."""
    image_module = pytest.importorskip("PIL.Image")

    rng = np.random.default_rng(4)
    pixels = {
        "b/0.png": rng.integers(0, 256, size=(6, 5, 3), dtype=np.uint8),
        "b/1.PNG": rng.integers(0, 256, size=(6, 5, 3), dtype=np.uint8),
        "a/x.jpg": np.full((6, 5, 3), (200, 40, 90), dtype=np.uint8),
        "a/y.png": rng.integers(0, 256, size=(6, 5), dtype=np.uint8),
    }
    for rel, array in pixels.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        kind = "JPEG" if rel.endswith(".jpg") else "PNG"
        image_module.fromarray(array).save(root / rel, format=kind, quality=95)
    (root / "b" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    return pixels


@pytest.mark.parametrize("mode", ["rgb", "CMYK", "RGBA"])
def test_image_folder_mode_must_be_rgb_or_l(tmp_path: Path, mode: str) -> None:
    """A bad mode blamed the first image ("cannot decode image"), or (CMYK) was taken."""
    write_tree(tmp_path / "tree")
    with pytest.raises(ValueError, match=rf"mode must be 'RGB' .* or 'L' .*, got '{mode}'"):
        load_image_folder(tmp_path / "tree", mode=mode, cache_dir=False)


def test_libsvm_file_with_a_byte_order_mark(tmp_path: Path) -> None:
    """An editor's UTF-8 byte-order mark was read into the first label ("bad label 'ï»¿1'")."""
    path = tmp_path / "bom.svm"
    path.write_bytes(b"\xef\xbb\xbf1 1:0.5\n2 2:-1\n")
    data = load_libsvm(path, cache_dir=False)
    assert data.x.tolist() == [[0.5, 0.0], [0.0, -1.0]] and data.label_map == (1, 2)


def test_image_folder(tmp_path: Path) -> None:
    pixels = write_tree(tmp_path / "tree")
    data = load_image_folder(tmp_path / "tree", dtype=torch.uint8)
    assert data.label_map == ("a", "b") and data.y.tolist() == [0, 0, 1, 1]
    assert data.x.shape == (4, 3, 6, 5) and data.n_features == 90 and data.name == "tree"
    # PNG is lossless: exact. Files come in sorted order within a class.
    assert torch.equal(data.x[2], torch.from_numpy(pixels["b/0.png"]).permute(2, 0, 1))
    assert torch.equal(data.x[3], torch.from_numpy(pixels["b/1.PNG"]).permute(2, 0, 1))
    y_png = torch.from_numpy(pixels["a/y.png"])
    assert all(torch.equal(data.x[1, c], y_png) for c in range(3))  # L -> RGB copies the channel
    # JPEG is lossy: a flat colour survives to within a few levels.
    jpeg_error = (data.x[0].float() - torch.tensor([200.0, 40, 90])[:, None, None]).abs().max()
    assert jpeg_error <= 4
    scaled = load_image_folder(tmp_path / "tree")
    assert torch.equal(scaled.x, data.x.float() / 255)
    gray = load_image_folder(
        tmp_path / "tree", mode="L", limit_per_class=1, dtype=torch.uint8, cache_dir=False
    )
    assert gray.x.shape == (2, 1, 6, 5) and gray.y.tolist() == [0, 1]
    # Pillow's RGB -> L is ITU-R 601-2 luma, L = 0.299 R + 0.587 G + 0.114 B.
    rgb = pixels["b/0.png"].astype(np.float64)
    luma = rgb @ np.array([0.299, 0.587, 0.114])
    assert np.abs(gray.x[1, 0].numpy() - luma).max() <= 0.51


def test_image_folder_workers_match_serial(tmp_path: Path) -> None:
    write_tree(tmp_path / "tree")
    serial = load_image_folder(tmp_path / "tree", workers=1, cache_dir=False)
    parallel = load_image_folder(tmp_path / "tree", workers=2, cache_dir=False)
    assert torch.equal(serial.x, parallel.x) and torch.equal(serial.y, parallel.y)


def test_image_folder_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tree(tmp_path / "tree")
    from PIL import Image

    Image.fromarray(np.zeros((7, 5, 3), dtype=np.uint8)).save(tmp_path / "tree" / "b" / "2.png")
    with pytest.raises(ValueError, match=r"2\.png: image is 5x7 but .* is 5x6"):
        load_image_folder(tmp_path / "tree", cache_dir=False)
    with pytest.raises(ValueError, match=r"2\.png: image"):  # the worker reports it
        load_image_folder(tmp_path / "tree", workers=2, cache_dir=False)
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no images"):
        load_image_folder(tmp_path / "empty")
    for bad in (True, 0, 1.5, "2"):  # as load_dataset's limit_per_class, before any decoding
        with pytest.raises(ValueError, match="limit_per_class must be a positive int"):
            load_image_folder(tmp_path / "tree", limit_per_class=bad)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    with pytest.raises(ImportError, match="pip install pillow"):
        load_image_folder(tmp_path / "tree", limit_per_class=1, cache_dir=False)


# -------------------------------------------------------------------------------------- sklearn


def test_sklearn_digits() -> None:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    data = load_sklearn("digits")
    assert data.x.shape == (1797, 64) and data.n_classes == 10
    assert torch.equal(data.x, torch.tensor(bunch.data, dtype=torch.float32))
    assert torch.equal(data.y, torch.tensor(bunch.target))
    assert data.label_map == tuple(range(10))
    via_catalogue = load_dataset("digits")
    assert torch.equal(via_catalogue.x, data.x) and via_catalogue.split == "train"
    assert load_sklearn("breast_cancer").label_map == ("malignant", "benign")
    with pytest.raises(ValueError, match="choose from"):
        load_sklearn("mnist")


# ---------------------------------------------------------------------------------------- cache


def test_second_load_comes_from_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _isolated_cache: Path
) -> None:
    path = write(tmp_path / "f", "1 1:0.5\n2 2:1\n")
    first = load_libsvm(path)
    assert len(entries(_isolated_cache)) == 1

    def no_parsing(*args: object) -> None:
        raise AssertionError("parsed again")

    monkeypatch.setattr(libsvm, "_parse", no_parsing)
    second = load_libsvm(path)
    assert torch.equal(first.x, second.x) and first.label_map == second.label_map
    assert list(_isolated_cache.glob("*.tmp")) == []  # written atomically, nothing left over

    write_mnist(tmp_path / "mnist")
    load_mnist(tmp_path / "mnist")
    monkeypatch.setattr(idx, "read_idx", no_parsing)
    load_mnist(tmp_path / "mnist")

    write_tree(tmp_path / "tree")
    load_image_folder(tmp_path / "tree")
    monkeypatch.setattr(_pil_decode, "decode", no_parsing)
    load_image_folder(tmp_path / "tree")


def test_changed_content_gives_a_new_entry(tmp_path: Path, _isolated_cache: Path) -> None:
    path = write(tmp_path / "f", "1 1:0.5\n")
    assert load_libsvm(path).x.tolist() == [[0.5]]
    write(path, "1 1:0.25\n")
    assert load_libsvm(path).x.tolist() == [[0.25]]
    assert len(entries(_isolated_cache)) == 2
    load_libsvm(path, n_features=3)  # options are part of the key too
    assert len(entries(_isolated_cache)) == 3


def test_cache_dir_option_env_and_off(tmp_path: Path, _isolated_cache: Path) -> None:
    path = write(tmp_path / "f", "1 1:0.5\n")
    load_libsvm(path, cache_dir=tmp_path / "mine")
    assert len(entries(tmp_path / "mine")) == 1 and entries(_isolated_cache) == []
    load_libsvm(path, cache_dir=False)
    assert entries(_isolated_cache) == []
    assert cache.default_cache_dir() == _isolated_cache


def test_an_entry_cached_before_digit_separators_were_refused_is_not_served(
    tmp_path: Path, _isolated_cache: Path
) -> None:
    """The entry an earlier initlab cached for a file it read leniently (label 1_0 as 10) would
    have been served under the same key after the rules refused that file."""
    text = "1_0 1:1\n"
    path = write(tmp_path / "f", text)
    old_key = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "n_features": None}
    lenient = {"x": np.ones((1, 1), np.float32), "labels": np.array([10]), "lines": np.array([1])}
    cache.cached(_isolated_cache, "libsvm", "f", old_key, lambda: (lenient, {}))
    assert len(entries(_isolated_cache)) == 1
    with pytest.raises(ValueError, match=r":1: bad label '1_0'"):
        load_libsvm(path)


@pytest.mark.parametrize("content", [b"garbage", b""], ids=["garbage", "empty"])
def test_unreadable_cache_entry_is_rebuilt(
    tmp_path: Path, _isolated_cache: Path, content: bytes
) -> None:
    path = write(tmp_path / "f", "1 1:0.5\n")
    load_libsvm(path)
    (entry,) = entries(_isolated_cache)
    entry.write_bytes(content)  # b"": a crash or a full disk (numpy raised EOFError)
    assert load_libsvm(path).x.tolist() == [[0.5]]
    assert entry.read_bytes()[:2] == b"PK"  # a zip (npz) again


# ------------------------------------------------------------------------------------ catalogue


def test_data_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INITLAB_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "project" / "checkout"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert data_root() == tmp_path / "home" / "initlab-data"
    (tmp_path / "project" / "shared" / "data").mkdir(parents=True)
    assert data_root().resolve() == (tmp_path / "project" / "shared" / "data").resolve()
    monkeypatch.setenv("INITLAB_DATA_DIR", str(tmp_path / "env"))
    assert data_root() == tmp_path / "env"
    assert data_root(tmp_path / "arg") == tmp_path / "arg"


def test_load_dataset_names_a_root_a_level_off_and_a_folder_for_a_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "libsvm" / "iris.scale").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as caught:
        load_dataset("iris", root=root, cache_dir=False)
    assert str(caught.value) == (
        f"libsvm:iris: {root / 'libsvm' / 'iris.scale'} is a folder where the LIBSVM file of "
        f"that name should be (data root {root}, from root=); put the file itself there"
    )
    with pytest.raises(IsADirectoryError, match=r"iris\.scale is a folder; pass the LIBSVM file"):
        load_libsvm(root / "libsvm" / "iris.scale")
    deep = root / "libsvm"
    message = rf"\({re.escape(str(deep))} is one of a data root's folders \(libsvm/\), not the "
    message += rf"root: pass .* {re.escape(str(root))}\)"
    with pytest.raises(FileNotFoundError, match=message):
        load_dataset("letter", root=deep, cache_dir=False)
    # Scikit-learn's copy is offered with what differs from the LIBSVM one.
    with pytest.raises(FileNotFoundError, match=r"not scaled to \[-1, 1\] .* no test split\.$"):
        load_dataset("wine", root=root, cache_dir=False)


def test_load_dataset_by_name(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "libsvm").mkdir(parents=True)
    write(root / "libsvm" / "svmguide4", "-3 1:1\n2 10:1\n1 3:0.5")
    write(root / "libsvm" / "svmguide4.t", "2 1:1\n-3 2:2\n")
    write(root / "libsvm" / "glass.scale", "1 1:1\n")
    train = load_dataset("svmguide4", root=root)
    test = load_dataset("libsvm:svmguide4", "test", root=root)
    assert train.n_features == test.n_features == 10  # fixed by the catalogue
    assert test.label_map == train.label_map == (-3, 1, 2)
    assert test.y.tolist() == [2, 0] and (train.name, test.split) == ("svmguide4", "test")
    with pytest.raises(ValueError, match="libsvm:glass has no 'test' split"):
        load_dataset("glass", "test", root=root)
    # A bare name is the LIBSVM set (the study's); scikit-learn's needs its prefix.
    assert load_dataset("glass", root=root).name == "glass"
    assert load_dataset("sklearn:wine", root=root).name == "wine (scikit-learn)"
    with pytest.raises(FileNotFoundError, match="libsvm:wine: not found"):
        load_dataset("wine", root=root)
    with pytest.raises(ValueError, match="unknown data set 'nope'"):
        load_dataset("nope", root=root)
    message = rf"looked for {re.escape(str(root / 'libsvm' / 'letter.scale'))} .*INITLAB_DATA_DIR"
    with pytest.raises(FileNotFoundError, match=message):
        load_dataset("letter", root=root)
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py.*cifar10-jpeg"):
        load_dataset("cifar10", root=root)
    rows = {r["name"]: r for r in list_datasets(root)}
    assert rows["libsvm:svmguide4"]["available"] and not rows["libsvm:letter"]["available"]
    assert rows["libsvm:dna"]["n_test"] == 1186 and rows["libsvm:glass"]["splits"] == ("train",)


def test_a_named_set_that_is_not_the_published_one_is_warned_about(tmp_path: Path) -> None:
    """A LIBSVM file cut short (an interrupted download) parsed as fewer rows, and a missing
    class renumbered the rest, without a word. The oracle: the catalogue's published counts."""
    root = tmp_path / "root"
    (root / "libsvm").mkdir(parents=True)
    rows = [f"{1 + i % 3} 1:{i / 150:.3f} 2:0.5" for i in range(150)]
    write(root / "libsvm" / "iris.scale", "\n".join(rows) + "\n")
    assert len(load_dataset("iris", root=root).y) == 150  # the published size: no warning
    write(root / "libsvm" / "iris.scale", "\n".join(rows[:75]) + "\n")
    with pytest.warns(UserWarning, match=r"libsvm:iris \(train split\) loaded with 75 examples "
                      r"where the published set has 150"):  # fmt: skip
        load_dataset("iris", root=root)
    two = [f"{1 + i % 2} 1:{i / 150:.3f} 2:0.5" for i in range(150)]  # classes 1 and 2 only
    write(root / "libsvm" / "iris.scale", "\n".join(two) + "\n")
    with pytest.warns(UserWarning, match="loaded with 2 classes where the published set has 3"):
        load_dataset("iris", root=root)


def test_cifar10_prefers_pickles_over_the_jpeg_copy(tmp_path: Path) -> None:
    write_tree(tmp_path / "cifar10-jpeg" / "train")
    jpeg = load_dataset("cifar10", root=tmp_path, dtype=torch.uint8)
    assert jpeg.name == "CIFAR-10 (JPEG copy)" and jpeg.x.shape == (4, 3, 6, 5)
    write_cifar10(tmp_path / "cifar-10-batches-py")
    assert load_dataset("cifar10", root=tmp_path).name == "CIFAR-10"


def test_dataset_record() -> None:
    data = Dataset(torch.zeros(3, 2), torch.tensor([0, 1, 1]), "toy", 2, 2, (-1, 1))
    assert len(data) == 3 and data[1][1].item() == 1
    assert repr(data) == "Dataset('toy', x=(3, 2) torch.float32, n_features=2, n_classes=2)"
    with pytest.raises(ValueError, match="x has 3 rows but y has 2"):
        Dataset(torch.zeros(3, 2), torch.tensor([0, 1]), "toy", 2, 2, (-1, 1))
    with pytest.raises(ValueError, match="label_map has 2"):
        Dataset(torch.zeros(3, 2), torch.tensor([0, 1, 1]), "toy", 2, 3, (-1, 1))


# ------------------------------------------------------------------------- the real data (if any)

real = pytest.mark.skipif(not REAL_DATA.is_dir(), reason=f"no data at {REAL_DATA}")

# The table of the data README: file, rows (train, test), features, classes, labels as stored.
LIBSVM_TABLE = [
    ("dna", (2000, 1186), 180, 3, tuple(range(1, 4))),
    ("glass", (214, None), 9, 6, (1, 2, 3, 5, 6, 7)),
    ("iris", (150, None), 4, 3, tuple(range(1, 4))),
    ("letter", (15000, 5000), 16, 26, tuple(range(1, 27))),
    ("pendigits", (7494, 3498), 16, 10, tuple(range(10))),
    ("satimage", (4435, 2000), 36, 6, tuple(range(1, 7))),
    ("segment", (2310, None), 19, 7, tuple(range(1, 8))),
    ("svmguide2", (391, None), 20, 3, tuple(range(1, 4))),
    ("svmguide4", (300, 312), 10, 6, (-3, -2, -1, 1, 2, 3)),
    ("vehicle", (846, None), 18, 4, tuple(range(1, 5))),
    ("vowel", (528, None), 10, 11, tuple(range(11))),
    ("wine", (178, None), 13, 3, tuple(range(1, 4))),
]


@real
@pytest.mark.parametrize(("name", "rows", "n_features", "n_classes", "labels"), LIBSVM_TABLE)
def test_real_libsvm(
    name: str, rows: tuple[int, int | None], n_features: int, n_classes: int, labels: tuple
) -> None:
    train = load_dataset(f"libsvm:{name}", root=REAL_DATA, cache_dir=False)
    assert (len(train), train.n_features, train.n_classes) == (rows[0], n_features, n_classes)
    assert train.label_map == labels and train.x.shape == (rows[0], n_features)
    assert set(train.y.tolist()) == set(range(n_classes))
    if rows[1] is not None:
        test = load_dataset(f"libsvm:{name}", "test", root=REAL_DATA, cache_dir=False)
        assert (len(test), test.n_features, test.label_map) == (rows[1], n_features, labels)
    else:
        with pytest.raises(ValueError, match="no 'test' split"):
            load_dataset(f"libsvm:{name}", "test", root=REAL_DATA)


@real
def test_real_mnist() -> None:
    train = load_dataset("mnist", root=REAL_DATA, cache_dir=False)
    assert train.x.shape == (60000, 1, 28, 28) and train.n_features == 784
    assert train.x.double().mean().item() == pytest.approx(0.13066, abs=5e-6)
    canonical = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert torch.bincount(train.y).tolist() == canonical
    test = load_dataset("mnist", "test", root=REAL_DATA, cache_dir=False, dtype=torch.uint8)
    assert test.x.shape == (10000, 1, 28, 28) and test.x.dtype == torch.uint8


@real
def test_real_cifar_jpeg_subset() -> None:
    # The full tree takes seconds to decode; a subset checks the layout.
    data = load_image_folder(
        REAL_DATA / "cifar10-jpeg" / "test", limit_per_class=10, split="test", cache_dir=False
    )
    assert data.x.shape == (100, 3, 32, 32) and data.label_map == tuple(CIFAR10_NAMES)
    assert torch.bincount(data.y).tolist() == [10] * 10
    assert 0.3 < data.x.mean().item() < 0.6


def test_libsvm_a_crlf_file_is_not_blamed_on_its_line_ends(tmp_path: Path) -> None:
    """Every line of a Windows file ends in '\\r': a bad token on one was explained as "a '\\r'
    inside the line" (and told to run tr)."""
    path = tmp_path / "crlf.svm"
    path.write_bytes(b"1 1:0.5\r\n2 2:x:y\r\n")
    with pytest.raises(ValueError, match=r":2: bad feature '2:x:y'$"):
        load_libsvm(path, cache_dir=False)
    path.write_bytes(b"1 1:0.5\r\n2 1:0.1\r\n")
    assert load_libsvm(path, cache_dir=False).x.shape == (2, 1)
