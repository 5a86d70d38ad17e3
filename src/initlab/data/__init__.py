"""Data sets for initlab's experiments: tensors plus the metadata a report needs.

Every loader returns a :class:`Dataset` (``x``, ``y``, ``name``, ``n_features``, ``n_classes``,
``label_map``, ``split``). Formats, one module each:

* :func:`load_libsvm` — LIBSVM text (:mod:`initlab.data.libsvm`);
* :func:`load_mnist`, :func:`read_idx` — IDX files (:mod:`initlab.data.idx`);
* :func:`load_cifar_pickle` — CIFAR-10/100 python batches (:mod:`initlab.data.cifar`);
* :func:`load_image_folder` — ``<class>/<image>`` trees via Pillow (:mod:`initlab.data.images`);
* :func:`load_sklearn` — scikit-learn's bundled sets (:mod:`initlab.data.sklearn_sets`).

:func:`load_dataset` loads a named set from the data root (:mod:`initlab.data.catalogue`), and
decoded arrays are cached on disk keyed by the sources' content (:mod:`initlab.data.cache`).

Example::

    from initlab.data import load_dataset

    train = load_dataset("letter")  # LIBSVM letter.scale: 15000 x 16, 26 classes
    test = load_dataset("letter", "test")  # same columns and label map
"""

from initlab.data.cache import default_cache_dir
from initlab.data.catalogue import CATALOGUE, data_root, list_datasets, load_dataset
from initlab.data.cifar import load_cifar_pickle
from initlab.data.dataset import Dataset
from initlab.data.idx import load_mnist, read_idx
from initlab.data.images import load_image_folder
from initlab.data.libsvm import load_libsvm
from initlab.data.sklearn_sets import load_sklearn

__all__ = [
    "CATALOGUE",
    "Dataset",
    "data_root",
    "default_cache_dir",
    "list_datasets",
    "load_cifar_pickle",
    "load_dataset",
    "load_image_folder",
    "load_libsvm",
    "load_mnist",
    "load_sklearn",
    "read_idx",
]
